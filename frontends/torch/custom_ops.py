"""The ops as torch custom ops (``torch.ops.kvcache_op.*``), so ``torch.compile`` and ``torch.export`` trace
them: eager kernels that run the library's own C++ (CPU tensors) and CUDA (CUDA tensors) kernels through
its C entry points, and fake implementations that give output shapes without touching data.

The eager kernels validate through the library (the reference's checks and messages, raised as
:class:`~kvcache_op.reference.KeyValueCacheError`) before anything is written: on an error the cache and
scale are byte-for-byte unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..capi import c_api
from . import tensors as tt

NAMESPACE = "kvcache_op"


def _launch_context(device: torch.device):
    """(CUDA stream handle, context that makes ``device`` current) for a launch; (0, no-op) on the CPU."""
    if device.type != "cuda":
        return 0, contextlib.nullcontext()
    if not c_api.has_cuda():
        raise RuntimeError("this build of kvcache-op has no CUDA kernels (it was built without nvcc): "
                           "rebuild with KVCACHE_OP_CUDA=1 where nvcc is installed, or run the op on CPU tensors")
    return torch.cuda.current_stream(device).cuda_stream, torch.cuda.device(device)


def _kv_attributes(num_layer, layer_idx, quant_bit, quant_group, num_repeat, cache_mode, cache_layout, page_size):
    return dict(num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit, quant_group=quant_group,
                num_repeat=num_repeat, cache_mode=cache_mode, cache_layout=cache_layout, page_size=page_size)


@torch.library.custom_op(f"{NAMESPACE}::key_value_cache", mutates_args=("cache", "scale"))
def key_value_cache_op(current_key: torch.Tensor, current_value: torch.Tensor, seqstarts: torch.Tensor,
                       kvstarts: torch.Tensor, cachestarts: torch.Tensor, start_pos: torch.Tensor,
                       max_seqlen: torch.Tensor, max_kvlen: torch.Tensor, cache: torch.Tensor,
                       scale: Optional[torch.Tensor], num_layer: int, layer_idx: int, quant_bit: int,
                       quant_group: int, num_repeat: int, cache_mode: int, cache_layout: int,
                       page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KeyValueCache on the tensors' device: writes ``cache``/``scale`` in place, returns ``(key, value)``."""
    attrs = _kv_attributes(num_layer, layer_idx, quant_bit, quant_group, num_repeat, cache_mode, cache_layout,
                           page_size)
    device = tt.data_device(current_key=current_key, current_value=current_value, cache=cache, scale=scale)
    tt.refuse_overlaps(c_api.KV_APART, current_key=current_key, current_value=current_value, cache=cache, scale=scale)
    key_in, value_in = current_key.contiguous(), current_value.contiguous()
    index = [tt.on_host(name, t) for name, t in zip(c_api.KV_INDEX_INPUTS, (
        seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen))]
    inputs = [tt.describe(key_in), tt.describe(value_in), *map(tt.describe, index),
              tt.describe_cache("cache", cache, quant_bit), tt.describe_written("scale", scale)]
    with tt.int4_shapes_explained(quant_bit):
        shape = c_api.output_shape(inputs, **attrs)  # validates the whole call; nothing written yet
    key = torch.empty(shape, dtype=current_key.dtype, device=device)
    value = torch.empty(shape, dtype=current_key.dtype, device=device)
    outputs = [tt.describe(key), tt.describe(value)]
    stream, current_device = _launch_context(device)
    with current_device:
        c_api.run_key_value_cache(inputs, outputs, device=device.type, stream=stream,
                                  num_threads=torch.get_num_threads(), **attrs)
    return key, value


@key_value_cache_op.register_fake
def _key_value_cache_fake(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                          max_kvlen, cache, scale, num_layer, layer_idx, quant_bit, quant_group, num_repeat,
                          cache_mode, cache_layout, page_size):
    # The output length is kvstarts[B], a value: a data-dependent size for the tracer.
    kv_tokens = torch.library.get_ctx().new_dynamic_size()
    shape = (kv_tokens, current_key.shape[1] * num_repeat, current_key.shape[2])
    return current_key.new_empty(shape), current_key.new_empty(shape)


@torch.library.custom_op(f"{NAMESPACE}::key_cache_rotary_shift", mutates_args=("cache", "scale"))
def key_cache_rotary_shift_op(cache: torch.Tensor, scale: Optional[torch.Tensor], slots: torch.Tensor,
                              cos: torch.Tensor, sin: torch.Tensor, num_layer: int, layer_idx: int,
                              cache_layout: int, quant_bit: int, quant_group: int, rotary_dim: int,
                              rotary_interleaved: int) -> torch.Tensor:
    """KeyCacheRotaryShift: rotates the keys of ``slots`` in place; returns a copy of ``slots``."""
    device = tt.data_device(cache=cache, scale=scale)
    attrs = dict(num_layer=num_layer, layer_idx=layer_idx, cache_layout=cache_layout, quant_bit=quant_bit,
                 quant_group=quant_group, rotary_dim=rotary_dim, rotary_interleaved=rotary_interleaved)
    host = [tt.on_host(name, t) for name, t in (("slots", slots), ("cos", cos), ("sin", sin))]
    inputs = [tt.describe_cache("cache", cache, quant_bit), tt.describe_written("scale", scale),
              *map(tt.describe, host)]
    out = torch.empty(host[0].shape if host[0].dim() == 1 else (0,), dtype=torch.int64)
    stream, current_device = _launch_context(device)
    with tt.int4_shapes_explained(quant_bit), current_device:
        c_api.run_key_cache_rotary_shift(inputs, tt.describe(out), device=device.type, stream=stream,
                                         num_threads=torch.get_num_threads(), **attrs)
    return out.to(slots.device)


