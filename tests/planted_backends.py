"""Backends a user might write, with the bugs the conformance kit must catch planted one at a time.

``_Backend`` is KeyValueCache written from spec/KeyValueCache.md (numpy, one sequence at a time, sharing
nothing with the reference but its validation, which only the ``no_bounds_checks`` variant skips). Each
module-level function below is one variant with the reference's signature, loadable as
``--backend planted_backends:<name>``:

* ``correct``: no bug;
* ``no_bounds_checks``: checks attributes, dtypes and shapes but trusts the index values (launch bounds,
  slot bounds, aliasing): numpy wraps negative slots around and stops at too large ones midway;
* ``gqa_tiled``: repeats the kv heads as ``k0 k1 k0 k1`` (tile) instead of ``k0 k0 k1 k1``;
* ``kvlen_ignored``: loads ``start_pos + seqlen`` tokens per sequence whatever ``kvstarts`` says;
* ``int4_nibbles_swapped``: packs int4 codes with the two nibbles of each byte exchanged (and unpacks them
  the same way, so its own stores read back right);
* ``scale_not_rounded``: quantizes with the float32 scale instead of the scale rounded to its dtype;
* ``ppl_style``: ppl's arithmetic: the scale computed in T1 (and used unrounded), the quotient rounded to
  float16 before ``rint``, dequantization in the scale's dtype then T1 (what the spec's tolerance table allows);
* ``ties_away``: quotients rounded half away from zero (C's ``round``), not to even: codes one off at exact ties;
* ``dequantize_in_t3``: the spec's codes and scales, dequantized in the scale's dtype then T1 (ppl's torch reference);
* ``raises_on_layers3``: raises on calls with three layers, correct otherwise;
* ``crashes_on_page_size1``: kills its process on calls with page_size 1, correct otherwise;
* ``clobbers_last_slot``: also zeroes the cache's last slot (which the vectors never store nor load);
* ``hangs_on_layers3``: sleeps ten minutes on calls with three layers, correct otherwise (``hangs_on_page_size1``:
  on paged calls with pages of one slot); ``forks_then_crashes_on_layers3``: forks a sleeping child, then aborts
  (``forks_on_layers3``: and returns);
* ``exits_on_layers3``: calls ``sys.exit(0)`` on calls with three layers, correct otherwise (``os_exits_on_layers3``:
  ``os._exit(0)``; ``posix_exits_on_layers3``: ``posix._exit(0)``; ``base_exception_on_layers3``: raises a
  ``BaseException`` that is not an ``Exception``; ``libc_exits_on_layers3``: the C library's ``_exit(0)``);
* ``wrong_on_third_call``: correct, except the third call of its process flips one bit of ``key`` (a bug that
  does not come back when the call is replayed);
* ``reshapes_cache``: correct, then reshapes its ``cache`` argument in place (to one flat axis);
* ``zeroes_current_key``: correct, then zeroes its ``current_key`` argument (a read-only input);
* ``shifts_start_pos``: correct, then adds one to its ``start_pos`` argument (a read-only index input);
* ``stores_into_a_copy``: correct outputs, but stores into a copy of the cache (the caller's stays as it was);
* ``layer_idx_ignored``: every call as if ``layer_idx`` were 0, never checked against ``num_layer``;
* ``layer_ignored_in_layouts_0_and_2``: the same in layouts 0 and 2 only;
* ``pages_assumed_aligned``: rounds each page's start down to a multiple of ``page_size``;
* ``page_bounds_of_touched_slots_only``: accepts a page running past the cache when the slots it touches are in it;
* ``aliasing_unchecked``: checks every bound but accepts a slot stored twice, or stored by one sequence and loaded by
  another, in one call;
* ``zeroes_unquantized_specials``: stores an unquantized call's NaNs, infinities, -0.0 and subnormals as +0.0;
  ``canonical_nans``: stores its NaNs as the dtype's default NaN; ``reuses_its_output_buffers``: returns its
  outputs in buffers it reuses on the next call of the same shape;
* ``key_viewing_the_cache``: returns ``key`` as a view of the cache rows it loaded, where it can (outputs may share
  no memory with the inputs); ``writes_into_an_earlier_cache``: correct, then flips a bit of the previous call's cache;
* ``cache_attention_kv_heads_required``, ``empty_scale_refused``: refuse valid calls (``num_kv_heads`` 0; an empty
  ``scale`` with ``quant_bit`` 0).

``ALL_OPS`` (and ``rotary_sin_negated``, ``rotary_flushing_subnormals``, ``attention_window_ignored``, ``attention_query_nan``: correct, then
sets its ``query`` argument to NaN, ``cache_attention_loads_first``: MultiHeadCacheAttention attending over the keys
the cache held before this step's stores) are ``module:object`` backends
providing the other ops too (the reference's, or one with a planted bug).
"""

