"""Rotary position embedding helpers and the KeyCacheRotaryShift reference (spec/KeyCacheRotaryShift.md)."""

import numpy as np

from .dtypes import CACHE_TYPE_FOR_QUANT_BIT, T1_TYPES, dtype_name
from .layout import canonical_view
from .quantize import dequantize, quantize
from .validate import Attributes, check_attributes, check_tensors, check_writable, effective_scale, fail


def rotary_shift_tables(deltas, rotary_dim: int, theta: float = 10000.0) -> tuple:
    """(cos, sin), float32 ``(N, rotary_dim / 2)``, for rotating by ``deltas`` positions (plain RoPE)."""
    j = np.arange(rotary_dim // 2, dtype=np.float64)
    inv_freq = theta ** (-2.0 * j / rotary_dim)
    angle = np.asarray(deltas, np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def _pairs(rotary_dim: int, interleaved: bool) -> tuple:
    j = np.arange(rotary_dim // 2)
    return (2 * j, 2 * j + 1) if interleaved else (j, j + rotary_dim // 2)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_dim: int, interleaved: bool) -> np.ndarray:
    """The spec's rotation of float32 rows ``x[..., N, Dh]`` by per-row tables ``(N, R/2)``."""
    a, b = _pairs(rotary_dim, interleaved)
    y = np.array(x, np.float32, copy=True)
    xa, xb = x[..., a], x[..., b]
    y[..., a] = xa * cos - xb * sin
    y[..., b] = xa * sin + xb * cos
    return y


def apply_rope(x: np.ndarray, positions, rotary_dim: int = 0, theta: float = 10000.0, interleaved=False):
    """RoPE of ``x[tokens, H, Dh]`` at ``positions`` (what a model applies to keys before caching)."""
    rotary_dim = rotary_dim or x.shape[-1]
    cos, sin = rotary_shift_tables(positions, rotary_dim, theta)
    rotated = rotate(np.asarray(x, np.float32).transpose(1, 0, 2), cos, sin, rotary_dim, interleaved)
    return rotated.transpose(1, 0, 2).astype(x.dtype)


def check_rotary_dim(rotary_dim: int, head_dim: int) -> None:
    """``KeyValueCacheError`` unless ``rotary_dim`` (0: the whole head) names an even number of dims in [2, Dh]."""
    rotary = rotary_dim or head_dim
    if rotary % 2 or rotary < 2 or rotary > head_dim:
        if not rotary_dim:  # the default rotates the whole head, which cannot be split in pairs
            fail(f"rotary_dim = 0 rotates the whole head, R = Dh = {head_dim}, which must be even and >= 2")
        fail(f"rotary_dim must be 0 or even in [2, Dh={head_dim}], got {rotary_dim}")


def _check(cache, scale, slots, cos, sin, a: Attributes, rotary_dim: int) -> tuple:
    t1 = T1_TYPES[0] if a.quant_bit else cache.dtype  # a float cache is its own T1
    if not a.quant_bit and cache.dtype not in T1_TYPES:
        fail(f"cache dtype must be float32, float16 or bfloat16 when quant_bit is 0, got {dtype_name(cache.dtype)}")
    if cache.ndim != 5:
        fail(f"cache must have rank 5, got shape {cache.shape}")
    heads, head_dim = cache.shape[3] if a.cache_layout < 3 else cache.shape[2], cache.shape[4]
    if heads < 1 or head_dim < 1:
        fail(f"cache must have H >= 1 and Dh >= 1, got shape {cache.shape}")
    dummy = np.zeros((0, heads, head_dim), t1)
    _, _, max_t = check_tensors(dummy, dummy, cache, scale, a)
    check_rotary_dim(rotary_dim, head_dim)
    rotary = rotary_dim or head_dim
    slots = np.asarray(slots)
    if slots.dtype != np.int64 or slots.ndim != 1:
        fail(f"slots must be a 1-D int64 tensor, got {dtype_name(slots.dtype)}{slots.shape}")
    for name, table in (("cos", cos), ("sin", sin)):
        table = np.asarray(table)
        if table.dtype != np.float32 or table.shape != (slots.shape[0], rotary // 2):
            fail(f"{name} must be float32 of shape ({slots.shape[0]}, {rotary // 2}), "
                 f"got {dtype_name(table.dtype)}{table.shape}")
    for i, slot in enumerate(slots.tolist()):
        if not 0 <= slot < max_t:
            fail(f"slots[{i}] = {slot} must be in [0, MaxT={max_t})")
    unique, counts = np.unique(slots, return_counts=True)
    if (counts > 1).any():
        fail(f"slots: slot {int(unique[counts > 1][0])} appears more than once")
    return slots, rotary


def key_cache_rotary_shift(cache, scale, slots, cos, sin, *, num_layer=1, layer_idx=0, cache_layout=0, quant_bit=0,
                           quant_group=8, rotary_dim=0, rotary_interleaved=0):
    """Rotates the keys of ``slots`` in place; returns ``slots``. Validates everything first: on a
    ``KeyValueCacheError`` the cache and scale are byte-for-byte unchanged."""
    a = Attributes(num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit, quant_group=quant_group,
                   cache_layout=cache_layout)
    check_attributes(a)
    scale = effective_scale(scale, quant_bit)
    if rotary_interleaved not in (0, 1):
        fail(f"rotary_interleaved must be 0 or 1, got {rotary_interleaved}")
    # Read once: slots, cos and sin may share memory with the cache (spec: index inputs are read once).
    slots, cos, sin = (np.array(x, copy=True) for x in (slots, cos, sin))
    if quant_bit and cache.dtype != CACHE_TYPE_FOR_QUANT_BIT[quant_bit]:
        fail(f"cache dtype must be {dtype_name(CACHE_TYPE_FOR_QUANT_BIT[quant_bit])} for quant_bit={quant_bit}, "
             f"got {dtype_name(cache.dtype)}")
    slots, rotary = _check(cache, scale, slots, cos, sin, a, rotary_dim)
    check_writable(cache=cache, scale=scale)
    keys = canonical_view(cache, cache_layout)[layer_idx, 0]  # (H, MaxT, Dh)
    rows = keys[:, slots, :]
    if quant_bit:
        key_scale = canonical_view(scale, cache_layout)[layer_idx, 0]
        x = dequantize(rows, key_scale[:, slots, :], quant_group, np.float32)
        codes, new_scale = quantize(rotate(x, cos, sin, rotary, bool(rotary_interleaved)), quant_bit, quant_group,
                                    scale.dtype)
        keys[:, slots, :] = codes.astype(cache.dtype)
        key_scale[:, slots, :] = new_scale
    else:
        keys[:, slots, :] = rotate(rows.astype(np.float32), cos, sin, rotary, bool(rotary_interleaved)).astype(cache.dtype)
    return slots.copy()
