"""The bound the CPU kernel's quantization fast paths rely on: a group quantized by its own finite scale
s = T3(max(amax / qmax, eps)) has |x / s| < qmax + 1/2 for every element (|x| <= amax), so rounding the
quotient needs no clamp. Checked with numpy's IEEE arithmetic (not the kernel's code) for every float16 and
bfloat16 amax, and for float32 amax on every bit pattern where a float16 scale is coarsest (float16
subnormal scales, just above eps, for int8's and int4's qmax) and on a stride of patterns over the whole
finite range. Also: int4 codes survive their nibble packing, the range's ends included."""

import numpy as np
import pytest

from kvcache_op.reference.dtypes import QMAX

EPS = np.float32(1e-5)


def own_scale_quotients(amax: np.ndarray, t3, qmax: int) -> np.ndarray:
    """amax / s for each amax whose scale s is finite (float32 arithmetic, as the spec): the largest |x / s|
    of its group."""
    amax = amax[np.isfinite(amax) & (amax >= 0)].astype(np.float32)
    scale = amax / np.float32(qmax)
    scale = np.where(scale > EPS, scale, EPS).astype(np.float32)
    with np.errstate(over="ignore"):
        scale = scale.astype(t3).astype(np.float32)
    keep = np.isfinite(scale)
    return amax[keep] / scale[keep]


def float32_patterns(qmax: int) -> np.ndarray:
    """Every float32 amax whose float16 scale (amax / qmax) is a subnormal (the coarsest relative steps), and
    every 4099th pattern of the whole non-negative finite range."""
    low = np.float32(EPS * qmax * 0.99).view(np.uint32)
    high = np.float32(2.0**-14 * qmax * 1.01).view(np.uint32)
    dense = np.arange(low, high, dtype=np.uint32)
    stride = np.arange(0, 0x7F800000, 4099, dtype=np.uint32)
    return np.concatenate([dense, stride]).view(np.float32)


@pytest.mark.parametrize("quant_bit", [8, 4])
@pytest.mark.parametrize("t3", ["float32", "float16"])
@pytest.mark.parametrize("t1", ["float16", "bfloat16", "float32"])
def test_own_scale_quotients_round_within_qmax(t1, t3, quant_bit):
    qmax = QMAX[quant_bit]
    if t1 == "float32":
        amax = float32_patterns(qmax)
    else:
        bits = np.arange(0x8000, dtype=np.uint32)  # every non-negative pattern
        amax = (bits << 16).view(np.float32) if t1 == "bfloat16" else bits.astype(np.uint16).view(np.float16)
    quotients = own_scale_quotients(np.asarray(amax), np.dtype(t3), qmax)
    assert quotients.size > 10000
    assert np.rint(quotients).max() <= qmax
    # the bound is near tight: float16 scales do push the quotient past qmax, only never to qmax + 1/2
    if t3 == "float16" and t1 != "bfloat16":
        assert quotients.max() > qmax * 1.002


@pytest.mark.parametrize("quant_bit", [8, 4])
def test_a_float16_scale_overflows_from_a_quotient_of_65520_as_the_spec_says(quant_bit):
    """The spec's limit: a group's float16 scale is inf once the float32 quotient amax / qmax reaches 65520 (float16
    rounds it up to 65536, past its largest finite value); just below, the scale is 65504 and the codes normal."""
    from kvcache_op.reference.quantize import quantize

    qmax = QMAX[quant_bit]
    below = np.nextafter(np.float32(65520), np.float32(0))
    for quotient, finite in ((np.float32(65504), True), (below, True), (np.float32(65520), False)):
        amax = np.float32(quotient * np.float32(qmax))
        assert np.float32(amax / np.float32(qmax)) == quotient  # the quotient the group's scale rounds
        x = np.array([[amax, -amax / 2] + [0] * 6], np.float32)
        codes, scale = quantize(x, quant_bit, 8, np.float16)
        if finite:
            assert scale[0, 0] == np.float16(65504) and codes[0, 0] == qmax
        else:
            assert np.isinf(scale[0, 0]) and not codes.any()


def test_int4_codes_round_trip_through_the_packing_at_both_ends_of_the_range():
    """Every int4 code, 7 and -8 included, comes back as itself from its nibble (two per byte, low one first)."""
    from kvcache_op.reference.quantize import pack_int4, unpack_int4

    codes = np.array([7, -8, 1, -1, 0, 6, -7], np.int8)
    packed = pack_int4(codes)
    assert packed.tolist() == [0x87, 0xF1, 0x60, 0x09]
    unpacked = unpack_int4(packed, codes.size)
    assert unpacked.dtype == np.int8 and unpacked.tolist() == codes.tolist()
    every = np.arange(-8, 8, dtype=np.int8)
    assert unpack_int4(pack_int4(every), every.size).tolist() == every.tolist()
