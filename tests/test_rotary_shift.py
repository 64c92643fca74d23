"""KeyCacheRotaryShift: the reference against RoPE itself, untouched cells, errors, and the ORT CPU op
bit for bit."""

import numpy as np
import pytest
from hypothesis import given

from kvcache_op import spec
from kvcache_op.ort_ops import make_session
from kvcache_op.reference import (KeyValueCacheError, apply_rope, cache_shape, canonical_view,
                                  key_cache_rotary_shift, quantize, rotary_shift_tables)
from strategies import shift_calls


def reference(inputs, attrs):
    fresh = {k: (None if v is None else v.copy()) for k, v in inputs.items()}
    out = key_cache_rotary_shift(**fresh, **attrs)
    return out, fresh["cache"], fresh["scale"]


@given(shift_calls())
def test_ort_cpu_rotary_shift_matches_reference(call):
    inputs, attrs = call
    want_out, want_cache, want_scale = reference(inputs, attrs)
    feeds = {k: v.copy() for k, v in inputs.items() if v is not None}
    model = spec.make_rotary_shift_model(inputs, **attrs)
    (out,) = run_model_any(model, feeds)
    assert np.array_equal(out, want_out)
    assert feeds["cache"].tobytes() == want_cache.tobytes()
    if want_scale is not None:
        assert feeds["scale"].tobytes() == want_scale.tobytes()


def run_model_any(model, feeds):
    """run_model for a one-output model (the helper binds every output)."""
    from kvcache_op.ort_ops import ortvalue_for, to_numpy

    session = make_session(model)
    binding = session.io_binding()
    values = {}
    for info in session.get_inputs():
        values[info.name] = ortvalue_for(feeds[info.name])
        binding.bind_ortvalue_input(info.name, values[info.name])
    binding.bind_output("slots_out", "cpu")
    session.run_with_iobinding(binding)
    for name, value in values.items():
        if value.data_type() == "tensor(int4)":
            feeds[name][...] = to_numpy(value)
    return [to_numpy(v) for v in binding.get_outputs()]


@given(shift_calls())
def test_only_the_key_rows_of_the_slots_change(call):
    inputs, attrs = call
    _, cache, scale = reference(inputs, attrs)
    written = np.zeros(canonical_view(cache, attrs["cache_layout"]).shape[:4], bool)
    written[attrs["layer_idx"], 0, :, inputs["slots"]] = True
    for before, after in ((inputs["cache"], cache), (inputs["scale"], scale)):
        if before is None:
            continue
        old = canonical_view(before, attrs["cache_layout"]).copy()
        new = canonical_view(after, attrs["cache_layout"]).copy()
        assert old[~written].tobytes() == new[~written].tobytes()