import ctypes
import os
import posix
import sys
import time
import types

import ml_dtypes
import numpy as np

from kvcache_op.reference import (canonical_view, key_cache_rotary_shift, multi_head_attention,
                                  multi_head_cache_attention)
from kvcache_op.reference.dtypes import SCALE_EPS
from kvcache_op.reference.validate import Attributes, KeyValueCacheError, effective_scale, validate_call
from kvcache_op.spec.schema import ATTRIBUTE_DEFAULTS as CACHE_ATTRIBUTES

QMAX = {8: 127, 4: 7}
#: The reference's messages for the checks of the index values (launch bounds, slot bounds, aliasing): what a
#: backend that trusts its indices skips.
INDEX_CHECKS = ("max_seqlen =", "max_kvlen =", "start_pos[", "kvstarts: kvlen", "cachestarts[", "cachestarts: ")


def _quantize(x, quant_bit, group, scale_dtype, t1, bug, arithmetic):
    """Codes and stored scales of rows ``x[..., Dh]`` (float32 arithmetic unless ``arithmetic == 'ppl'``)."""
    qmax = np.float32(QMAX[quant_bit])
    groups = x.astype(np.float32).reshape(*x.shape[:-1], x.shape[-1] // group, group)
    amax = np.abs(groups).max(axis=-1)
    if arithmetic == "ppl":  # scale in T1, used as it is; quotient rounded to float16
        scale = np.maximum((amax.astype(t1) / np.asarray(qmax).astype(t1)).astype(t1), np.asarray(1e-5).astype(t1))
        quotient = (groups / scale.astype(np.float32)[..., None]).astype(np.float16).astype(np.float32)
        stored = scale.astype(scale_dtype)
    else:
        scale = np.maximum(amax / qmax, np.float32(1e-5))
        stored = scale.astype(scale_dtype)
        used = scale if bug == "scale_not_rounded" else stored.astype(np.float32)
        quotient = groups / used[..., None]
    if arithmetic == "ties_away":  # C's round(): half away from zero, another rounding to nearest
        rounded = np.trunc(quotient.astype(np.float64) + np.copysign(0.5, quotient))
    else:
        rounded = np.rint(quotient)
    codes = np.clip(rounded, -qmax, qmax)
    codes = np.where(np.isnan(codes), 0, codes)
    codes = _CODE_BUGS.get(bug, lambda c, q: c)(codes, qmax)
    return codes.astype(np.int8).reshape(x.shape), stored


#: Code bugs each within the tolerance table's +-1 of the right code, but not what the backend's scales give:
#: every code one higher (clamped), one further from zero, -qmax stored as -qmax - 1, and codes of magnitude 1
#: flushed to 0.
_CODE_BUGS = {
    "codes_plus_one": lambda c, qmax: np.minimum(c + 1, qmax),
    "codes_away_from_zero": lambda c, qmax: np.clip(c + np.sign(c), -qmax, qmax),
    "minus_qmax_stored_one_below": lambda c, qmax: np.where(c == -qmax, -qmax - 1, c),
    "small_codes_flushed": lambda c, qmax: np.where(np.abs(c) <= 1, 0, c),
}


def _dequantize(codes, scale, group, t1, arithmetic):
    groups = codes.astype(np.float32).reshape(*codes.shape[:-1], codes.shape[-1] // group, group)
    if arithmetic in ("ppl", "dequantize_in_t3"):  # code.type_as(scale) * scale, in the scale's dtype
        values = groups.astype(scale.dtype) * scale[..., None]
    else:
        values = groups * scale.astype(np.float32)[..., None]
    return values.reshape(codes.shape).astype(t1)


def _swap_pairs(codes):
    """Exchanges elements 2i and 2i+1 along the last axis: what swapped nibbles do to int4 codes."""
    swapped = codes.copy()
    swapped[..., 0::2], swapped[..., 1::2] = codes[..., 1::2], codes[..., 0::2]
    return swapped


def _backend(bug=None, arithmetic="spec"):
    def key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                        max_kvlen, cache, scale=None, **attributes):
        with np.errstate(all="ignore"):  # unchecked indices wrap around, as they would in C
            return _key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                                    max_seqlen, max_kvlen, cache, scale, **attributes)

    def _key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                         max_kvlen, cache, scale=None, *, num_layer=1, layer_idx=0, quant_bit=0, quant_group=8,
                         num_repeat=1, cache_mode=0, cache_layout=0, page_size=128):
        a = Attributes(num_layer, layer_idx, quant_bit, quant_group, num_repeat, cache_mode, cache_layout, page_size)
        scale = effective_scale(scale, quant_bit)
        try:
            validate_call(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                          max_kvlen, cache, scale, a)
        except KeyValueCacheError as error:
            if bug != "no_bounds_checks" or not str(error).startswith(INDEX_CHECKS):
                raise
        if bug == "raises_on_layers3" and num_layer == 3:
            raise RuntimeError("this backend does not support three layers")
        if bug == "crashes_on_page_size1" and cache_mode == 1 and page_size == 1:
            os.abort()
        if bug == "hangs_on_layers3" and num_layer == 3:
            time.sleep(600)
        if bug == "hangs_on_page_size1" and cache_mode == 1 and page_size == 1:
            time.sleep(600)
        t1 = current_key.dtype
        swapped = bug == "int4_nibbles_swapped" and quant_bit == 4
        codes_view = canonical_view(cache, cache_layout)[layer_idx]  # (2, H, MaxT, Dh)
        scale_view = None if scale is None else canonical_view(scale, cache_layout)[layer_idx]
        batch = len(seqstarts) - 1

        def slots(b, positions):
            if cache_mode == 0:
                return cachestarts[b] + positions
            pages = cachestarts[b][positions // page_size]
            if bug == "pages_assumed_aligned":  # a page's start rounded down to a multiple of page_size
                pages = pages // page_size * page_size
            return pages + positions % page_size

        for b in range(batch):
            rows = slice(seqstarts[b], seqstarts[b + 1])
            where = slots(b, np.arange(start_pos[b], start_pos[b] + seqstarts[b + 1] - seqstarts[b]))
            for kv, current in enumerate((current_key, current_value)):
                x = current[rows].transpose(1, 0, 2)  # (H, seqlen, Dh)
                if quant_bit:
                    codes, stored = _quantize(x, quant_bit, quant_group, scale.dtype, t1, bug, arithmetic)
                    codes_view[kv][:, where, :] = (_swap_pairs(codes) if swapped else codes).astype(cache.dtype)
                    scale_view[kv][:, where, :] = stored
                else:
                    codes_view[kv][:, where, :] = x
        if bug == "clobbers_last_slot" and codes_view.shape[2]:
            codes_view[:, :, -1, :] = 0  # a slot no call stores: only the cache after the call shows it
        lengths = [kvstarts[b + 1] - kvstarts[b] for b in range(batch)]
        if bug == "kvlen_ignored":
            lengths = [start_pos[b] + seqstarts[b + 1] - seqstarts[b] for b in range(batch)]
        outputs = []
        for kv in (0, 1):
            parts = [np.zeros((0, current_key.shape[1] * num_repeat, current_key.shape[2]), t1)]
            for b in range(batch):
                where = slots(b, np.arange(lengths[b]))
                gathered = codes_view[kv][:, where, :]  # (H, kvlen, Dh)
                if quant_bit:
                    codes = gathered.astype(np.int8)
                    codes = _swap_pairs(codes) if swapped else codes
                    gathered = _dequantize(codes, scale_view[kv][:, where, :], quant_group, t1, arithmetic)
                tokens = gathered.transpose(1, 0, 2).astype(t1)
                repeated = np.tile(tokens, (1, num_repeat, 1)) if bug == "gqa_tiled" else np.repeat(tokens, num_repeat, 1)
                parts.append(repeated)
            outputs.append(np.concatenate(parts))
        return outputs[0], outputs[1]

    return key_value_cache


def decode_outputs(case, outcome) -> None:
    """Sets a KeyValueCache outcome's outputs to what its own quantized cache holds at the slots the call loads
    (float32 products, one rounding to T1): a backend's outputs after a test moved its codes or scales."""
    from kvcache_op.validation.slot_map import SlotMap

    slots, t1 = SlotMap(case.inputs, case.attributes), case.inputs["current_key"].dtype
    codes = outcome.after["cache"].astype(np.int8).reshape(-1).astype(np.float32)
    scales = outcome.after["scale"].astype(np.float32).reshape(-1)
    for kv, name in enumerate(("key", "value")):
        outcome.outputs[name] = (codes[slots.source(kv)] * scales[slots.source(kv, scale=True)]).astype(t1)


correct = _backend()
no_bounds_checks = _backend("no_bounds_checks")
gqa_tiled = _backend("gqa_tiled")
kvlen_ignored = _backend("kvlen_ignored")
int4_nibbles_swapped = _backend("int4_nibbles_swapped")
scale_not_rounded = _backend("scale_not_rounded")
ppl_style = _backend(arithmetic="ppl")
ties_away = _backend(arithmetic="ties_away")
dequantize_in_t3 = _backend(arithmetic="dequantize_in_t3")
raises_on_layers3 = _backend("raises_on_layers3")
crashes_on_page_size1 = _backend("crashes_on_page_size1")
clobbers_last_slot = _backend("clobbers_last_slot")
hangs_on_layers3 = _backend("hangs_on_layers3")
hangs_on_page_size1 = _backend("hangs_on_page_size1")


def _fork_a_sleeper() -> None:
    """Forks a child that sleeps ten minutes (it inherits the worker's pipes); its pid goes to
    ``$KVCACHE_TEST_CHILD_PID``."""
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    with open(os.environ["KVCACHE_TEST_CHILD_PID"], "w") as f:
        f.write(str(pid))


def forks_then_crashes_on_layers3(*args, num_layer=1, **attributes):
    """``correct``, except that a call with three layers forks a sleeping child, then aborts."""
    if num_layer == 3:
        _fork_a_sleeper()
        os.abort()
    return correct(*args, num_layer=num_layer, **attributes)


def forks_on_layers3(*args, num_layer=1, **attributes):
    """``correct``, having forked a sleeping child on a call with three layers."""
    if num_layer == 3:
        _fork_a_sleeper()
    return correct(*args, num_layer=num_layer, **attributes)


def _on_layers3(name, way_out):
    """``correct``, except that a call with three layers first calls ``way_out`` (which does not return)."""
    def backend(*args, num_layer=1, **attributes):
        if num_layer == 3:
            way_out()
        return correct(*args, num_layer=num_layer, **attributes)

    backend.__name__ = backend.__qualname__ = name
    return backend


class BackendAbort(BaseException):
    """What a binding or a test helper may raise: a BaseException, not an Exception."""


def _raise_backend_abort():
    raise BackendAbort("unsupported")


# Each way out is looked up when it is taken: a test may have replaced os._exit and posix._exit by then.
exits_on_layers3 = _on_layers3("exits_on_layers3", lambda: sys.exit(0))
os_exits_on_layers3 = _on_layers3("os_exits_on_layers3", lambda: os._exit(0))
posix_exits_on_layers3 = _on_layers3("posix_exits_on_layers3", lambda: posix._exit(0))
# What a compiled library's error path may do: no Python code sees it.
libc_exits_on_layers3 = _on_layers3("libc_exits_on_layers3", lambda: ctypes.CDLL(None)._exit(0))
base_exception_on_layers3 = _on_layers3("base_exception_on_layers3", _raise_backend_abort)


_CALLS = [0]


def wrong_on_third_call(*args, **attributes):
    _CALLS[0] += 1
    key, value = correct(*args, **attributes)
    if _CALLS[0] == 3 and key.size:
        key = key.copy()
        key.reshape(-1).view(np.uint8)[0] ^= 1
    return key, value


def _then(change):
    """``correct``, then ``change(arguments)`` once it has computed its outputs."""

    def key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                        max_kvlen, cache, scale=None, **attributes):
        arguments = dict(current_key=current_key, current_value=current_value, seqstarts=seqstarts,
                         kvstarts=kvstarts, cachestarts=cachestarts, start_pos=start_pos, max_seqlen=max_seqlen,
                         max_kvlen=max_kvlen, cache=cache, scale=scale)
        outputs = correct(**arguments, **attributes)
        change(arguments)
        return outputs

    return key_value_cache


