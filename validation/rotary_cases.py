"""Named KeyCacheRotaryShift conformance cases: valid calls (``rotary_*``) and every rejection of
spec/KeyCacheRotaryShift.md (``ERROR_CASES``, written as ``rotary_error_*``; the project's error tests use
the same calls). Each is a function of nothing that returns a :class:`~kvcache_op.validation.cases.Case`."""

import zlib

import numpy as np

from ..reference import INT4, cache_shape, rotary_shift_tables
from .cases import _T1, Case, deferred, with_empty_scale


def build_rotary(name, *, quant_bit=0, heads=2, head_dim=8, max_t=10, num_layer=1, layer_idx=0, cache_layout=0,
                 quant_group=4, t="float16", t3="float32", slots=(1, 4, 7), rotary_dim=0, rotary_interleaved=0,
                 seed=None) -> Case:
    """Rotates the keys of ``slots`` of a cache pre-filled with seeded random history (codes and scales
    when quantized); the deltas are seeded too."""
    rng = np.random.default_rng(zlib.crc32(name.encode()) if seed is None else seed)
    shape = cache_shape(cache_layout, num_layer, max_t, heads, head_dim)
    if quant_bit:
        q = 7 if quant_bit == 4 else 127
        cache = rng.integers(-q, q + 1, shape).astype(INT4 if quant_bit == 4 else np.int8)
        scale = rng.uniform(0.01, 0.1, cache_shape(cache_layout, num_layer, max_t, heads,
                                                   head_dim // quant_group)).astype(_T1[t3])
    else:
        cache, scale = (rng.standard_normal(shape) * 2).astype(_T1[t]), None
    slots = np.asarray(slots, np.int64)
    cos, sin = rotary_shift_tables(rng.integers(-50, 50, len(slots)), rotary_dim or head_dim)
    attributes = dict(num_layer=num_layer, layer_idx=layer_idx, cache_layout=cache_layout, quant_bit=quant_bit,
                      quant_group=quant_group, rotary_dim=rotary_dim, rotary_interleaved=rotary_interleaved)
    return Case(name, {"cache": cache, "scale": scale, "slots": slots, "cos": cos, "sin": sin}, attributes)


def _ties_int8(case):
    """Slot 2, kv head 0 holds codes [127, 125, 0, 0] at scale 1, rotated by cos 1, sin 0.5 (half split): the
    rotated values are 127, 125, 63.5 and 62.5, the new scale 1, so two quotients are exact ties (round to even)."""
    case.inputs["cache"][2, 0, 0, 0] = [127, 125, 0, 0]
    case.inputs["scale"][2, 0, 0, 0] = 1.0
    case.inputs["cos"][:] = 1.0
    case.inputs["sin"][:] = 0.5
    return case


def _registry():
    cases = {}

    def case(name, then=None, **kw):
        cases[name] = deferred(build_rotary, name, then=then, **kw)

    case("rotary_float16_half_split")
    case("rotary_bfloat16_interleaved_layout2", t="bfloat16", rotary_interleaved=1, cache_layout=2)
    case("rotary_float32_partial_rotary_dim", t="float32", rotary_dim=4, head_dim=8, cache_layout=1)
    case("rotary_int8_layout1", quant_bit=8, cache_layout=1)
    case("rotary_int4_layout3_scale_float16", quant_bit=4, cache_layout=3, t3="float16", quant_group=2)
    case("rotary_layers2_layer_idx1_interleaved", num_layer=2, layer_idx=1, rotary_interleaved=1, quant_bit=8)
    case("rotary_empty_scale_placeholder", then=with_empty_scale)
    case("rotary_no_slots", slots=())
    case("rotary_unsorted_slots", slots=(7, 1, 4))
    case("rotary_ties_int8", then=_ties_int8, quant_bit=8, head_dim=4, quant_group=4, slots=(2, 5))
    return cases


CASES = _registry()


def _valid_call(quant_bit=8, heads=2, head_dim=8, max_t=8):
    rng = np.random.default_rng(5)
    if quant_bit:
        cache = rng.integers(-7, 8, cache_shape(0, 1, max_t, heads, head_dim)).astype(np.int8 if quant_bit == 8 else INT4)
        scale = np.full(cache_shape(0, 1, max_t, heads, head_dim // 4), 0.02, np.float32)
    else:
        cache, scale = rng.standard_normal(cache_shape(0, 1, max_t, heads, head_dim)).astype(np.float32), None
    cos, sin = rotary_shift_tables(np.array([1, 2]), head_dim)
    inputs = {"cache": cache, "scale": scale, "slots": np.array([1, 2]), "cos": cos, "sin": sin}
    return inputs, dict(quant_bit=quant_bit, quant_group=4)


def _with(inputs=None, attrs=None, quant_bit=8, **call):
    base, base_attrs = _valid_call(quant_bit, **call)
    return {**base, **(inputs or {})}, {**base_attrs, **(attrs or {})}


def _zero_heads():
    inputs, attrs = _valid_call(0)
    return {**inputs, "cache": np.zeros((8, 1, 2, 0, 8), np.float32)}, attrs


def _zero_head_dim():
    inputs, attrs = _valid_call(0)
    return {**inputs, "cache": np.zeros((8, 1, 2, 2, 0), np.float32)}, {**attrs, "rotary_dim": 0}


#: name -> (inputs, attributes): one per rejection of spec/KeyCacheRotaryShift.md that ONNX Runtime lets reach
#: the op (slots/cos/sin of another dtype are refused by ONNX Runtime itself: the op declares them int64/float32).
ERROR_CASES = {
    "num_layer_zero": lambda: _with(attrs={"num_layer": 0}),
    "layer_idx": lambda: _with(attrs={"layer_idx": 1}),
    "quant_bit_3": lambda: _with(attrs={"quant_bit": 3}),
    "quant_group_zero": lambda: _with(attrs={"quant_group": 0}),
    "cache_layout_4": lambda: _with(attrs={"cache_layout": 4}),
    "cache_not_int8": lambda: _with({"cache": _valid_call()[0]["cache"].astype(np.float32)}),
    "float_cache_int8": lambda: _with({"cache": _valid_call()[0]["cache"]}, {"quant_bit": 0}, quant_bit=0),
    "cache_rank_4": lambda: _with({"cache": _valid_call()[0]["cache"][0]}),
    "cache_zero_heads": _zero_heads,
    "cache_zero_head_dim": _zero_head_dim,
    "cache_kv_axis_3": lambda: _with({"cache": np.zeros((8, 1, 3, 2, 8), np.int8)}),
    "cache_num_layer_2": lambda: _with(attrs={"num_layer": 2}),
    "scale_with_float_cache": lambda: _with({"scale": np.ones(cache_shape(0, 1, 8, 2, 2), np.float32)}, quant_bit=0),
    "quant_group_3": lambda: _with(attrs={"quant_group": 3}),
    "int4_odd_head_dim": lambda: _with({"cache": np.zeros((8, 1, 2, 2, 3), INT4),
                                        "scale": np.ones((8, 1, 2, 2, 3), np.float32)},
                                       {"quant_bit": 4, "quant_group": 1, "rotary_dim": 2}, quant_bit=4),
    "scale_missing": lambda: _with({"scale": None}),
    "scale_float64": lambda: _with({"scale": np.ones(cache_shape(0, 1, 8, 2, 2), np.float64)}),
    "scale_shape": lambda: _with({"scale": np.ones(cache_shape(0, 1, 8, 2, 4), np.float32)}),
    "rotary_dim_odd": lambda: _with(attrs={"rotary_dim": 3}),
    "rotary_dim0_odd_head_dim": lambda: _with({"cache": np.zeros((8, 1, 2, 2, 3), np.float32)}, quant_bit=0),
    "rotary_dim_too_big": lambda: _with(attrs={"rotary_dim": 10}),
    "interleaved_2": lambda: _with(attrs={"rotary_interleaved": 2}),
    "slots_2d": lambda: _with({"slots": np.array([[1, 2]])}),
    "cos_shape": lambda: _with({"cos": np.ones((2, 3), np.float32)}),
    "sin_shape": lambda: _with({"sin": np.ones((3, 4), np.float32)}),
    "slot_negative": lambda: _with({"slots": np.array([-1, 2])}),
    "slot_past_max_t": lambda: _with({"slots": np.array([1, 8])}),
    "slot_twice": lambda: _with({"slots": np.array([2, 2])}),
}
