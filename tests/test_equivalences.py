"""Layout equivalence, mode equivalence and the quantization error bound."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvcache_op.reference import canonical_view, dequantize, key_value_cache, quantize
from kvcache_op.reference.layout import LAYOUT_AXES
from strategies import calls


def run(case, **override):
    inputs = {k: (None if v is None else v.copy()) for k, v in case.inputs.items()}
    inputs.update(override)
    attrs = dict(case.attributes)
    attrs.update({k: override.pop(k) for k in list(override) if k in attrs})
    key, value = key_value_cache(**{k: v for k, v in inputs.items() if k not in attrs}, **attrs)
    return key, value, inputs["cache"], inputs["scale"]


def to_layout(tensor, src, dst):
    """Re-lays ``tensor`` out from layout ``src`` to ``dst`` (a copy, C-contiguous)."""
    canonical = canonical_view(tensor, src)  # (L, 2, H, MaxT, last)
    order = ("L", "KV", "H", "MaxT", "Dh")
    return np.ascontiguousarray(canonical.transpose([order.index(a) for a in LAYOUT_AXES[dst]]))


@given(calls(layouts=(0,)), st.integers(1, 3))
def test_all_layouts_give_the_same_logical_result(case, layout):
    quantized = bool(case.attributes["quant_bit"])  # else scale is absent or the empty placeholder
    key0, value0, cache0, scale0 = run(case)
    inputs = dict(case.inputs)
    inputs["cache"] = to_layout(case.inputs["cache"], 0, layout)
    if quantized:
        inputs["scale"] = to_layout(case.inputs["scale"], 0, layout)
    case.inputs, case.attributes = inputs, {**case.attributes, "cache_layout": layout}
    key, value, cache, scale = run(case)
    assert key.tobytes() == key0.tobytes() and value.tobytes() == value0.tobytes()
    assert canonical_view(cache, layout).tobytes() == canonical_view(cache0, 0).tobytes()
    if quantized:
        assert canonical_view(scale, layout).tobytes() == canonical_view(scale0, 0).tobytes()


@given(calls(modes=(0,)), st.sampled_from((1, 2, 3, 4, 16)))
def test_offset_mode_equals_paged_mode_with_contiguous_page_table(case, page_size):
    layout = case.attributes["cache_layout"]
    pad = [(0, 0)] * 5
    pad[layout] = (0, page_size)  # room for a last page that sticks out past the offset-mode span
    inputs = {k: v for k, v in case.inputs.items()}
    inputs["cache"] = np.pad(case.inputs["cache"], pad)
    if case.attributes["quant_bit"]:  # else scale is absent or the empty placeholder
        inputs["scale"] = np.pad(case.inputs["scale"], pad)
    key0, value0, cache0, scale0 = run(case, cache=inputs["cache"].copy(),
                                       scale=None if inputs["scale"] is None else inputs["scale"].copy())
    batch = len(inputs["start_pos"])
    max_t = inputs["cache"].shape[layout]
    pages = max_t // page_size + 1
    inputs["cachestarts"] = (case.inputs["cachestarts"][:, None] + page_size * np.arange(pages)[None, :]).reshape(
        batch, pages).astype(np.int64)
    case.inputs, case.attributes = inputs, {**case.attributes, "cache_mode": 1, "page_size": page_size}
    key, value, cache, scale = run(case)
    assert key.tobytes() == key0.tobytes() and value.tobytes() == value0.tobytes()
    assert cache.tobytes() == cache0.tobytes()
    if scale0 is not None:
        assert scale.tobytes() == scale0.tobytes()


FLOATS = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@pytest.mark.parametrize("quant_bit", (8, 4))
@pytest.mark.parametrize("scale_dtype", (np.float32, np.float16))
@given(x=hnp.arrays(np.float32, st.tuples(st.integers(1, 5), st.sampled_from((4, 8, 16))), elements=FLOATS),
       magnitude=st.sampled_from((1e-6, 1e-3, 1.0, 1e3)))
def test_quantization_error_is_at_most_half_a_scale(quant_bit, scale_dtype, x, magnitude):
    if scale_dtype == np.float16 and magnitude > 1:
        magnitude = 1.0  # max|x| / qmax must fit float16 (see the next test for what happens otherwise)
    x = (x * np.float32(magnitude)).astype(np.float32)
    codes, scale = quantize(x, quant_bit, 4, scale_dtype)
    qmax = {8: 127, 4: 7}[quant_bit]
    assert codes.min(initial=0) >= -qmax and codes.max(initial=0) <= qmax
    s = np.repeat(scale.astype(np.float64), 4, axis=-1)
    err = np.abs(codes * s - x.astype(np.float64))
    # Exact bound of rint(fl(x / s)): half a scale plus one float32 rounding of the quotient.
    assert np.all(err <= s / 2 + np.abs(x.astype(np.float64)) * 2.0**-24)
    back = dequantize(codes, scale, 4, np.float32).astype(np.float64)
    assert np.all(np.abs(back - x) <= s / 2 + np.abs(x.astype(np.float64)) * 2.0**-23)


def test_scale_has_a_floor_and_zero_groups_stay_zero():
    codes, scale = quantize(np.zeros((1, 8), np.float32), 8, 8, np.float32)
    assert scale[0, 0] == np.float32(1e-5) and not codes.any()


def test_scale_beyond_float16_range_is_inf_with_zero_codes():
    """Documented: a group whose max|x| / qmax overflows a float16 scale stores inf and codes 0."""
    x = np.array([[8.4e6, 1.0, -2.0, 0.0]], np.float32)
    codes, scale = quantize(x, 8, 4, np.float16)
    assert np.isinf(scale[0, 0]) and not codes.any()
    assert np.isnan(dequantize(codes, scale, 4, np.float32)).all()