# resize to the same size reshapes the caller's array in place (setting .shape is deprecated from NumPy 2.5)
reshapes_cache = _then(lambda a: a["cache"].resize((a["cache"].size,), refcheck=False))
zeroes_current_key = _then(lambda a: a["current_key"].fill(0))
shifts_start_pos = _then(lambda a: np.add(a["start_pos"], 1, out=a["start_pos"]))



def returns_none_for_an_invalid_call(*args, **attributes):
    """The correct KeyValueCache, but an invalid call returns None (its cache untouched) instead of raising, as a
    C binding that returns a null result might."""
    try:
        return correct(*args, **attributes)
    except Exception:  # noqa: BLE001 - every refusal becomes a None
        return None


def refuses_a_sequence_ending_at_max_t(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                                       max_seqlen, max_kvlen, cache, scale=None, **attributes):
    """The correct KeyValueCache, but offset mode's bound checked as end < MaxT (off by one: the last slot is
    valid)."""
    if attributes.get("cache_mode", 0) == 0:
        max_t = canonical_view(cache, attributes.get("cache_layout", 0)).shape[3]
        ends = cachestarts + np.maximum(start_pos + np.diff(seqstarts), np.diff(kvstarts))
        if np.any((ends == max_t) & (np.diff(kvstarts) > 0)):
            raise KeyValueCacheError("cachestarts: a sequence runs past MaxT")
    return correct(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                   cache, scale, **attributes)


