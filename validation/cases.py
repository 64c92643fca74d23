"""Named, seeded conformance cases. Each case is a function of nothing that returns a :class:`Case`.

A case's cache (and scale) is pre-filled with seeded random "history", so loads of positions stored
by earlier calls are exercised too; expected outputs are what the reference computes.
"""

import dataclasses
import zlib

import numpy as np

from ..reference.dtypes import BFLOAT16, CACHE_TYPE_FOR_QUANT_BIT, QMAX
from ..reference.layout import cache_shape

_T1 = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BFLOAT16}


@dataclasses.dataclass
class Case:
    """Inputs (node input name -> array, ``scale`` may be None) and the node's attributes; ``expect_error``
    marks an invalid call (its expected outcome is an error with the in-place inputs unchanged)."""

    name: str
    inputs: dict
    attributes: dict
    expect_error: bool = False

    @property
    def op(self) -> str:
        """The op the case calls, told by its inputs."""
        return op_of(self.inputs)


def op_of(inputs) -> str:
    """``KeyValueCache``, ``MultiHeadAttention``, ``MultiHeadCacheAttention`` or ``KeyCacheRotaryShift``, from a
    call's input names."""
    if "query" in inputs:
        return "MultiHeadCacheAttention" if "cache" in inputs else "MultiHeadAttention"
    return "KeyCacheRotaryShift" if "slots" in inputs else "KeyValueCache"


@dataclasses.dataclass(frozen=True)
class Seq:
    """One sequence of the batch: store ``seqlen`` tokens at ``start_pos``, load ``kvlen`` (default all)."""

    start_pos: int
    seqlen: int
    kvlen: int = -1
    share_pages_of: int = -1  # paged mode: reuse the first ``shared_pages`` pages of that sequence
    shared_pages: int = 0

    def loaded(self) -> int:
        return self.start_pos + self.seqlen if self.kvlen < 0 else self.kvlen


def _fill(rng, shape, dtype, quant_bit):
    if quant_bit:
        q = QMAX[quant_bit]
        return rng.integers(-q, q + 1, size=shape).astype(dtype)
    return (rng.standard_normal(shape) * 2).astype(dtype)


