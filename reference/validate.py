"""Every validity condition of spec/KeyValueCache.md section "Validity", checked before any write.

``validate_call`` returns a :class:`CallPlan` (the slot of every stored and loaded token) or raises
:class:`KeyValueCacheError` naming the input, the sequence index and the values involved.
"""

import dataclasses

import numpy as np

from .dtypes import CACHE_TYPE_FOR_QUANT_BIT, INT4, T1_TYPES, T3_TYPES, dtype_name
from .layout import LAYOUT_AXES, cache_shape, dims_of


class KeyValueCacheError(ValueError):
    """Invalid input to KeyValueCache; raised before anything is written."""


@dataclasses.dataclass(frozen=True)
class Attributes:
    """The op's attributes, with the spec's defaults."""

    num_layer: int = 1
    layer_idx: int = 0
    quant_bit: int = 0
    quant_group: int = 8
    num_repeat: int = 1
    cache_mode: int = 0
    cache_layout: int = 0
    page_size: int = 128


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """What one valid call touches: per sequence b, token ranges and cache slots."""

    seq_begin: list  # [B] first row of sequence b in current_key
    seq_len: list  # [B]
    kv_begin: list  # [B] first row of sequence b in key/value
    kv_len: list  # [B]
    store_slots: list  # [B] int64 arrays [seq_len[b]]: slot of position start_pos[b] + i
    load_slots: list  # [B] int64 arrays [kv_len[b]]: slot of position t


def fail(message: str):
    raise KeyValueCacheError(message)


def check_attributes(a: Attributes) -> None:
    """Attribute values the spec allows (independent of the inputs)."""
    if a.num_layer < 1:
        fail(f"num_layer must be >= 1, got {a.num_layer}")
    if not 0 <= a.layer_idx < a.num_layer:
        fail(f"layer_idx must be in [0, num_layer={a.num_layer}), got {a.layer_idx}")
    if a.quant_bit not in CACHE_TYPE_FOR_QUANT_BIT:
        fail(f"quant_bit must be 0, 4 or 8, got {a.quant_bit}")
    if a.quant_group < 1:
        fail(f"quant_group must be >= 1, got {a.quant_group}")
    if a.num_repeat < 1:
        fail(f"num_repeat must be >= 1, got {a.num_repeat}")
    if a.cache_mode not in (0, 1):
        fail(f"cache_mode must be 0 (offset) or 1 (paged), got {a.cache_mode}")
    if a.cache_layout not in LAYOUT_AXES:
        fail(f"cache_layout must be 0, 1, 2 or 3, got {a.cache_layout}")
    if a.page_size < 1:
        fail(f"page_size must be >= 1, got {a.page_size}")


def index_vector(name: str, array, length=None) -> list:
    """The values of a 1-D int64 index input (of shape ``(length,)`` when given), read once."""
    array = np.asarray(array)
    if array.dtype != np.int64:
        fail(f"{name} must be int64, got {dtype_name(array.dtype)}")
    if array.ndim != 1:
        fail(f"{name} must be 1-D, got shape {array.shape}")
    if length is not None and array.shape[0] != length:
        fail(f"{name} must have shape ({length},), got {array.shape}")
    return array.tolist()


def index_scalar(name: str, value) -> int:
    """The value of an int64 scalar input (rank 0 or shape ``(1,)``)."""
    array = np.asarray(value)
    if array.dtype != np.int64 and not isinstance(value, int):
        fail(f"{name} must be an int64 scalar, got {dtype_name(array.dtype)}")
    if array.size != 1 or array.ndim > 1:
        fail(f"{name} must be a scalar or shape (1,), got shape {array.shape}")
    return int(array.reshape(()))


def starts_lengths(name: str, starts: list, total_name: str, total=None) -> list:
    """Lengths from a starts vector: starts[0] == 0, non-decreasing, starts[B] == total."""
    if starts[0] != 0:
        fail(f"{name}[0] must be 0, got {starts[0]}")
    lengths = []
    for b in range(len(starts) - 1):
        if starts[b + 1] < starts[b]:
            fail(f"{name} must be non-decreasing: {name}[{b + 1}] = {starts[b + 1]} < {name}[{b}] = {starts[b]}")
        lengths.append(starts[b + 1] - starts[b])
    if total is not None and starts[-1] != total:
        fail(f"{name}[B={len(starts) - 1}] = {starts[-1]} must equal {total_name} = {total}")
    return lengths