def scale_floor_missing(*args, scale=None, **attributes):
    """The correct KeyValueCache, but a group whose scale is the floor (all its values 0, or tiny) stores scale 0."""
    outputs = correct(*args, scale=scale, **attributes)
    if scale is not None:
        scale[scale == scale.dtype.type(SCALE_EPS)] = 0
    return outputs


def stores_into_a_copy(*args, cache=None, scale=None, **attributes):
    return correct(*args, cache=cache.copy(), scale=None if scale is None else scale.copy(), **attributes)


def layer_idx_ignored(*args, layer_idx=0, num_layer=1, **attributes):
    return correct(*args, layer_idx=0, num_layer=num_layer, **attributes)


pages_assumed_aligned = _backend("pages_assumed_aligned")


def layer_ignored_in_layouts_0_and_2(*args, layer_idx=0, num_layer=1, cache_layout=0, **attributes):
    """Correct in layouts 1 and 3; in 0 and 2 a valid layer_idx is taken as 0 (a layer stride left out)."""
    ignored = cache_layout in (0, 2) and 0 <= layer_idx < num_layer
    return correct(*args, layer_idx=0 if ignored else layer_idx, num_layer=num_layer, cache_layout=cache_layout,
                   **attributes)


def page_bounds_of_touched_slots_only(*args, **attributes):
    """Checks that the slots a call touches lie in the cache, not that its pages do: a page running past the cache's
    end whose touched slots are inside is accepted."""
    try:
        return correct(*args, **attributes)
    except KeyValueCacheError as error:
        if "+ page_size" not in str(error):
            raise
        return no_bounds_checks(*args, **attributes)  # numpy refuses a slot past the end (IndexError)


