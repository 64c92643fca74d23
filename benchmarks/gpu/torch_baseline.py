"""KeyValueCache written as plain vectorized torch, the baseline of the CUDA benchmark: one
``index_copy_`` per cache half for the stores, one ``index_select`` for the gathers (quant_bit 8:
quantize before the store, dequantize after the gather, with the spec's arithmetic). Finite inputs,
``num_repeat`` 1 and one layer view; slots come from :func:`kvcache_op.validation.call_slots.call_slots`."""

import torch

from ...reference.layout import LAYOUT_AXES

QMAX = 127
SCALE_EPS = 1e-5


def token_rows(tensor: torch.Tensor, cache_layout: int, layer_idx: int, kv: int) -> torch.Tensor:
    """A ``(MaxT, H, last)`` view of one layer's keys (``kv`` 0) or values (1) of a cache or scale tensor
    stored in ``cache_layout``: row ``slot`` is that token's heads; writes go to ``tensor``."""
    axes = LAYOUT_AXES[cache_layout]
    canonical = tensor.permute(*(axes.index(a) for a in ("L", "KV", "MaxT", "H", "Dh")))
    return canonical[layer_idx, kv]


class TorchKeyValueCache:
    """The op on one cache, for fixed slots: ``__call__(current_key, current_value, key, value)`` stores
    every new row, then gathers every output row, like the op (outputs are written, not allocated).

    ``store_slots``/``load_slots``: int64 device tensors (the slot of each row of ``current_*`` and of the
    outputs). ``scale``: the scale tensor when ``quant_bit`` is 8, else None."""

    def __init__(self, cache, scale, store_slots, load_slots, *, cache_layout: int, quant_bit: int = 0,
                 quant_group: int = 8, layer_idx: int = 0):
        if quant_bit not in (0, 8):
            raise ValueError(f"the torch baseline covers quant_bit 0 and 8, got {quant_bit}")
        self.rows = [token_rows(cache, cache_layout, layer_idx, kv) for kv in (0, 1)]
        self.scales = [token_rows(scale, cache_layout, layer_idx, kv) for kv in (0, 1)] if quant_bit else None
        self.store_slots, self.load_slots = store_slots, load_slots
        self.quant_group = quant_group

    def __call__(self, current_key, current_value, key, value) -> None:
        for kv, current in enumerate((current_key, current_value)):
            self.store(kv, current)
        for kv, out in enumerate((key, value)):
            self.gather(kv, out)

    def store(self, kv: int, current: torch.Tensor) -> None:
        """cache[slot(row)] = Q(current[row]) for every row of ``current`` (T, H, Dh)."""
        if self.scales is None:
            self.rows[kv].index_copy_(0, self.store_slots, current)
            return
        tokens, heads, head_dim = current.shape
        groups = current.view(tokens, heads, head_dim // self.quant_group, self.quant_group)
        # fp32 arithmetic; the scale is rounded to its stored type first and that value quantizes (spec)
        scale = (groups.abs().amax(-1).float() / QMAX).clamp_min_(SCALE_EPS).to(self.scales[kv].dtype)
        codes = torch.div(groups, scale.float().unsqueeze(-1)).round_().clamp_(-QMAX, QMAX).to(torch.int8)
        self.rows[kv].index_copy_(0, self.store_slots, codes.view(tokens, heads, head_dim))
        self.scales[kv].index_copy_(0, self.store_slots, scale)

    def gather(self, kv: int, out: torch.Tensor) -> None:
        """out[row] = DQ(cache[slot(row)]) for every row of ``out`` (kv_tokens, H, Dh)."""
        if self.scales is None:
            torch.index_select(self.rows[kv], 0, self.load_slots, out=out)
            return
        tokens, heads, head_dim = out.shape
        codes = self.rows[kv].index_select(0, self.load_slots)
        scale = self.scales[kv].index_select(0, self.load_slots).float().unsqueeze(-1)
        # int8 * fp32 computes in fp32 and rounds once into out's type: float32(q) * float32(scale), cast
        torch.mul(codes.view(tokens, heads, head_dim // self.quant_group, self.quant_group), scale,
                  out=out.view(tokens, heads, head_dim // self.quant_group, self.quant_group))