def build(name, seqs, *, heads=2, head_dim=8, num_layer=1, layer_idx=0, quant_bit=0, quant_group=8,
          num_repeat=1, cache_mode=0, cache_layout=0, page_size=128, t1="float16", t3="float32", max_t=None,
          max_pages=None, scalar_max=True, extra_max=0, seed=None, tail_slots=3, spare_pages=1,
          empty_offsets_minus_one=False, aligned_pages=True):
    """Builds a case: sequences laid out disjointly in the cache (or sharing pages when asked).

    Random data comes from ``seed`` (default: derived from ``name``), so a case is reproducible. Unless ``max_t`` /
    ``max_pages`` are given: offset mode leaves ``tail_slots`` slots after the last sequence's end (0: it ends at
    MaxT), paged mode ``spare_pages`` unused columns in the page table (0: the longest sequence fills it).
    ``empty_offsets_minus_one``: offset mode gives sequences that store and load nothing the offset -1 (never read).
    ``aligned_pages=False``: paged mode starts pages one slot past multiples of ``page_size + 1`` (the spec lets a
    page start at any slot; a kernel that rounds a start to a page boundary reads and writes the wrong slots).
    """
    rng = np.random.default_rng(zlib.crc32(name.encode()) if seed is None else seed)
    t1 = _T1[t1]
    spans = [max(s.start_pos + s.seqlen, s.loaded()) for s in seqs]
    if cache_mode == 0:
        starts, cursor = [], 0
        for span in spans:
            starts.append(cursor)
            cursor += span + 1  # a one-slot gap keeps sequences apart
        max_t = max_t or max(cursor - 1 + tail_slots, 1)
        if empty_offsets_minus_one:
            starts = [-1 if span == 0 else start for start, span in zip(starts, spans)]
        cachestarts = np.asarray(starts, np.int64).reshape(len(seqs))
    else:
        needed = [-(-span // page_size) for span in spans]
        max_pages = max_pages or max(max(needed, default=0) + spare_pages, 1)
        total_pages = max(sum(needed), 1) + 2
        stride, first = (page_size, 0) if aligned_pages else (page_size + 1, 1)
        max_t = max_t or first + total_pages * stride
        free = list(rng.permutation((max_t - first) // stride))
        table = np.full((len(seqs), max_pages), -1, np.int64)  # unused entries stay -1
        for b, (s, n) in enumerate(zip(seqs, needed)):
            for p in range(n):
                if s.share_pages_of >= 0 and p < s.shared_pages:
                    table[b, p] = table[s.share_pages_of, p]
                else:
                    table[b, p] = first + int(free.pop()) * stride
        cachestarts = table
    cache_dtype = CACHE_TYPE_FOR_QUANT_BIT[quant_bit] or t1
    cache = _fill(rng, cache_shape(cache_layout, num_layer, max_t, heads, head_dim), cache_dtype, quant_bit)
    scale = None
    if quant_bit:
        shape = cache_shape(cache_layout, num_layer, max_t, heads, head_dim // quant_group)
        scale = rng.uniform(0.001, 0.05, size=shape).astype(_T1[t3])
    tokens = sum(s.seqlen for s in seqs)
    seqlens = [s.seqlen for s in seqs]
    kvlens = [s.loaded() for s in seqs]

    def scalar(v):
        return np.array(v, np.int64) if scalar_max else np.array([v], np.int64)

    inputs = {
        "current_key": (rng.standard_normal((tokens, heads, head_dim)) * 3).astype(t1),
        "current_value": (rng.standard_normal((tokens, heads, head_dim)) * 3).astype(t1),
        "seqstarts": np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int64),
        "kvstarts": np.concatenate([[0], np.cumsum(kvlens)]).astype(np.int64),
        "cachestarts": cachestarts,
        "start_pos": np.asarray([s.start_pos for s in seqs], np.int64).reshape(len(seqs)),
        "max_seqlen": scalar(max(seqlens, default=0) + extra_max),
        "max_kvlen": scalar(max(kvlens, default=0) + extra_max),
        "cache": cache,
        "scale": scale,
    }
    attributes = dict(num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit, quant_group=quant_group,
                      num_repeat=num_repeat, cache_mode=cache_mode, cache_layout=cache_layout, page_size=page_size)
    return Case(name, inputs, attributes)


MIXED = [Seq(0, 5), Seq(7, 1), Seq(3, 4)]  # a prefill, a decode, a chunk of a chunked prefill
DECODE = [Seq(p, 1) for p in (0, 4, 9, 2, 15, 6)]


def deferred(make, *args, then=None, **kw):
    """A registry entry: a function of nothing building ``make(*args, **kw)``, then passing it through ``then``
    (a case's finishing touch: special values, a moved page) when given."""
    return lambda: make(*args, **kw) if then is None else then(make(*args, **kw))


def _last_page_first(case):
    """Sequence 0's first page moved to the last page of the cache (the slots an off-by-one bound refuses)."""
    table, page = case.inputs["cachestarts"], case.attributes["page_size"]
    last = case.inputs["cache"].shape[0] - page if case.attributes["cache_layout"] == 0 else None
    if last is None:
        raise ValueError("_last_page_first is for layout 0")
    taken = np.argwhere(table == last)
    if len(taken):
        table[tuple(taken[0])] = table[0, 0]
    table[0, 0] = last
    return case


def _empty_offset_minus_one(case):
    """Sequence 1 (empty: nothing stored, nothing loaded) has offset -1: the spec never reads it."""
    case.inputs["cachestarts"][1] = -1
    return case


def with_empty_scale(case, dtype=BFLOAT16):
    """quant_bit 0 with the empty ``scale`` ppl.pmx's export passes (bfloat16 by default, as its placeholder may
    be): the spec reads it as absent."""
    case.inputs["scale"] = np.zeros((0,), dtype)
    return case


def _special_values(case):
    """current_key with an all-zero group (its scale is eps), a group below eps, a NaN, an infinity, and groups
    whose quotients are exact ties (amax / qmax = 2: 0.5, 1.5, -2.5 round to even)."""
    k = case.inputs["current_key"]
    k[0, 0, 0:4] = 0
    k[0, 0, 4:8] = [1e-4, -2e-4, 3e-5, 0]
    k[1, 0, 0] = np.nan
    k[1, 1, 4] = np.inf
    k[2, 1, 0:4] = [254, 1, 3, -5]
    k[3, 0, 4:8] = [254, 5, -7, 9]
    return case


#: Bit patterns of values an unquantized store and load must move untouched, per T1 (float16, bfloat16, float32):
#: the smallest subnormal, the negative subnormal of largest magnitude, -0, a quiet NaN with a payload, a negative
#: quiet NaN, a signaling NaN, +inf and -inf (a backend that flushes subnormals, loses -0's sign or canonicalizes
#: NaNs changes them).
_MOVED_BITS = {
    "float16": [0x0001, 0x83FF, 0x8000, 0x7E2A, 0xFE01, 0x7C01, 0x7C00, 0xFC00],
    "bfloat16": [0x0001, 0x807F, 0x8000, 0x7FC5, 0xFFC1, 0x7F81, 0x7F80, 0xFF80],
    "float32": [0x00000001, 0x807FFFFF, 0x80000000, 0x7FC12345, 0xFFC00001, 0x7F800001, 0x7F800000, 0xFF800000],
}


def _moved_special_values(case):
    """Special bit patterns (:data:`_MOVED_BITS`) in the stored key and value and in every seventh element of the
    cache's history: unquantized data movement keeps each one's bits, loads of earlier positions included."""
    dtype = case.inputs["current_key"].dtype
    bits = np.array(_MOVED_BITS[dtype.name], f"u{dtype.itemsize}")
    case.inputs["current_key"].view(bits.dtype)[0, 0, 0:8] = bits
    case.inputs["current_value"].view(bits.dtype)[1, -1, 0:8] = bits[::-1]
    history = np.ascontiguousarray(case.inputs["cache"]).view(bits.dtype)
    history.reshape(-1)[::7] = np.resize(bits, history.reshape(-1)[::7].shape)
    case.inputs["cache"] = history.view(dtype)
    return case


def _int4_ties(case):
    """Groups whose int4 quotients are exact ties (amax / 7 = 2)."""
    k = case.inputs["current_key"]
    k[0, 0, 0:4] = [14, 1, 3, -5]
    k[1, 1, 4:8] = [-14, 5, 7, 9]
    return case


def _registry():
    cases = {}

    def case(name, seqs, then=None, **kw):
        cases[name] = deferred(build, name, seqs, then=then, **kw)

    for layout in range(4):
        case(f"offset_layout{layout}", MIXED, cache_layout=layout)
        case(f"paged_layout{layout}", MIXED, cache_layout=layout, cache_mode=1, page_size=4)
        case(f"int8_layout{layout}", MIXED, cache_layout=layout, cache_mode=layout % 2, page_size=4, quant_bit=8)
        case(f"int4_layout{layout}", MIXED, cache_layout=layout, cache_mode=1 - layout % 2, page_size=4, quant_bit=4)
    case("t1_float32", MIXED, t1="float32")
    case("t1_bfloat16", MIXED, t1="bfloat16", cache_mode=1, page_size=4)
    case("t1_float32_int8", MIXED, t1="float32", quant_bit=8)
    case("t1_bfloat16_int8_scale_float16", MIXED, t1="bfloat16", quant_bit=8, t3="float16", cache_mode=1, page_size=4)
    case("int8_scale_float16", MIXED, quant_bit=8, t3="float16")
    case("int4_scale_float16", MIXED, quant_bit=4, t3="float16", cache_mode=1, page_size=4)
    case("t1_float32_int4", MIXED, t1="float32", quant_bit=4, cache_layout=3)
    case("gqa_repeat2", MIXED, num_repeat=2)
    case("gqa_repeat4_int8_paged", MIXED, num_repeat=4, quant_bit=8, cache_mode=1, page_size=2)
    case("gqa_repeat3_heads1", MIXED, num_repeat=3, heads=1)
    case("layers3_layer_idx2", MIXED, num_layer=3, layer_idx=2, cache_layout=1)
    case("layers3_layer_idx1_paged_layout3", MIXED, num_layer=3, layer_idx=1, cache_layout=3, cache_mode=1, page_size=4)
    case("layers2_layer_idx1_layout0", MIXED, num_layer=2, layer_idx=1, cache_layout=0)
    case("layers4_layer_idx3_paged_int8_layout2", MIXED, num_layer=4, layer_idx=3, cache_layout=2, cache_mode=1,
         page_size=4, quant_bit=8)
    case("paged_unaligned_pages", MIXED, cache_mode=1, page_size=4, aligned_pages=False)
    case("paged_unaligned_pages_int4_layout3", MIXED, cache_mode=1, page_size=4, aligned_pages=False, quant_bit=4,
         cache_layout=3)
    case("empty_scale_placeholder", MIXED, then=with_empty_scale, cache_mode=1, page_size=4)
    case("quant_group1", MIXED, quant_bit=8, quant_group=1)
    case("quant_group2_int4", MIXED, quant_bit=4, quant_group=2)
    case("quant_group16_dh32", MIXED, quant_bit=8, quant_group=16, head_dim=32)
    case("quant_group_whole_head", MIXED, quant_bit=8, quant_group=8)
    case("page_size1", MIXED, cache_mode=1, page_size=1)
    case("page_size_default128", [Seq(0, 3), Seq(126, 4)], cache_mode=1)
    case("page_size16_int8_layout3", [Seq(10, 9), Seq(30, 1)], cache_mode=1, page_size=16, quant_bit=8, cache_layout=3)
    case("batch0", [])
    case("batch0_paged_int8", [], cache_mode=1, page_size=4, quant_bit=8)
    case("empty_sequence_between", [Seq(0, 3), Seq(0, 0, kvlen=0), Seq(2, 2)], quant_bit=8)
    case("load_only_sequence", [Seq(5, 0), Seq(0, 2)], cache_mode=1, page_size=4)
    case("store_only_kvlen0", [Seq(0, 3, kvlen=0), Seq(4, 1)])
    case("all_sequences_empty", [Seq(0, 0), Seq(3, 0, kvlen=0)], quant_bit=4)
    case("partial_load_kvlen_lt_end", [Seq(0, 6, kvlen=4), Seq(2, 1, kvlen=1)], cache_mode=1, page_size=4)
    case("prefix_shared_pages", [Seq(8, 2), Seq(8, 1, share_pages_of=0, shared_pages=2)], cache_mode=1, page_size=4)
    case("prefix_shared_pages_int8", [Seq(8, 3), Seq(9, 1, share_pages_of=0, shared_pages=2), Seq(8, 1, share_pages_of=0, shared_pages=2)],
         cache_mode=1, page_size=4, quant_bit=8)
    case("chunked_prefill_offset", [Seq(16, 8), Seq(0, 8)])
    case("chunked_prefill_paged_int4", [Seq(12, 8), Seq(20, 4)], cache_mode=1, page_size=4, quant_bit=4, cache_layout=2)
    case("decode_batch_paged", DECODE, cache_mode=1, page_size=4, cache_layout=3)
    case("decode_batch_int8_gqa", DECODE, quant_bit=8, num_repeat=2, cache_layout=2)
    case("max_len_shape1", MIXED, scalar_max=False)
    case("max_len_larger_than_needed", MIXED, extra_max=5, cache_mode=1, page_size=4)
    case("wide_heads_dh64", [Seq(0, 4), Seq(3, 2)], heads=4, head_dim=64, quant_bit=8, quant_group=32)
    # Bounds at their limits, each refused by an off-by-one check: the last sequence ending at MaxT (MIXED spans 5, 8
    # and 7 slots at 0, 6 and 15), a page table with no spare column, a page at the cache's end, an empty sequence's
    # offset -1.
    case("offset_sequence_ends_at_max_t", MIXED, max_t=22)
    case("paged_table_exactly_full", MIXED, cache_mode=1, page_size=4, max_pages=2)
    case("paged_last_page_of_cache", MIXED, then=_last_page_first, cache_mode=1, page_size=4)
    case("offset_empty_sequence_minus_one", [Seq(0, 3), Seq(0, 0, kvlen=0), Seq(2, 2)], then=_empty_offset_minus_one,
         quant_bit=8)
    # Special values and ties in the quantization.
    case("quant_special_values", [Seq(0, 4), Seq(3, 2)], then=_special_values, quant_bit=8, quant_group=4)
    case("quant_special_values_scale_float16", [Seq(0, 4), Seq(3, 2)], then=_special_values, quant_bit=8,
         quant_group=4, t3="float16")
    for t1, settings in (("float16", {}), ("bfloat16", dict(cache_mode=1, page_size=4, cache_layout=1)),
                         ("float32", dict(cache_mode=1, page_size=4, cache_layout=3))):
        case(f"moved_special_values_{t1}", MIXED, then=_moved_special_values, t1=t1, **settings)
    case("quant_ties_int4", [Seq(0, 2)], then=_int4_ties, quant_bit=4, quant_group=4, cache_mode=1, page_size=4)
    return cases


CASES = _registry()