def aliasing_unchecked(*args, **attributes):
    """Checks every bound but not aliasing: a slot stored twice in one call, or stored by one sequence and loaded by
    another, is accepted (the later store wins)."""
    try:
        return correct(*args, **attributes)
    except KeyValueCacheError as error:
        if not str(error).startswith("cachestarts: slot "):
            raise
        return no_bounds_checks(*args, **attributes)


def key_viewing_the_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                          max_kvlen, cache, scale=None, **attributes):
    """Correct values, but with one sequence, offset mode, no quantization and no repeat, returns ``key`` as a view
    of the cache's key rows it loaded (the values the op gathers): the caller's next store changes it."""
    key, value = correct(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                         max_kvlen, cache, scale, **attributes)
    if len(start_pos) == 1 and not attributes.get("cache_mode") and not attributes.get("quant_bit") and \
            attributes.get("num_repeat", 1) == 1 and len(key):
        rows = canonical_view(cache, attributes.get("cache_layout", 0))[attributes.get("layer_idx", 0)][0]
        view = rows[:, cachestarts[0]:cachestarts[0] + len(key)].transpose(1, 0, 2)  # (kvlen, H, Dh) of the cache
        if view.tobytes() == key.tobytes():
            return view, value
    return key, value


def _unquantized_inputs_changed(change):
    """A backend storing ``change(x)`` for an unquantized call's current_key and current_value (correct otherwise)."""
    def backend(current_key, current_value, *args, quant_bit=0, **attributes):
        if not quant_bit:
            current_key, current_value = change(current_key), change(current_value)
        return correct(current_key, current_value, *args, quant_bit=quant_bit, **attributes)

    return backend


