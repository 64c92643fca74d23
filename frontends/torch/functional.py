"""The ops as torch functions with the reference's signatures: eager on CPU and CUDA tensors through the
library's kernels, traced by ``torch.compile``/``torch.export``, exported as single ONNX nodes."""

from __future__ import annotations

import torch

from ..spec import rotary_schema, schema
from . import custom_ops, onnx_export

KV_DEFAULTS = schema.ATTRIBUTE_DEFAULTS
ROTARY_DEFAULTS = rotary_schema.ATTRIBUTE_DEFAULTS


def _attributes(defaults: dict, given: dict) -> dict:
    attrs = {}
    for name, default in defaults.items():
        value = given[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"attribute {name} must be an int, got {type(value).__name__}")
        attrs[name] = value
    return attrs


def _index_tensor(value, device) -> torch.Tensor:
    # An int max_seqlen/max_kvlen becomes a constant tensor; pass a tensor to keep it a graph input.
    return value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.int64, device=device)


def key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                    cache, scale=None, *, num_layer=1, layer_idx=0, quant_bit=0, quant_group=8, num_repeat=1,
                    cache_mode=0, cache_layout=0, page_size=128):
    """KeyValueCache (spec/KeyValueCache.md) on torch tensors: stores this step's keys/values into
    ``cache`` (and ``scale``) **in place** and returns ``(key, value)`` of shape
    ``(kvstarts[B], H * num_repeat, Dh)``, bit-identical to :func:`kvcache_op.reference.key_value_cache`.

    Data tensors on one device (CPU: the library's C++ kernel; CUDA: its CUDA kernel, on the current
    stream). Index inputs are int64 tensors (CPU ones avoid a device-to-host copy) or, for
    ``max_seqlen``/``max_kvlen``, ints. An int4 cache is a ``uint8`` tensor of packed pairs (see
    :mod:`kvcache_op.torch`). Invalid calls raise :class:`~kvcache_op.reference.KeyValueCacheError`
    with the reference's message and leave ``cache``/``scale`` unchanged. Under ``torch.onnx.export``
    this is one ``opmx.dynamic_batching::KeyValueCache`` node.
    """
    attrs = _attributes(KV_DEFAULTS, locals())
    max_seqlen, max_kvlen = (_index_tensor(v, seqstarts.device) for v in (max_seqlen, max_kvlen))
    inputs = [current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen, cache,
              scale]
    if onnx_export.exporting_with_dynamo():
        return onnx_export.key_value_cache_node(inputs, attrs)
    return custom_ops.key_value_cache_op(*inputs, **attrs)


def key_cache_rotary_shift(cache, scale, slots, cos, sin, *, num_layer=1, layer_idx=0, cache_layout=0, quant_bit=0,
                           quant_group=8, rotary_dim=0, rotary_interleaved=0):
    """KeyCacheRotaryShift (spec/KeyCacheRotaryShift.md) on torch tensors: rotates the keys stored in
    ``slots`` by the per-slot ``cos``/``sin`` tables **in place** (cache, and scale when quantized) and
    returns a copy of ``slots``, bit-identical to :func:`kvcache_op.reference.key_cache_rotary_shift`.
    CPU tensors (the library's C++ kernel); CUDA caches raise ``NotImplementedError``. Invalid calls
    raise :class:`~kvcache_op.reference.KeyValueCacheError` and leave the cache and scale unchanged.
    Under ``torch.onnx.export`` this is one ``opmx.dynamic_batching::KeyCacheRotaryShift`` node; use its
    output (e.g. return it), or the exporter may drop the node as dead code.
    """
    attrs = _attributes(ROTARY_DEFAULTS, locals())
    inputs = [cache, scale, slots, cos, sin]
    if onnx_export.exporting_with_dynamo():
        return onnx_export.rotary_shift_node(inputs, attrs)
    return custom_ops.key_cache_rotary_shift_op(*inputs, **attrs)
