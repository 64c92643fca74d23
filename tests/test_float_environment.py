"""KeyCacheRotaryShift and MultiHeadCacheAttention on the CPU, run by a caller whose thread holds another
floating-point environment than the specs' (round to nearest even, no flush of subnormals): a directed rounding mode,
denormals-are-zero, flush-to-zero (ONNX Runtime's session.set_denormal_as_zero sets the last two). The rotated and
requantized cache is the reference's bit for bit; attention's output is within the spec's bound of the float64
oracle; the caller's environment comes back. (KeyValueCache's own checks are in test_cpu_kernel_rows.py.)"""

import ml_dtypes
import numpy as np
import pytest

from cpu_kernels import CPU_KERNELS, NEEDS_MXCSR, give_back_mxcsr, use_cpu_kernel
from cpu_kernels import mxcsr  # noqa: F401 - a fixture
from ort_helpers import copies
from test_mha_reference import assert_within

from kvcache_op.capi import c_api
from kvcache_op.reference import cache_shape, key_cache_rotary_shift, rotary_shift_tables
from kvcache_op.reference.dtypes import CACHE_TYPE_FOR_QUANT_BIT
from kvcache_op.reference.quantize import quantize

pytestmark = NEEDS_MXCSR

# (name, how to set it, how to read it back from MXCSR, how to give the caller's back)
MODES = [
    ("down", lambda m: m.kv_test_set_rounding(1), lambda csr: (csr >> 13) & 3 == 1),
    ("up", lambda m: m.kv_test_set_rounding(2), lambda csr: (csr >> 13) & 3 == 2),
    ("toward-zero", lambda m: m.kv_test_set_rounding(3), lambda csr: (csr >> 13) & 3 == 3),
    ("daz-ftz", lambda m: m.kv_test_set_flush_modes(3), lambda csr: csr & 0x8040 == 0x8040),
]


def _in_mode(mxcsr, mode, call):
    """``call()`` with the thread in ``mode``; asserts the mode is still there after it; the caller's back after."""
    _, enter, holds = mode
    before = enter(mxcsr)
    try:
        result = call()
        after = enter(mxcsr)
    finally:
        give_back_mxcsr(mxcsr, before)
    assert holds(after), "the op did not give the caller's floating-point environment back"
    return result


ROTARY_CASES = [("float32", 0, None), ("float16", 0, None), ("bfloat16", 0, None), ("int8", 8, np.float16),
                ("int4", 4, np.float16), ("int8", 8, np.float32)]


def _rotary_inputs(cache_type: str, quant_bit: int, scale_type, rng):
    """A cache of 16 slots x 2 heads x 16 and its scale: half the slots ordinary keys, half keys whose rotation
    gives float32 subnormals (float32 caches) or whose scales are float16 subnormals (quantized caches)."""
    slots_all, heads, head_dim = 16, 2, 16
    shape = cache_shape(0, 1, slots_all, heads, head_dim)  # (MaxT, layers, key/value, heads, Dh)
    x = rng.standard_normal(shape).astype(np.float32)
    x[::2] *= np.float32(3e-39) if cache_type == "float32" else np.float32(2e-5 if quant_bit == 8 else 2e-6)
    if quant_bit:
        codes, scale = quantize(x, quant_bit, 8, scale_type)
        cache = codes.astype(CACHE_TYPE_FOR_QUANT_BIT[quant_bit])
    else:
        cache, scale = x.astype(ml_dtypes.bfloat16 if cache_type == "bfloat16" else cache_type), None
    slots = np.arange(0, slots_all, dtype=np.int64)
    cos, sin = rotary_shift_tables(rng.integers(-500, 500, slots_all), head_dim)
    return cache, scale, slots, cos, sin


@pytest.mark.parametrize("mode", MODES, ids=[m[0] for m in MODES])
@pytest.mark.parametrize("cache_type, quant_bit, scale_type", ROTARY_CASES,
                         ids=[f"{c}-{getattr(s, '__name__', 'none')}" for c, _, s in ROTARY_CASES])