def _zeroed_specials(x):
    wide = x.astype(np.float32)
    normal = np.isfinite(wide) & (np.abs(wide) >= np.finfo(x.dtype).tiny)
    return np.where(normal, x, np.zeros((), x.dtype)).astype(x.dtype)


#: Stores an unquantized call's NaNs, infinities, -0.0 and subnormals as +0.0 (an exact data movement changed).
zeroes_unquantized_specials = _unquantized_inputs_changed(_zeroed_specials)
#: Stores an unquantized call's NaNs as the dtype's default NaN (sign and payload lost).
canonical_nans = _unquantized_inputs_changed(
    lambda x: np.where(np.isnan(x.astype(np.float32)), np.array(np.nan, x.dtype), x))


def loads_flush_subnormals(*args, **attributes):
    """Correct, then the subnormals of an unquantized call's key and value outputs flushed to zero (a kernel built
    to flush them, as GPU compilers may be told to: its loads of the cache lose them)."""
    key, value = correct(*args, **attributes)
    if not attributes.get("quant_bit"):
        for out in (key, value):
            wide = out.astype(np.float32)
            out[(wide != 0) & (np.abs(wide) < float(ml_dtypes.finfo(out.dtype).tiny))] = 0
    return key, value


_KEPT = {}  # what the planted backends below keep between calls


def reuses_its_output_buffers(*args, **attributes):
    """Correct values, returned in two buffers it keeps and reuses when the next call's outputs have the same shape:
    the caller's earlier outputs change under it."""
    key, value = correct(*args, **attributes)
    kept = _KEPT.get("outputs")
    if kept is not None and kept[0].shape == key.shape and kept[0].dtype == key.dtype:
        kept[0][...], kept[1][...] = key, value
        return kept
    _KEPT["outputs"] = (key, value)
    return key, value


def writes_into_an_earlier_cache(*args, cache=None, **attributes):
    """Correct, then flips a bit of the cache the previous call was given (a pointer kept and replayed)."""
    outputs = correct(*args, cache=cache, **attributes)
    earlier = _KEPT.get("cache")
    if earlier is not None and earlier.size:
        earlier.reshape(-1).view(np.uint8)[0] ^= 1
    _KEPT["cache"] = cache
    return outputs


#: The KV variants above that are bugs the kit must catch.
BUGS = ["no_bounds_checks", "gqa_tiled", "kvlen_ignored", "int4_nibbles_swapped", "scale_not_rounded",
        "pages_assumed_aligned", "layer_ignored_in_layouts_0_and_2", "page_bounds_of_touched_slots_only",
        "aliasing_unchecked"]


def _rotary_sin_negated(cache, scale, slots, cos, sin, **attributes):
    return key_cache_rotary_shift(cache, scale, slots, cos, -np.asarray(sin), **attributes)


def _attention_query_nan(query, *args, **attributes):
    output = multi_head_attention(query, *args, **attributes)
    query.fill(np.nan)
    return output


def _attention_window_ignored(*args, sliding_window=0, **attributes):
    return multi_head_attention(*args, **attributes)


def _attention_not_finite_zeroed(*args, **attributes):
    """The attention, with every NaN made 0 and every infinity the dtype's largest value (np.nan_to_num): rows an
    infinity or a NaN reaches come out finite."""
    with np.errstate(all="ignore"):
        return np.nan_to_num(multi_head_attention(*args, **attributes))


