"""How an exported decoder stores its KV cache."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """How the exported graph stores its KV cache (KeyValueCache's attributes, cache_mode 1)."""

    page_size: int = 16
    quant_bit: int = 0
    quant_group: int = 8
    cache_layout: int = 1  # each layer's slots together: one stream per layer for the fused attention
    dtype: torch.dtype = torch.float32  # T1: the cache's element type when unquantized, and attention's
    # One MultiHeadCacheAttention node per layer (reading the cache in place), or the split pair KeyValueCache
    # (gathering a packed copy of every sequence's keys) then MultiHeadAttention.
    fused_attention: bool = True

    @property
    def scale_dtype(self) -> torch.dtype:
        """T3 of a quantized cache: the cache dtype where the spec admits it (float32/float16)."""
        return self.dtype if self.dtype in (torch.float32, torch.float16) else torch.float32