@key_cache_rotary_shift_op.register_fake
def _key_cache_rotary_shift_fake(cache, scale, slots, cos, sin, num_layer, layer_idx, cache_layout, quant_bit,
                                 quant_group, rotary_dim, rotary_interleaved):
    return slots.new_empty(slots.shape)


@torch.library.custom_op(f"{NAMESPACE}::multi_head_attention", mutates_args=())
def multi_head_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seqstarts: torch.Tensor,
                            kvstarts: torch.Tensor, decoding_batches: torch.Tensor, max_seqlen: torch.Tensor,
                            max_kvlen: torch.Tensor, attn_mask: Optional[torch.Tensor], num_heads: int, head_dim: int,
                            is_causal: int, is_alibi: int, num_kv_heads: int, sliding_window: int,
                            softmax_scale: float, softcap: float) -> torch.Tensor:
    """MultiHeadAttention on the tensors' device (the library's CPU or CUDA kernel); returns a new tensor shaped
    like query."""
    device = tt.data_device(query=query, key=key, value=value, attn_mask=attn_mask)
    attrs = dict(num_heads=num_heads, head_dim=head_dim, is_causal=is_causal, is_alibi=is_alibi,
                 num_kv_heads=num_kv_heads, sliding_window=sliding_window, softmax_scale=softmax_scale,
                 softcap=softcap)
    data = [t.contiguous() for t in (query, key, value)]
    index = [tt.on_host(name, t) for name, t in zip(c_api.MHA_INPUTS[3:8], (
        seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen))]
    mask = None if attn_mask is None else attn_mask.contiguous()
    inputs = [*map(tt.describe, data), *map(tt.describe, index), tt.describe(mask)]
    out = torch.empty(data[0].shape, dtype=query.dtype, device=device)
    stream, current_device = _launch_context(device)
    with current_device:
        c_api.run_multi_head_attention(inputs, tt.describe(out), device=device.type, stream=stream,
                                       num_threads=torch.get_num_threads(), **attrs)
    return out


@multi_head_attention_op.register_fake
def _multi_head_attention_fake(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                               attn_mask, num_heads, head_dim, is_causal, is_alibi, num_kv_heads, sliding_window,
                               softmax_scale, softcap):
    return query.new_empty(query.shape)


@torch.library.custom_op(f"{NAMESPACE}::multi_head_cache_attention", mutates_args=("cache", "scale"))
def multi_head_cache_attention_op(query: torch.Tensor, current_key: torch.Tensor, current_value: torch.Tensor,
                                  seqstarts: torch.Tensor, kvstarts: torch.Tensor, cachestarts: torch.Tensor,
                                  start_pos: torch.Tensor, decoding_batches: torch.Tensor, max_seqlen: torch.Tensor,
                                  max_kvlen: torch.Tensor, cache: torch.Tensor, scale: Optional[torch.Tensor],
                                  attn_mask: Optional[torch.Tensor], num_layer: int, layer_idx: int, quant_bit: int,
                                  quant_group: int, cache_mode: int, cache_layout: int, page_size: int,
                                  num_heads: int, head_dim: int, is_causal: int, is_alibi: int, num_kv_heads: int,
                                  sliding_window: int, softmax_scale: float, softcap: float) -> torch.Tensor:
    """MultiHeadCacheAttention on the tensors' device (the library's CPU or CUDA kernel): writes ``cache``/``scale``
    in place and returns a new tensor shaped like query."""
    device = tt.data_device(query=query, current_key=current_key, current_value=current_value, cache=cache,
                            scale=scale, attn_mask=attn_mask)
    attrs = dict(num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit, quant_group=quant_group,
                 cache_mode=cache_mode, cache_layout=cache_layout, page_size=page_size, num_heads=num_heads,
                 head_dim=head_dim, is_causal=is_causal, is_alibi=is_alibi, num_kv_heads=num_kv_heads,
                 sliding_window=sliding_window, softmax_scale=softmax_scale, softcap=softcap)
    tt.refuse_overlaps(c_api.MHCA_APART, query=query, current_key=current_key, current_value=current_value,
                       cache=cache, scale=scale, attn_mask=attn_mask)
    data = [t.contiguous() for t in (query, current_key, current_value)]
    index = [tt.on_host(name, t) for name, t in zip(c_api.MHCA_INPUTS[3:10], (
        seqstarts, kvstarts, cachestarts, start_pos, decoding_batches, max_seqlen, max_kvlen))]
    mask = None if attn_mask is None else attn_mask.contiguous()
    inputs = [*map(tt.describe, data), *map(tt.describe, index), tt.describe_cache("cache", cache, quant_bit),
              tt.describe_written("scale", scale), tt.describe(mask)]
    out = torch.empty(data[0].shape, dtype=query.dtype, device=device)
    stream, current_device = _launch_context(device)
    with tt.int4_shapes_explained(quant_bit), current_device:
        c_api.run_multi_head_cache_attention(inputs, tt.describe(out), device=device.type, stream=stream,
                                             num_threads=torch.get_num_threads(), **attrs)
    return out


@multi_head_cache_attention_op.register_fake
def _multi_head_cache_attention_fake(query, *args):
    return query.new_empty(query.shape)