def _attention_in_float32(query, key, value, *args, attn_mask=None, **attributes):
    """The attention of float32 copies of the query, keys, values and mask: float32 rows, not yet rounded to T."""
    mask = None if attn_mask is None else attn_mask.astype(np.float32)
    with np.errstate(all="ignore"):
        return multi_head_attention(query.astype(np.float32), key.astype(np.float32), value.astype(np.float32),
                                    *args, attn_mask=mask, **attributes), query.dtype


def _attention_weights_rounded_up(saturating):
    """Float16 attention with weights summing to 1 + 2^-11 (as float16-rounded weights may), rounded to float16 by a
    plain cast (an infinity past its largest value) or, ``saturating``, as the spec says (to its largest value); the
    reference for other dtypes."""
    def attention(*args, **attributes):
        spec_output = multi_head_attention(*args, **attributes)  # raises for an invalid call
        if spec_output.dtype != np.float16:
            return spec_output
        rows, dtype = _attention_in_float32(*args, **attributes)
        rows = rows * np.float32(1 + 2**-11)
        if saturating:
            largest = float(ml_dtypes.finfo(dtype).max)
            rows = np.where(np.isfinite(rows), np.clip(rows, -largest, largest), rows)
        with np.errstate(over="ignore"):
            return rows.astype(dtype)

    return attention


def _attention_non_finite_rows_all_nan(*args, **attributes):
    """The attention, with every row holding a non-finite element made NaN whole (which elements are non-finite,
    and whether NaN or an infinity, the spec leaves open)."""
    with np.errstate(all="ignore"):
        output = multi_head_attention(*args, **attributes)
    reached = ~np.isfinite(output.astype(np.float32)).all(axis=-1, keepdims=True)
    return np.where(reached, np.array(np.nan, output.dtype), output)


def _attention_nan_as_infinity(*args, **attributes):
    """The attention, with +inf where it has NaN (which the spec leaves open)."""
    with np.errstate(all="ignore"):
        output = multi_head_attention(*args, **attributes)
    return np.where(np.isnan(output.astype(np.float32)), np.array(np.inf, output.dtype), output)


def _attention_non_finite_moved(*args, **attributes):
    """The attention, with a row's non-finite elements made finite and its finite ones NaN: every row an infinity or
    a NaN reaches is still non-finite somewhere, but not where the values or scores put it."""
    with np.errstate(all="ignore"):
        output = multi_head_attention(*args, **attributes)
    wide = output.astype(np.float32)
    reached = ~np.isfinite(wide).all(axis=-1, keepdims=True)
    moved = np.where(np.isfinite(wide), np.float32(np.nan), np.float32(12345.0))
    return np.where(reached, moved, wide).astype(output.dtype)


attention_not_finite_zeroed = types.SimpleNamespace(multi_head_attention=_attention_not_finite_zeroed)
attention_not_saturating = types.SimpleNamespace(multi_head_attention=_attention_weights_rounded_up(False))
attention_saturating = types.SimpleNamespace(multi_head_attention=_attention_weights_rounded_up(True))
attention_non_finite_rows_all_nan = types.SimpleNamespace(multi_head_attention=_attention_non_finite_rows_all_nan)
attention_nan_as_infinity = types.SimpleNamespace(multi_head_attention=_attention_nan_as_infinity)
attention_non_finite_moved = types.SimpleNamespace(multi_head_attention=_attention_non_finite_moved)


ALL_OPS = types.SimpleNamespace(key_value_cache=correct, key_cache_rotary_shift=key_cache_rotary_shift,
                                multi_head_attention=multi_head_attention,
                                multi_head_cache_attention=multi_head_cache_attention)
def _rotary_slots_sorted(cache, scale, slots, cos, sin, **attributes):
    """Rotates the slots in sorted order with the rows of cos and sin as given (rows meant for other slots)."""
    return key_cache_rotary_shift(cache, scale, np.sort(slots), cos, sin, **attributes)


rotary_sin_negated = types.SimpleNamespace(key_cache_rotary_shift=_rotary_sin_negated)
rotary_slots_sorted = types.SimpleNamespace(key_cache_rotary_shift=_rotary_slots_sorted)


def _rotary_flushing_subnormals(cache, scale, slots, cos, sin, **attributes):
    """The rotation, then every subnormal value of an unquantized cache flushed to zero (as a kernel built to flush
    subnormals would)."""
    out = key_cache_rotary_shift(cache, scale, slots, cos, sin, **attributes)
    if not attributes.get("quant_bit"):
        wide = cache.astype(np.float32)
        cache[(wide != 0) & (np.abs(wide) < float(ml_dtypes.finfo(cache.dtype).tiny))] = 0
    return out


