"""Caches as torch holds them: allocation in any layout, and int4 codes to and from torch's packed form."""

from __future__ import annotations

import torch

from ..reference.layout import cache_shape

QUANT_DTYPES = {8: torch.int8, 4: torch.uint8}  # int4: packed pairs in uint8


def new_cache(*, num_layer: int, max_tokens: int, heads: int, head_dim: int, dtype=torch.float16, quant_bit: int = 0,
              quant_group: int = 8, scale_dtype=torch.float32, cache_layout: int = 0, device="cpu"):
    """A zeroed ``(cache, scale)`` pair for KeyValueCache with these attributes (``scale`` is ``None``
    without quantization). ``dtype`` is T1, the cache's dtype when unquantized; an int4 cache is
    ``uint8`` with the last axis ``head_dim / 2`` (ONNX INT4 packing)."""
    if quant_bit not in (0, *QUANT_DTYPES):
        raise ValueError(f"quant_bit must be 0, 4 or 8, got {quant_bit}")
    if cache_layout not in (0, 1, 2, 3):
        raise ValueError(f"cache_layout must be 0, 1, 2 or 3, got {cache_layout}")
    if quant_bit and quant_group < 1:
        raise ValueError(f"quant_group must be >= 1, got {quant_group}")
    shape = list(cache_shape(cache_layout, num_layer, max_tokens, heads, head_dim))
    if quant_bit == 0:
        return torch.zeros(shape, dtype=dtype, device=device), None
    if head_dim % quant_group or (quant_bit == 4 and head_dim % 2):
        raise ValueError(f"head_dim={head_dim} must be a multiple of quant_group={quant_group} (and even for int4)")
    scale = torch.zeros(cache_shape(cache_layout, num_layer, max_tokens, heads, head_dim // quant_group),
                        dtype=scale_dtype, device=device)
    if quant_bit == 4:
        shape[-1] //= 2
    return torch.zeros(shape, dtype=QUANT_DTYPES[quant_bit], device=device), scale


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes (an integer tensor, values in [-8, 7], even last dim) to torch's packed form: ``uint8``
    with the last dim halved, element ``2i`` in the low nibble of byte ``i`` (ONNX INT4)."""
    if codes.dtype.is_floating_point or codes.dtype == torch.bool or codes.dtype.is_complex:
        raise TypeError(f"int4 codes must be an integer tensor, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"int4 codes need an even last dim, got shape {tuple(codes.shape)}")
    if codes.numel() and (int(codes.min()) < -8 or int(codes.max()) > 7):
        raise ValueError(f"int4 codes must lie in [-8, 7], got [{int(codes.min())}, {int(codes.max())}]")
    nibbles = (codes.to(torch.int16) & 0xF).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """torch's packed int4 form (``uint8``) to ``int8`` codes in [-8, 7], the last dim doubled."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed int4 must be a torch.uint8 tensor, got {packed.dtype}")
    signed = packed.view(torch.int8)
    low = (signed << 4) >> 4  # arithmetic shifts sign-extend each nibble
    high = signed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)
