"""The ops as torch functions with the reference's signatures: eager on CPU and CUDA tensors through the
library's kernels, traced by ``torch.compile``/``torch.export``, exported as single ONNX nodes."""

from __future__ import annotations

import numpy as np
import torch

from ..reference.mha_validate import MultiHeadAttentionError
from ..reference.validate import KeyValueCacheError
from ..spec import mha_schema, mhca_schema, rotary_schema, schema
from . import custom_ops, onnx_export
from . import tensors as tt

KV_DEFAULTS = schema.ATTRIBUTE_DEFAULTS
ROTARY_DEFAULTS = rotary_schema.ATTRIBUTE_DEFAULTS
INDEX_INPUTS = schema.INPUTS[2:8]
ATTENTION_INT_ATTRIBUTES = ("num_heads", "head_dim", "is_causal", "is_alibi", "num_kv_heads", "sliding_window")
ATTENTION_INDEX_INPUTS = mha_schema.INPUTS[3:8]
SCALAR_INDEX_INPUTS = ("decoding_batches", "max_seqlen", "max_kvlen")  # may be given as ints
CACHE_ATTENTION_INDEX_INPUTS = mhca_schema.INPUTS[3:10]
CACHE_INT_ATTRIBUTES = tuple(k for k in KV_DEFAULTS if k != "num_repeat")


def _attributes(names, given: dict) -> dict:
    """The int attributes ``names`` from ``given`` (Python or numpy ints; bools are refused), range-checked."""
    attrs = {}
    for name in names:
        value = given[name]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"attribute {name} must be an int, got {type(value).__name__}")
        if not -(2**63) <= int(value) < 2**63:
            raise KeyValueCacheError(f"{name} = {int(value)} does not fit in int64")
        attrs[name] = int(value)
    return attrs


def _index_inputs(names, given: dict, device, error=KeyValueCacheError) -> list:
    """The index inputs ``names`` as tensors: each must be a torch.Tensor; the scalar ones may also be ints
    (they become constants in an exported graph: pass tensors to keep them graph inputs)."""
    tensors = []
    for name in names:
        value = given[name]
        if name in SCALAR_INDEX_INPUTS and isinstance(value, (int, np.integer)) \
                and not isinstance(value, (bool, np.bool_)):
            if not -(2**63) <= int(value) < 2**63:
                raise error(f"{name} = {int(value)} does not fit in int64")
            value = torch.tensor(int(value), dtype=torch.int64, device=device)
        elif not isinstance(value, torch.Tensor):
            kind = "a torch.Tensor or an int" if name in SCALAR_INDEX_INPUTS else "a torch.Tensor"
            raise error(f"{name} must be {kind}, got {type(value).__name__}")
        tensors.append(value)
    return tensors


WRITTEN = ("cache", "scale")  # the inputs the ops write in place


def _data_tensors(required: dict, optional: dict, error=KeyValueCacheError) -> None:
    """Each ``required`` data input a torch.Tensor, each ``optional`` one a torch.Tensor or None: the op's own
    error for anything else (None where a tensor is needed reached the kernels as an AttributeError); each a dense
    (strided) one; a written one (cache, scale) one torch lets be written in place (:func:`~.tensors.refuse_unwritable`:
    the kernels check it again, for calls that do not come through here)."""
    for name, value in [*required.items(), *optional.items()]:
        if not isinstance(value, torch.Tensor) and (name in required or value is not None):
            kind = "a torch.Tensor" if name in required else "a torch.Tensor or None"
            raise error(f"{name} must be {kind}, got {type(value).__name__}")
        if value is None or torch.compiler.is_compiling():  # tracing: no memory to check
            continue
        tt.refuse_not_dense(name, value, error)
        if name in WRITTEN:
            tt.refuse_unwritable(name, value, error)


def _no_empty_scale(scale, quant_bit: int):
    """An empty scale with quant_bit 0 is absent (spec: ppl.pmx's placeholder): drop it before anything."""
    if quant_bit == 0 and isinstance(scale, torch.Tensor) and scale.numel() == 0:
        return None
    return scale


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
    _data_tensors(dict(current_key=current_key, current_value=current_value, cache=cache), dict(scale=scale))
    # No packed uint8 cache has an odd Dh: say what is wrong, not its shape.
    if attrs["quant_bit"] == 4 and current_key.dim() == 3 and current_key.shape[-1] % 2:
        raise KeyValueCacheError(f"int4 cache needs an even Dh (whole bytes per row), got Dh={current_key.shape[-1]}")
    index = _index_inputs(INDEX_INPUTS, locals(), current_key.device)
    scale = _no_empty_scale(scale, attrs["quant_bit"])
    inputs = [current_key, current_value, *index, cache, scale]
    if torch.onnx.is_in_onnx_export():
        onnx_export.record_call(schema.OP_TYPE, current_key)
        if onnx_export.exporting_with_dynamo():  # nothing runs: check what can be checked without data
            onnx_export.check_exported_call(attrs, scale)
            return onnx_export.key_value_cache_node(inputs, attrs)
    return custom_ops.key_value_cache_op(*inputs, **attrs)