rotary_flushing_subnormals = types.SimpleNamespace(key_cache_rotary_shift=_rotary_flushing_subnormals)
attention_window_ignored = types.SimpleNamespace(multi_head_attention=_attention_window_ignored)
attention_query_nan = types.SimpleNamespace(multi_head_attention=_attention_query_nan)


def _cache_attention_loads_first(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                                 decoding_batches, max_seqlen, max_kvlen, cache, scale=None, attn_mask=None,
                                 **attributes):
    """Gathers the keys from a copy of the cache as it was, then stores: loads before stores."""
    before = cache.copy(), None if scale is None else scale.copy()
    output = multi_head_cache_attention(query, current_key * 0, current_value * 0, seqstarts, kvstarts, cachestarts,
                                        start_pos, decoding_batches, max_seqlen, max_kvlen, before[0], before[1],
                                        attn_mask, **attributes)
    multi_head_cache_attention(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                               decoding_batches, max_seqlen, max_kvlen, cache, scale, attn_mask, **attributes)
    return output


cache_attention_loads_first = types.SimpleNamespace(multi_head_cache_attention=_cache_attention_loads_first)


def _cache_attention_nan_when_all_masked(*args, attn_mask=None, **attributes):
    """The fused op, but a query row whose mask entries are all -inf gets NaN (0 / 0) instead of zeros (every head's
    under a rank-2 mask, that head's under a rank-3 one)."""
    output = multi_head_cache_attention(*args, attn_mask=attn_mask, **attributes)
    if attn_mask is not None:
        hidden = np.all(np.isneginf(np.asarray(attn_mask, np.float32)), axis=-1)  # (tokens,) or (heads, tokens)
        output[hidden.T if hidden.ndim == 2 else hidden] = np.nan
    return output


cache_attention_nan_when_all_masked = types.SimpleNamespace(
    multi_head_cache_attention=_cache_attention_nan_when_all_masked)


def _cache_attention_kv_heads_required(*args, num_kv_heads=0, **attributes):
    if not num_kv_heads:
        raise ValueError("num_kv_heads must be set")
    return multi_head_cache_attention(*args, num_kv_heads=num_kv_heads, **attributes)


#: The fused op, refusing num_kv_heads 0 (the default, meaning num_heads).
cache_attention_kv_heads_required = types.SimpleNamespace(multi_head_cache_attention=_cache_attention_kv_heads_required)


def _refusing_empty_scale(op):
    def refusing(*args, scale=None, quant_bit=0, **attributes):
        if scale is not None and not quant_bit:
            raise ValueError("scale must be absent when quant_bit is 0")
        return op(*args, scale=scale, quant_bit=quant_bit, **attributes)
    return refusing


#: Every cache op, refusing the empty scale placeholder of ppl.pmx's export (which the specs read as absent).
empty_scale_refused = types.SimpleNamespace(
    key_value_cache=_refusing_empty_scale(correct),
    key_cache_rotary_shift=_refusing_empty_scale(key_cache_rotary_shift),
    multi_head_cache_attention=_refusing_empty_scale(multi_head_cache_attention))


def cache_attention_over(stores):
    """MultiHeadCacheAttention as ``stores`` (a KeyValueCache backend of this module) stores and gathers, then the
    reference's attention over the keys and values it gathered; ``output_factor`` scales the output (a bug)."""
    def op(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, decoding_batches,
           max_seqlen, max_kvlen, cache, scale=None, attn_mask=None, output_factor=1.0, **attributes):
        cache_attributes = {k: v for k, v in attributes.items() if k in CACHE_ATTRIBUTES}
        attention = {k: v for k, v in attributes.items() if k not in CACHE_ATTRIBUTES}
        key, value = stores(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                            max_kvlen, cache, scale, num_repeat=1, **cache_attributes)
        output = multi_head_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen,
                                      max_kvlen, attn_mask, **attention)
        return (output * output_factor).astype(output.dtype) if output_factor != 1.0 else output
    return op


#: The fused op with ppl's store arithmetic (``ppl_style``'s codes and scales).
ppl_style_cache_attention = cache_attention_over(ppl_style)