def check_max(name: str, what: str, given: int, lengths: list) -> None:
    """A launch bound must cover the longest sequence (and be >= 0 for an empty batch)."""
    if not lengths:
        if given < 0:
            fail(f"{name} = {given} must be >= 0")
        return
    longest = max(lengths)
    if given < longest:
        fail(f"{name} = {given} is smaller than {what} of sequence {lengths.index(longest)} = {longest}")


def effective_scale(scale, quant_bit):
    """``scale``, or ``None`` when ``quant_bit`` is 0 and ``scale`` has no elements: ppl.pmx exports an
    unquantized cache with an empty ``kv_scale`` input, which the spec treats as absent."""
    if quant_bit == 0 and scale is not None and np.asarray(scale).size == 0:
        return None
    return scale


def check_tensors(current_key, current_value, cache, scale, a: Attributes) -> tuple:
    """Ranks, dtypes and shape relations of the data tensors; returns (H, Dh, MaxT)."""
    for name, x in (("current_key", current_key), ("current_value", current_value)):
        if x.dtype not in T1_TYPES:
            fail(f"{name} dtype must be float32, float16 or bfloat16, got {dtype_name(x.dtype)}")
        if x.ndim != 3:
            fail(f"{name} must have rank 3 (tokens, H, Dh), got shape {x.shape}")
    if current_value.dtype != current_key.dtype or current_value.shape != current_key.shape:
        fail(
            f"current_value ({dtype_name(current_value.dtype)}{current_value.shape}) must match "
            f"current_key ({dtype_name(current_key.dtype)}{current_key.shape})"
        )
    _, heads, head_dim = current_key.shape
    if heads < 1 or head_dim < 1:
        fail(f"current_key must have H >= 1 and Dh >= 1, got shape {current_key.shape}")
    want = CACHE_TYPE_FOR_QUANT_BIT[a.quant_bit] or current_key.dtype
    if cache.dtype != want:
        fail(f"cache dtype must be {dtype_name(want)} for quant_bit={a.quant_bit} and "
             f"current_key {dtype_name(current_key.dtype)}, got {dtype_name(cache.dtype)}")
    if cache.ndim != 5:
        fail(f"cache must have rank 5 {LAYOUT_AXES[a.cache_layout]}, got shape {cache.shape}")
    max_t = dims_of(a.cache_layout, cache.shape)["MaxT"]
    expected = cache_shape(a.cache_layout, a.num_layer, max_t, heads, head_dim)
    if cache.shape != expected:
        fail(f"cache shape must be {expected} for cache_layout={a.cache_layout} "
             f"{LAYOUT_AXES[a.cache_layout]}, num_layer={a.num_layer}, H={heads}, Dh={head_dim}; got {cache.shape}")
    if a.quant_bit == 0:
        if scale is not None:
            fail("scale must be absent when quant_bit is 0")
        return heads, head_dim, max_t
    if head_dim % a.quant_group:
        fail(f"quant_group={a.quant_group} must divide Dh={head_dim}")
    if cache.dtype == INT4 and head_dim % 2:
        fail(f"int4 cache needs an even Dh (whole bytes per row), got Dh={head_dim}")
    if scale is None:
        fail(f"scale is required when quant_bit is {a.quant_bit}")
    if scale.dtype not in T3_TYPES:
        fail(f"scale dtype must be float32 or float16, got {dtype_name(scale.dtype)}")
    expected = cache_shape(a.cache_layout, a.num_layer, max_t, heads, head_dim // a.quant_group)
    if scale.shape != expected:
        fail(f"scale shape must be {expected} (cache shape with last dim Dh/quant_group), got {scale.shape}")
    return heads, head_dim, max_t


def check_writable(**arrays) -> None:
    """Every array an op writes in place can be written: a read-only one (``np.memmap(mode="r")``, a view of
    bytes, ``setflags(write=False)``) is refused before any write, so the other is not left written either. Checked
    by the ops after :func:`validate_call` (which plans read-only calls too: the validation kit's)."""
    for name, array in arrays.items():
        if isinstance(array, np.ndarray) and not array.flags.writeable:
            fail(f"{name} is read-only, but the op writes it in place (pass a writable array)")


def _offset_slots(b, base, max_t, touched_end, positions):
    """cache_mode 0: slot = cachestarts[b] + position, for every touched position."""
    if touched_end and (base < 0 or base > max_t - touched_end):
        fail(f"cachestarts[{b}] = {base}: sequence {b} touches positions [0, {touched_end}) so it needs "
             f"0 <= cachestarts[{b}] and cachestarts[{b}] + {touched_end} <= MaxT = {max_t}")
    return [base + p for p in positions()]


def _paged_slots(b, pages, a, max_t, seq_len, kv_len, start, touched_end, positions):
    """cache_mode 1: slot = cachestarts[b, p // page_size] + p % page_size.

    Every touched page is bounds-checked from page numbers alone (store pages
    [start // page_size, (start + seq_len - 1) // page_size], load pages [0, (kv_len - 1) // page_size])
    before any array of positions is built, so a huge page_size or start_pos is the spec's error, not
    an allocation of every position it names."""
    if touched_end == 0:
        return [np.zeros(0, np.int64) for _ in positions()]
    last_page = (touched_end - 1) // a.page_size
    if last_page >= len(pages):
        fail(f"cachestarts: sequence {b} touches position {touched_end - 1}, which is in page {last_page}, "
             f"but cachestarts has MaxP = {len(pages)} pages per sequence")
    load_last = (kv_len - 1) // a.page_size if kv_len else -1
    store_first, store_last = (start // a.page_size, (start + seq_len - 1) // a.page_size) if seq_len else (1, 0)
    for page in range(last_page + 1):
        if page > load_last and not store_first <= page <= store_last:
            continue
        first_slot = pages[page]
        if first_slot < 0 or first_slot > max_t - a.page_size:
            fail(f"cachestarts[{b}, {page}] = {first_slot}: page {page} of sequence {b} is used, so it needs "
                 f"0 <= cachestarts[{b}, {page}] and cachestarts[{b}, {page}] + page_size ({a.page_size}) "
                 f"<= MaxT = {max_t}")
    table = np.asarray(pages, dtype=np.int64)
    return [table[p // a.page_size] + p % a.page_size for p in positions()]


def check_aliasing(plan_store, plan_load, start_pos) -> None:
    """No slot is stored twice; a stored slot is loaded only by its own sequence at its own position."""
    owner = {}
    for b, slots in enumerate(plan_store):
        for i, slot in enumerate(slots.tolist()):
            if slot in owner:
                ob, op = owner[slot]
                fail(f"cachestarts: slot {slot} is stored twice in one call, by sequence {ob} position {op} "
                     f"and by sequence {b} position {start_pos[b] + i}")
            owner[slot] = (b, start_pos[b] + i)
    if not owner:
        return
    stored = np.fromiter(owner.keys(), np.int64, len(owner))
    for b, slots in enumerate(plan_load):
        for t in np.flatnonzero(np.isin(slots, stored)).tolist():
            ob, op = owner[int(slots[t])]
            if (ob, op) != (b, t):
                fail(f"cachestarts: slot {int(slots[t])} is stored by sequence {ob} position {op} and loaded in the "
                     f"same call by sequence {b} position {t}; a stored slot may only be loaded by its own "
                     f"sequence at its own position")


#: Largest size (elements or bytes) of a tensor: sizes are int64 in ONNX Runtime and in the kernels.
MAX_SIZE = 2**63 - 1


def check_output_heads(current_key, num_repeat: int) -> None:
    """``H * num_repeat`` must fit int64 (checked with the attributes: a static H fails at session
    creation in ONNX Runtime)."""
    shape = np.shape(current_key)
    if len(shape) == 3 and shape[1] * num_repeat > MAX_SIZE:
        fail(f"KeyValueCache output key would have H*num_repeat={shape[1]}*{num_repeat} heads: "
             f"H*num_repeat does not fit in int64")


def check_output_size(kv_tokens: int, heads: int, head_dim: int, num_repeat: int, dtype) -> None:
    """The outputs ``(kv_tokens, H * num_repeat, Dh)`` must be addressable: one row, and all rows, in
    fewer than 2**63 bytes (checked last, when ``kv_tokens`` is known to be valid)."""
    row_bytes = heads * num_repeat * head_dim * np.dtype(dtype).itemsize
    why = ("a single row would be 2^63 bytes or more" if row_bytes > MAX_SIZE else
           "2^63 bytes or more" if kv_tokens * row_bytes > MAX_SIZE else None)
    if why:
        fail(f"KeyValueCache output key would be (kv_tokens={kv_tokens}, H*num_repeat={heads}*{num_repeat}, "
             f"Dh={head_dim}) elements of {dtype_name(dtype)}: {why}")


def validate_call(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                  max_kvlen, cache, scale, a: Attributes) -> CallPlan:
    """All checks of the spec, in its order; returns the plan of a valid call."""
    check_attributes(a)
    check_output_heads(current_key, a.num_repeat)
    heads, head_dim, max_t = check_tensors(current_key, current_value, cache, scale, a)
    seq = index_vector("seqstarts", seqstarts)
    if not seq:
        fail("seqstarts must have B + 1 >= 1 elements, got 0")
    batch = len(seq) - 1
    kv = index_vector("kvstarts", kvstarts, batch + 1)
    pos = index_vector("start_pos", start_pos, batch)
    cachestarts = np.asarray(cachestarts)
    if cachestarts.dtype != np.int64:
        fail(f"cachestarts must be int64, got {dtype_name(cachestarts.dtype)}")
    want_rank = 1 if a.cache_mode == 0 else 2
    if cachestarts.ndim != want_rank or cachestarts.shape[0] != batch:
        want = "(B,)" if a.cache_mode == 0 else "(B, MaxP)"
        fail(f"cachestarts must have shape {want} with B = {batch} for cache_mode={a.cache_mode}, "
             f"got {cachestarts.shape}")
    max_seqlen = index_scalar("max_seqlen", max_seqlen)
    max_kvlen = index_scalar("max_kvlen", max_kvlen)
    seq_len = starts_lengths("seqstarts", seq, "current_key.shape[0]", current_key.shape[0])
    kv_len = starts_lengths("kvstarts", kv, "", None)
    check_max("max_seqlen", "seqlen", max_seqlen, seq_len)
    check_max("max_kvlen", "kvlen", max_kvlen, kv_len)
    table = cachestarts.tolist()
    store_slots, load_slots = [], []
    for b in range(batch):
        if pos[b] < 0:
            fail(f"start_pos[{b}] = {pos[b]} must be >= 0")
        end = pos[b] + seq_len[b]
        if kv_len[b] > end:
            fail(f"kvstarts: kvlen of sequence {b} = {kv_len[b]} exceeds start_pos[{b}] + seqlen = "
                 f"{pos[b]} + {seq_len[b]} = {end}; only positions stored by this or earlier calls can be loaded")
        touched_end = end if seq_len[b] else kv_len[b]

        def positions(b=b, end=end):  # built only after the bounds of touched_end are known
            return [np.arange(pos[b], end, dtype=np.int64), np.arange(kv_len[b], dtype=np.int64)]

        if a.cache_mode == 0:
            s, l = _offset_slots(b, table[b], max_t, touched_end, positions)
        else:
            s, l = _paged_slots(b, table[b], a, max_t, seq_len[b], kv_len[b], pos[b], touched_end, positions)
        store_slots.append(s)
        load_slots.append(l)
    check_aliasing(store_slots, load_slots, pos)
    check_output_size(kv[-1], heads, head_dim, a.num_repeat, current_key.dtype)
    return CallPlan(seq[:-1], seq_len, kv[:-1], kv_len, store_slots, load_slots)
