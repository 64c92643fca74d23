"""The tolerance table of spec/KeyValueCache.md ("Tolerance table for validating other backends"), as code.

``--tolerance spec`` accepts exactly the differences the table documents for backends with other
quantization arithmetic, and nothing else:

* unquantized calls: none (data movement is exact);
* cache codes: within +-1 of the expected code, only in the slots the call stores;
* scales: within half an ulp of T1 plus one ulp of T3 of the expected scale (a scale computed in T1 and
  stored into T3), only in the slots the call stores;
* every other cache and scale element: byte-for-byte as expected;
* outputs of a quantized call: within ``|code' * scale' - code * scale|`` of the expected value plus one
  ulp of T3 and one ulp of T1 at the output's magnitude, where ``(code', scale')`` is what the backend holds
  in the slot the element is loaded from and ``(code, scale)`` what the spec holds there (the backend may
  dequantize in the scale's dtype, then round to T1); and each is the backend's own pair dequantized, within
  those two roundings.

Whether each stored code is its value over the backend's own scale rounded to nearest (the table's other
arithmetic, not a bias of one) needs the call's inputs: kvcache_op.validation.compare checks it.

Each function returns a boolean mask of the elements *outside* the tolerance.
"""

import numpy as np

from ..reference.dtypes import BFLOAT16

#: (explicit mantissa bits, smallest normal exponent) of the float types of the spec.
_FORMATS = {np.dtype(np.float32): (23, -126), np.dtype(np.float16): (10, -14), BFLOAT16: (7, -126)}


def bits_differ(got, want, nan_payloads: bool = False) -> np.ndarray:
    """Elements whose bits differ (floats: any NaN matches any NaN, whose payload the spec leaves open where values
    are computed, unless ``nan_payloads``: where they are only moved, every bit; int4 compares values)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype in _FORMATS:
        unsigned = f"u{got.dtype.itemsize}"
        differ = got.view(unsigned) != want.view(unsigned)
        if nan_payloads:
            return differ
        return differ & ~(np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32)))
    if got.dtype.kind == "V" or got.dtype.name == "int4":
        return got.astype(np.int8) != want.astype(np.int8)
    return got != want


def ulp(x, dtype) -> np.ndarray:
    """The spacing of ``dtype``'s values at ``|x|`` (float64), subnormals included."""
    mantissa, emin = _FORMATS[np.dtype(dtype)]
    magnitude = np.abs(np.asarray(x, np.float64))
    _, exponent = np.frexp(magnitude)  # magnitude = m * 2**exponent, 0.5 <= m < 1
    exponent = np.where(magnitude > 0, np.maximum(exponent - 1, emin), emin)
    return np.ldexp(1.0, exponent - mantissa)


def special_values(got, want) -> tuple:
    """(a non-finite value on either side, and such an element that is not the same on both: NaN matches
    any NaN, an infinity only itself)."""
    special = ~np.isfinite(got) | ~np.isfinite(want)
    both_nan = np.isnan(got) & np.isnan(want)
    return special, special & ~both_nan & (got != want)


def codes_outside(got_codes, want_codes, stored) -> np.ndarray:
    """Codes differing by more than one, or differing at all outside the stored elements."""
    diff = np.abs(np.asarray(got_codes, np.int64) - np.asarray(want_codes, np.int64))
    return np.where(stored, diff > 1, diff != 0)


def scales_outside(got, want, stored, t1) -> np.ndarray:
    """Scales beyond half an ulp of T1 plus one ulp of T3 in stored elements, or differing elsewhere (every bit, a
    NaN's payload too: those are left as they were)."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    special, bad_special = special_values(g, w)
    with np.errstate(invalid="ignore"):
        magnitude = np.maximum(np.abs(g), np.abs(w))  # the larger binade, should the two straddle one
        outside = ~(np.abs(g - w) <= 0.5 * ulp(magnitude, t1) + ulp(magnitude, want.dtype))
    return np.where(stored, np.where(special, bad_special, outside), bits_differ(got, want, nan_payloads=True))


def outputs_outside(got, want, got_pair, want_pair, t3, own=True) -> np.ndarray:
    """Quantized outputs beyond ``|c' s' - c s|`` plus one ulp of T3 and of T1 of the expected ones, or (``own``)
    not the backend's own ``c' s'`` within those two ulps (the pairs: (code, scale) arrays of the output's shape,
    from the backend's cache and the expected one)."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    special, bad_special = special_values(g, w)
    with np.errstate(invalid="ignore"):  # a code times an infinite (or NaN) scale: the special values' rule decides
        dequantized = [np.asarray(c, np.float64) * np.asarray(s, np.float64) for c, s in (got_pair, want_pair)]
        magnitude = np.maximum.reduce([np.abs(g), np.abs(w), np.abs(dequantized[0]), np.abs(dequantized[1])])
        rounding = ulp(magnitude, t3) + ulp(magnitude, got.dtype)
        outside = ~(np.abs(g - w) <= np.abs(dequantized[0] - dequantized[1]) + rounding)
        if own:
            outside |= ~(np.abs(g - dequantized[0]) <= rounding) & np.isfinite(dequantized[0])
    return np.where(special, bad_special, outside)