def test_rotary_shift_rounds_as_the_spec_in_any_environment(mxcsr, mode, cache_type, quant_bit, scale_type):
    """Without the op setting the spec's environment, a directed mode changed the rotated float16 keys and the
    requantized codes, and denormals-are-zero read float32 subnormal keys (and, in the generic conversions, float16
    subnormal scales) as zero."""
    cache, scale, slots, cos, sin = _rotary_inputs(cache_type, quant_bit, scale_type, np.random.default_rng(quant_bit))
    attrs = {"quant_bit": quant_bit, "quant_group": 8}
    want_cache, want_scale = cache.copy(), None if scale is None else scale.copy()
    key_cache_rotary_shift(want_cache, want_scale, slots, cos, sin, **attrs)  # the reference, in the default mode
    got_cache, got_scale = cache.copy(), None if scale is None else scale.copy()
    _in_mode(mxcsr, mode, lambda: c_api.key_cache_rotary_shift(got_cache, got_scale, slots, cos, sin, num_threads=1,
                                                               **attrs))
    assert got_cache.tobytes() == want_cache.tobytes()
    if scale is not None:
        assert got_scale.tobytes() == want_scale.tobytes()


@pytest.mark.parametrize("mode", MODES, ids=[m[0] for m in MODES])
@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("quant_bit", [8, 4])
def test_cache_attention_reads_subnormal_scales_in_any_environment(mxcsr, monkeypatch, mode, kernel, quant_bit):
    """MultiHeadCacheAttention over a quantized cache whose keys and values are small enough that every float16
    scale is subnormal (paged, history and this call's tokens, a decode beside a prefill): the cache the naive
    KeyValueCache writes, bit for bit, and the output within the spec's bound of the float64 oracle."""
    from test_mhca_ort_cpu import naive_oracle

    from kvcache_op.validation.cases import Seq
    from kvcache_op.validation.mhca_cases import build_cache_attention

    use_cpu_kernel(monkeypatch, kernel)
    case = build_cache_attention(f"subnormal-scales-{quant_bit}", [Seq(30, 1), Seq(5, 9)], heads=2, head_dim=32,
                                 group=2, decoding=1, cache_mode=1, page_size=8, t1="float16", t3="float16",
                                 quant_bit=quant_bit, quant_group=8, cache_layout=0)
    inputs = case.inputs
    tiny = np.float32(2e-5 if quant_bit == 8 else 2e-6)
    for name in ("current_key", "current_value"):
        inputs[name] = (inputs[name].astype(np.float32) * tiny).astype(np.float16)
    inputs["scale"] = (inputs["scale"].astype(np.float32) * tiny).astype(np.float16)  # the history's scales too
    assert np.count_nonzero(np.abs(inputs["scale"]) < np.float16(2.0 ** -14)) > inputs["scale"].size // 2
    exact, bound, cache_after, scale_after = naive_oracle(inputs, case.attributes)
    fresh = copies(inputs)
    out = _in_mode(mxcsr, mode, lambda: c_api.multi_head_cache_attention(**fresh, **case.attributes, num_threads=1))
    assert fresh["cache"].tobytes() == cache_after.tobytes() and fresh["scale"].tobytes() == scale_after.tobytes()
    assert_within(out, exact, bound, f"{kernel} in {mode[0]}")


@pytest.mark.parametrize("mode", MODES, ids=[m[0] for m in MODES])
def test_attention_gives_the_same_bits_in_any_environment(mxcsr, mode):
    """Every task of the attention kernel runs in the spec's environment, and so do the values computed before them
    (the default scale 1/sqrt(128) and the ALiBi slopes of 12 heads, both inexact): the output in any mode is the
    round-to-nearest output, bit for bit."""
    from kvcache_op.validation.mha_cases import build_attention

    case = build_attention("environment", [(1, 40), (9, 30)], heads=12, kv_heads=4, head_dim=128, t="float32",
                           decoding=1, is_alibi=1)
    want = c_api.multi_head_attention(**copies(case.inputs), **case.attributes, num_threads=1)
    got = _in_mode(mxcsr, mode, lambda: c_api.multi_head_attention(**copies(case.inputs), **case.attributes,
                                                                   num_threads=1))
    assert got.tobytes() == want.tobytes()
