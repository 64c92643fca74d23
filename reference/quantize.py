"""Symmetric per-group quantization exactly as spec/KeyValueCache.md section "Quantization".

All arithmetic is float32. The scale is rounded to the scale tensor's dtype first and the
*stored* value is used to quantize, so the stored pair (code, scale) alone defines the value.
"""

import numpy as np

from .dtypes import QMAX, SCALE_EPS


def quantize(x: np.ndarray, quant_bit: int, quant_group: int, scale_dtype) -> tuple:
    """Quantize ``x[..., Dh]`` in groups of ``quant_group`` along the last axis.

    Returns ``(codes, scale)``: int8 codes in ``[-QMAX, QMAX]`` with the shape of ``x`` and the
    stored scales (``scale_dtype``) with last axis ``Dh // quant_group``. NaN quotients give code 0.
    """
    qmax = np.float32(QMAX[quant_bit])
    x32 = np.asarray(x).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # inf/NaN outcomes are defined by the spec
        return _quantize(x32, qmax, quant_group, scale_dtype)


def _quantize(x32, qmax, quant_group, scale_dtype):
    groups = x32.reshape(*x32.shape[:-1], x32.shape[-1] // quant_group, quant_group)
    amax = np.max(np.abs(groups), axis=-1)  # NaN propagates, as the spec says
    scale = np.maximum(amax / qmax, SCALE_EPS).astype(scale_dtype)
    quotient = groups / scale.astype(np.float32)[..., None]
    codes = np.clip(np.rint(quotient), -qmax, qmax)
    codes = np.where(np.isnan(codes), np.float32(0), codes).astype(np.int8)
    return codes.reshape(x32.shape), scale


def dequantize(codes: np.ndarray, scale: np.ndarray, quant_group: int, out_dtype) -> np.ndarray:
    """``float32(code) * float32(scale)`` per group, then one rounding to ``out_dtype``."""
    c32 = np.asarray(codes).astype(np.float32)
    groups = c32.reshape(*c32.shape[:-1], c32.shape[-1] // quant_group, quant_group)
    with np.errstate(over="ignore", invalid="ignore"):  # 0 * inf = NaN and overflow to inf are defined results
        values = groups * np.asarray(scale).astype(np.float32)[..., None]
        return values.reshape(c32.shape).astype(out_dtype)


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """ONNX INT4 packing: element 2i in the low nibble, 2i+1 in the high nibble of byte i."""
    flat = np.asarray(codes).astype(np.int8).reshape(-1)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.int8)])
    nibbles = flat.view(np.uint8) & np.uint8(0x0F)
    return (nibbles[0::2] | (nibbles[1::2] << np.uint8(4))).astype(np.uint8)


def unpack_int4(packed: np.ndarray, count: int) -> np.ndarray:
    """Inverse of :func:`pack_int4`: the first ``count`` signed 4-bit values as int8."""
    packed = np.asarray(packed, dtype=np.uint8).reshape(-1)
    nibbles = np.empty(packed.size * 2, np.uint8)
    nibbles[0::2] = packed & 0x0F
    nibbles[1::2] = packed >> 4
    signed = nibbles.astype(np.int8)
    signed[signed > 7] -= 16
    return signed[:count]