def key_cache_rotary_shift(cache, scale, slots, cos, sin, *, num_layer=1, layer_idx=0, cache_layout=0, quant_bit=0,
                           quant_group=8, rotary_dim=0, rotary_interleaved=0):
    """KeyCacheRotaryShift (spec/KeyCacheRotaryShift.md) on torch tensors: rotates the keys stored in
    ``slots`` by the per-slot ``cos``/``sin`` tables **in place** (cache, and scale when quantized) and
    returns a copy of ``slots``, bit-identical to :func:`kvcache_op.reference.key_cache_rotary_shift`.
    CPU tensors run the library's C++ kernel, CUDA ones its CUDA kernel on the current stream (slots,
    cos and sin are read on the host: CPU tensors avoid a copy). Invalid calls raise
    :class:`~kvcache_op.reference.KeyValueCacheError` and leave the cache and scale unchanged.
    Under ``torch.onnx.export`` this is one ``opmx.dynamic_batching::KeyCacheRotaryShift`` node; use its
    output (e.g. return it), or the exporter may drop the node as dead code.
    """
    attrs = _attributes(ROTARY_DEFAULTS, locals())
    _data_tensors(dict(cache=cache), dict(scale=scale))
    scale = _no_empty_scale(scale, attrs["quant_bit"])
    inputs = [cache, scale, slots, cos, sin]
    if torch.onnx.is_in_onnx_export():
        onnx_export.record_call(rotary_schema.OP_TYPE, cache)
        if onnx_export.exporting_with_dynamo():
            onnx_export.check_exported_rotary(attrs, scale, cache)
            return onnx_export.rotary_shift_node(inputs, attrs)
    return custom_ops.key_cache_rotary_shift_op(*inputs, **attrs)


def _float_attribute(name: str, value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"attribute {name} must be a float, got {type(value).__name__}")
    return float(value)


def multi_head_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                         attn_mask=None, *, num_heads, head_dim, is_causal=1, is_alibi=0, num_kv_heads=0,
                         sliding_window=0, softmax_scale=0.0, softcap=0.0):
    """MultiHeadAttention (spec/MultiHeadAttention.md) on CPU or CUDA torch tensors (the library's C++ or CUDA
    kernel, CUDA on the current stream; index inputs read on the host): every sequence's queries attend
    over its own keys/values as KeyValueCache packs them; returns a tensor shaped like ``query``, within
    the spec's tolerance of :func:`kvcache_op.reference.multi_head_attention` (the library's CPU kernel,
    the same bits as its ONNX Runtime op). ``decoding_batches``/``max_seqlen``/``max_kvlen`` may be ints;
    ``softcap`` > 0 caps the scaled scores as ``softcap * tanh(s / softcap)`` (Gemma 2). Invalid calls raise :class:`~kvcache_op.reference.MultiHeadAttentionError`. Under
    ``torch.onnx.export`` this is one ``opmx.dynamic_batching::MultiHeadAttention`` node."""
    attrs = _attributes(ATTENTION_INT_ATTRIBUTES, locals())
    attrs["softmax_scale"] = _float_attribute("softmax_scale", softmax_scale)
    attrs["softcap"] = _float_attribute("softcap", softcap)
    _data_tensors(dict(query=query, key=key, value=value), dict(attn_mask=attn_mask), MultiHeadAttentionError)
    index = _index_inputs(ATTENTION_INDEX_INPUTS, locals(), query.device, MultiHeadAttentionError)
    inputs = [query, key, value, *index, attn_mask]
    if torch.onnx.is_in_onnx_export():
        onnx_export.record_call(mha_schema.OP_TYPE, query)
        if onnx_export.exporting_with_dynamo():
            onnx_export.check_exported_attention(attrs)
            return onnx_export.attention_node(inputs, attrs)
    return custom_ops.multi_head_attention_op(*inputs, **attrs)


def multi_head_cache_attention(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                               decoding_batches, max_seqlen, max_kvlen, cache, scale=None, attn_mask=None, *,
                               num_heads, head_dim, num_kv_heads=0, is_causal=1, is_alibi=0, softmax_scale=0.0,
                               sliding_window=0, softcap=0.0, num_layer=1, layer_idx=0, quant_bit=0, quant_group=8,
                               cache_mode=0, cache_layout=0, page_size=128):
    """MultiHeadCacheAttention (spec/MultiHeadCacheAttention.md) on CPU or CUDA torch tensors (as
    :func:`multi_head_attention`): stores this step's keys and
    values into ``cache`` (and ``scale``) **in place**, as :func:`key_value_cache` does, and attends every
    sequence's queries over its cached keys, reading them in place (the library's kernel); returns a tensor shaped
    like ``query``: the cache bit-identical to :func:`kvcache_op.reference.multi_head_cache_attention`'s, the
    output within the spec's tolerance of it. ``decoding_batches``/``max_seqlen``/``max_kvlen`` may be ints.
    Invalid calls raise :class:`~kvcache_op.reference.KeyValueCacheError` (its subclass
    :class:`~kvcache_op.reference.MultiHeadAttentionError` for the attention's rules, in the reference) and write
    nothing. Under ``torch.onnx.export`` this is one ``opmx.dynamic_batching::MultiHeadCacheAttention`` node."""
    given = locals()
    attrs = {**_attributes(CACHE_INT_ATTRIBUTES, given), **_attributes(ATTENTION_INT_ATTRIBUTES, given),
             "softmax_scale": _float_attribute("softmax_scale", softmax_scale),
             "softcap": _float_attribute("softcap", softcap)}
    _data_tensors(dict(query=query, current_key=current_key, current_value=current_value, cache=cache),
                  dict(scale=scale, attn_mask=attn_mask))
    index = _index_inputs(CACHE_ATTENTION_INDEX_INPUTS, given, query.device)
    scale = _no_empty_scale(scale, attrs["quant_bit"])
    inputs = [query, current_key, current_value, *index, cache, scale, attn_mask]
    if torch.onnx.is_in_onnx_export():
        onnx_export.record_call(mhca_schema.OP_TYPE, query)
        if onnx_export.exporting_with_dynamo():
            onnx_export.check_exported_cache_attention(attrs, scale)
            return onnx_export.cache_attention_node(inputs, attrs)
    return custom_ops.multi_head_cache_attention_op(*inputs, **attrs)