def rope_complex(x, positions, interleaved, theta=10000.0):
    """RoPE as complex multiplication in float64: independent of the reference's rotate()."""
    d = x.shape[-1]
    if interleaved:
        z = x[..., 0::2] + 1j * x[..., 1::2]
    else:
        z = x[..., : d // 2] + 1j * x[..., d // 2:]
    freq = theta ** (-2.0 * np.arange(d // 2) / d)
    z = z * np.exp(1j * np.asarray(positions, np.float64)[:, None, None] * freq)
    out = np.empty_like(x, dtype=np.float64)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., : d // 2], out[..., d // 2:] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleaved", [0, 1])
def test_shifting_a_rope_key_equals_rope_at_the_new_position(interleaved):
    rng = np.random.default_rng(1)
    raw = rng.standard_normal((6, 2, 16))
    cache = np.zeros(cache_shape(0, 1, 8, 2, 16), np.float32)
    cache[:6, 0, 0] = rope_complex(raw, np.arange(100, 106), interleaved)
    cos, sin = rotary_shift_tables(np.full(6, -90), 16)
    key_cache_rotary_shift(cache, None, np.arange(6), cos, sin, rotary_interleaved=interleaved)
    np.testing.assert_allclose(cache[:6, 0, 0], rope_complex(raw, np.arange(10, 16), interleaved), atol=2e-5)
    assert np.allclose(apply_rope(raw.astype(np.float32), np.arange(10, 16), interleaved=interleaved),
                       rope_complex(raw, np.arange(10, 16), interleaved), atol=2e-5)


def test_partial_rotary_dim_leaves_the_tail_alone():
    cache = np.random.default_rng(2).standard_normal(cache_shape(0, 1, 4, 1, 8)).astype(np.float32)
    before = cache.copy()
    cos, sin = rotary_shift_tables(np.array([5]), 4)
    key_cache_rotary_shift(cache, None, np.array([1]), cos, sin, rotary_dim=4)
    assert np.array_equal(cache[1, 0, 0, 0, 4:], before[1, 0, 0, 0, 4:])
    assert not np.array_equal(cache[1, 0, 0, 0, :4], before[1, 0, 0, 0, :4])


def test_int8_requantizes_with_a_fresh_scale():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 1, 8)).astype(np.float32)
    codes, s = quantize(x, 8, 8, np.float32)
    cache = np.zeros(cache_shape(0, 1, 2, 1, 8), np.int8)
    scale = np.zeros(cache_shape(0, 1, 2, 1, 1), np.float32)
    cache[0, 0, 0], scale[0, 0, 0] = codes[0], s[0]
    cos, sin = rotary_shift_tables(np.array([3]), 8)
    key_cache_rotary_shift(cache, scale, np.array([0]), cos, sin, quant_bit=8)
    assert np.abs(cache[0, 0, 0]).max() == 127  # the fresh scale makes the largest code full range


BAD = [
    ("slot_out_of_range", lambda i, a: i.__setitem__("slots", np.array([0, 99], np.int64)), r"slots\[1\] = 99 must be in \[0, MaxT=8\)"),
    ("slot_negative", lambda i, a: i.__setitem__("slots", np.array([-1, 2], np.int64)), r"slots\[0\] = -1"),
    ("slot_twice", lambda i, a: i.__setitem__("slots", np.array([3, 3], np.int64)), "slot 3 appears more than once"),
    ("cos_shape", lambda i, a: i.__setitem__("cos", i["cos"][:, :1].copy()), r"cos must be float32 of shape \(2, 4\)"),
    ("rotary_dim_odd", lambda i, a: a.__setitem__("rotary_dim", 3), "rotary_dim must be 0 or even"),
    ("interleaved_2", lambda i, a: a.__setitem__("rotary_interleaved", 2), "rotary_interleaved must be 0 or 1"),
    ("layer_idx", lambda i, a: a.__setitem__("layer_idx", 1), r"layer_idx must be in \[0, num_layer=1\)"),
    ("scale_missing", lambda i, a: i.__setitem__("scale", None), "scale is required when quant_bit is 8"),
    ("cache_not_int8", lambda i, a: i.__setitem__("cache", i["cache"].astype(np.float32)), "cache dtype must be int8"),
]


@pytest.mark.parametrize("row", BAD, ids=[r[0] for r in BAD])
@pytest.mark.parametrize("backend", ["reference", "ort", "c_api"])
def test_invalid_shift_fails_and_writes_nothing(row, backend):
    cache = np.random.default_rng(4).integers(-127, 128, cache_shape(0, 1, 8, 2, 8)).astype(np.int8)
    scale = np.full(cache_shape(0, 1, 8, 2, 2), 0.02, np.float32)
    cos, sin = rotary_shift_tables(np.array([1, 2]), 8)
    inputs = {"cache": cache, "scale": scale, "slots": np.array([1, 2], np.int64), "cos": cos, "sin": sin}
    attrs = dict(quant_bit=8, quant_group=4)
    row[1](inputs, attrs)
    before = {k: inputs[k].tobytes() for k in ("cache", "scale") if inputs.get(k) is not None}
    if backend == "reference":
        with pytest.raises(KeyValueCacheError, match=row[2]):
            key_cache_rotary_shift(**inputs, **attrs)
    elif backend == "c_api":
        from kvcache_op.capi import c_api

        with pytest.raises(KeyValueCacheError, match=row[2]):
            c_api.key_cache_rotary_shift(**inputs, **attrs)
    else:
        with pytest.raises(Exception, match=row[2]):
            run_model_any(spec.make_rotary_shift_model(inputs, **attrs),
                          {k: v for k, v in inputs.items() if v is not None})
    assert {k: inputs[k].tobytes() for k in before} == before
