"""How the ops become ``opmx.dynamic_batching`` nodes under ``torch.onnx.export``, with either exporter.

* **dynamo** (``dynamo=True``, torch.export based): during export the public functions emit the node
  directly with ``torch.onnx.ops.symbolic_multi_out``. Tracing the mutating custom op instead would go
  through ``auto_functionalized_v2``, which the ONNX exporter cannot translate; the symbolic node is a
  plain op whose inputs are the caller's ``cache``/``scale``, so the graph keeps feeding them straight
  from graph inputs (no copy, nothing folded) and the runtime writes them in place.
* **TorchScript** (``dynamo=False``): the custom op is traced (it runs once on the example inputs) and
  its registered symbolic turns it into the node.

Either way one call is one node, the schema's input order and attributes, ``max_seqlen``/``max_kvlen``
as given (tensors stay graph inputs). int4 caches are ``uint8`` tensors in torch, so the exported
graph's cache input is ``uint8``: :func:`int4_cache_inputs` retypes it to INT4 for ONNX Runtime.
"""

from __future__ import annotations

import collections

import onnx
import torch
from torch.onnx import symbolic_helper

from ..reference.mha_validate import AttentionAttributes, check_attention_attributes
from ..reference.rotary import check_rotary_dim
from ..reference.validate import Attributes, KeyValueCacheError, check_attributes
from ..spec import mha_schema, mhca_schema, rotary_schema, schema
from . import custom_ops

KV_NODE = f"{schema.DOMAIN}::{schema.OP_TYPE}"
ROTARY_NODE = f"{schema.DOMAIN}::{rotary_schema.OP_TYPE}"
ATTENTION_NODE = f"{schema.DOMAIN}::{mha_schema.OP_TYPE}"
CACHE_ATTENTION_NODE = f"{schema.DOMAIN}::{mhca_schema.OP_TYPE}"
#: The TorchScript exporter picks the highest registered opset <= the export's: 7 covers all it supports.
TORCHSCRIPT_MIN_OPSET = 7


def exporting_with_dynamo() -> bool:
    """True inside ``torch.onnx.export(..., dynamo=True)`` (the TorchScript exporter traces with jit)."""
    return torch.onnx.is_in_onnx_export() and not torch.jit.is_tracing()


_CALLS = []  # (trace, op type) of each call made while torch.onnx.export traces
_ERRORS = []  # invalid calls found while it traced (it retries other ways, burying the first error)


def record_call(op_type: str, tensor: torch.Tensor) -> None:
    """Notes a call made during export, keyed by the trace (a dynamo export's fake-tensor mode; a retried
    export traces again under a new one), so :func:`calls_of_last_trace` can be compared with the graph."""
    _CALLS.append((id(getattr(tensor, "fake_mode", None)), op_type))


def start_recording() -> None:
    _CALLS.clear()
    _ERRORS.clear()


def first_error() -> Exception | None:
    """The first invalid call found since :func:`start_recording`."""
    return _ERRORS[0] if _ERRORS else None


def calls_of_last_trace() -> collections.Counter:
    """op type -> calls made in the last trace since :func:`start_recording`."""
    if not _CALLS:
        return collections.Counter()
    last = _CALLS[-1][0]
    return collections.Counter(op for trace, op in _CALLS if trace == last)


def check_exported_call(attributes: dict, scale) -> None:
    """What the dynamo path can check without data (nothing runs while it traces): attribute values and
    whether a scale is given, with the reference's messages."""
    try:
        check_attributes(Attributes(**{k: v for k, v in attributes.items() if k in Attributes.__dataclass_fields__}))
        if attributes.get("rotary_interleaved", 0) not in (0, 1):
            raise KeyValueCacheError(f"rotary_interleaved must be 0 or 1, got {attributes['rotary_interleaved']}")
        quant_bit = attributes["quant_bit"]
        if quant_bit and scale is None:
            raise KeyValueCacheError(f"scale is required when quant_bit is {quant_bit}")
        if not quant_bit and scale is not None:
            raise KeyValueCacheError("scale must be absent when quant_bit is 0")
    except KeyValueCacheError as error:
        _ERRORS.append(error)
        raise


def check_exported_rotary(attributes: dict, scale, cache) -> None:
    """The dynamo path's check of KeyCacheRotaryShift's attributes: :func:`check_exported_call`'s, then
    ``rotary_dim`` against the head size the cache's traced shape gives (a packed int4 cache holds two per byte)."""
    check_exported_call(attributes, scale)
    head_dim = cache.shape[-1] * (2 if attributes["quant_bit"] == 4 else 1) if cache.dim() else 0
    if isinstance(head_dim, int):  # a symbolic head size is checked where the node runs
        try:
            check_rotary_dim(attributes["rotary_dim"], head_dim)
        except KeyValueCacheError as error:
            _ERRORS.append(error)
            raise


def check_exported_attention(attributes: dict) -> None:
    """The dynamo path's check of MultiHeadAttention's attribute values (the reference's messages)."""
    try:
        check_attention_attributes(AttentionAttributes(**attributes))
    except KeyValueCacheError as error:
        _ERRORS.append(error)
        raise


def check_exported_cache_attention(attributes: dict, scale) -> None:
    """The dynamo path's check of MultiHeadCacheAttention's attribute values (the cache's, then the attention's,
    as the reference orders them) and of whether a scale is given."""
    check_exported_call({k: v for k, v in attributes.items() if k in Attributes.__dataclass_fields__}, scale)
    check_exported_attention({k: v for k, v in attributes.items() if k in AttentionAttributes.__dataclass_fields__})


def cache_attention_node(inputs: list, attributes: dict) -> torch.Tensor:
    """The MultiHeadCacheAttention node for the dynamo exporter; ``inputs`` in schema order (``scale`` and
    ``attn_mask`` may be None: a trailing absent one is dropped, an absent scale before a mask is an empty
    input)."""
    query = inputs[0]
    if inputs[12] is None:
        inputs = inputs[:12] if inputs[11] is not None else inputs[:11]
    return torch.onnx.ops.symbolic(CACHE_ATTENTION_NODE, inputs,
                                   mhca_schema.cache_attention_node_attributes(attributes), dtype=query.dtype,
                                   shape=list(query.shape), version=schema.VERSION)


def attention_node(inputs: list, attributes: dict) -> torch.Tensor:
    """The MultiHeadAttention node for the dynamo exporter; ``inputs`` in schema order (``attn_mask`` may
    be None). Attributes as ppl.pmx writes them: the extensions only when set."""
    query = inputs[0]
    if inputs[8] is None:
        inputs = inputs[:8]
    return torch.onnx.ops.symbolic(ATTENTION_NODE, inputs, mha_schema.attention_node_attributes(attributes),
                                   dtype=query.dtype, shape=list(query.shape), version=schema.VERSION)


def key_value_cache_node(inputs: list, attributes: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The KeyValueCache node for the dynamo exporter; ``inputs`` in schema order (``scale`` may be None)."""
    current_key, kvstarts = inputs[0], inputs[3]
    kv_tokens = kvstarts[-1].item()  # a data-dependent output length
    torch._check(kv_tokens >= 0)
    shape = [kv_tokens, current_key.shape[1] * attributes["num_repeat"], current_key.shape[2]]
    if inputs[9] is None:
        inputs = inputs[:9]
    key, value = torch.onnx.ops.symbolic_multi_out(KV_NODE, inputs, attributes, dtypes=[current_key.dtype] * 2,
                                                   shapes=[shape, shape], version=schema.VERSION)
    return key, value


def rotary_shift_node(inputs: list, attributes: dict) -> torch.Tensor:
    """The KeyCacheRotaryShift node for the dynamo exporter; ``inputs``: cache, scale (or None), slots,
    cos, sin."""
    slots = inputs[2]
    return torch.onnx.ops.symbolic(ROTARY_NODE, inputs, attributes, dtype=torch.int64, shape=list(slots.shape),
                                   version=schema.VERSION)


def _present(value) -> list:
    return [] if value is None or value.node().mustBeNone() else [value]


@symbolic_helper.parse_args(*"vvvvvvvvvv", *"iiiiiiii")
def _key_value_cache_symbolic(g, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                              max_seqlen, max_kvlen, cache, scale, num_layer, layer_idx, quant_bit, quant_group,
                              num_repeat, cache_mode, cache_layout, page_size):
    key, value = g.op(KV_NODE, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                      max_kvlen, cache, *_present(scale), num_layer_i=num_layer, layer_idx_i=layer_idx,
                      quant_bit_i=quant_bit, quant_group_i=quant_group, num_repeat_i=num_repeat,
                      cache_mode_i=cache_mode, cache_layout_i=cache_layout, page_size_i=page_size, outputs=2)
    # The exporter's shape inference knows nothing of custom ops: (kv_tokens, H * num_repeat, Dh), T1.
    sizes = current_key.type().varyingSizes() if current_key.isCompleteTensor() or current_key.type().dim() else None
    if sizes is not None and len(sizes) == 3:
        heads = sizes[1] * num_repeat if sizes[1] is not None else None
        for output in (key, value):
            output.setType(current_key.type().with_sizes([None, heads, sizes[2]]))
    return key, value


@symbolic_helper.parse_args(*"vvvvv", *"iiiiiii")
def _rotary_shift_symbolic(g, cache, scale, slots, cos, sin, num_layer, layer_idx, cache_layout, quant_bit,
                           quant_group, rotary_dim, rotary_interleaved):
    # An absent scale stays the None value: the exporter writes it as the empty input name "".
    slots_out = g.op(ROTARY_NODE, cache, scale, slots, cos, sin, num_layer_i=num_layer, layer_idx_i=layer_idx,
                     cache_layout_i=cache_layout, quant_bit_i=quant_bit, quant_group_i=quant_group,
                     rotary_dim_i=rotary_dim, rotary_interleaved_i=rotary_interleaved)
    slots_out.setType(slots.type())  # int64, the shape of slots
    return slots_out


@symbolic_helper.parse_args(*"vvvvvvvvv", *"iiiiiiff")
def _attention_symbolic(g, query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen, attn_mask,
                        num_heads, head_dim, is_causal, is_alibi, num_kv_heads, sliding_window, softmax_scale, softcap):
    attributes = mha_schema.attention_node_attributes(dict(
        num_heads=num_heads, head_dim=head_dim, is_causal=is_causal, is_alibi=is_alibi, num_kv_heads=num_kv_heads,
        sliding_window=sliding_window, softmax_scale=softmax_scale, softcap=softcap))
    typed = {f"{name}_{'f' if isinstance(value, float) else 'i'}": value for name, value in attributes.items()}
    output = g.op(ATTENTION_NODE, query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                  *_present(attn_mask), **typed)
    output.setType(query.type())  # query's type and shape
    return output


@symbolic_helper.parse_args(*"vvvvvvvvvvvvv", *"iiiiiiiiiiiiiff")
def _cache_attention_symbolic(g, query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                              decoding_batches, max_seqlen, max_kvlen, cache, scale, attn_mask, num_layer, layer_idx,
                              quant_bit, quant_group, cache_mode, cache_layout, page_size, num_heads, head_dim,
                              is_causal, is_alibi, num_kv_heads, sliding_window, softmax_scale, softcap):
    attributes = mhca_schema.cache_attention_node_attributes(dict(
        num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit, quant_group=quant_group, cache_mode=cache_mode,
        cache_layout=cache_layout, page_size=page_size, num_heads=num_heads, head_dim=head_dim, is_causal=is_causal,
        is_alibi=is_alibi, num_kv_heads=num_kv_heads, sliding_window=sliding_window, softmax_scale=softmax_scale,
        softcap=softcap))
    typed = {f"{name}_{'f' if isinstance(value, float) else 'i'}": value for name, value in attributes.items()}
    # An absent scale before a mask stays the None value (the exporter writes the empty input name ""); trailing
    # absent inputs are left out.
    optional = [scale, attn_mask] if _present(attn_mask) else _present(scale)
    output = g.op(CACHE_ATTENTION_NODE, query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                  decoding_batches, max_seqlen, max_kvlen, cache, *optional, **typed)
    output.setType(query.type())  # query's type and shape
    return output


def register_torchscript_symbolics() -> None:
    """Registers the TorchScript exporter's translations of the custom ops (idempotent)."""
    for op, fn in ((f"{custom_ops.NAMESPACE}::key_value_cache", _key_value_cache_symbolic),
                   (f"{custom_ops.NAMESPACE}::key_cache_rotary_shift", _rotary_shift_symbolic),
                   (f"{custom_ops.NAMESPACE}::multi_head_attention", _attention_symbolic),
                   (f"{custom_ops.NAMESPACE}::multi_head_cache_attention", _cache_attention_symbolic)):
        torch.onnx.register_custom_op_symbolic(op, fn, TORCHSCRIPT_MIN_OPSET)


IN_PLACE = {schema.OP_TYPE: (8, 9), rotary_schema.OP_TYPE: (0, 1), mhca_schema.OP_TYPE: (10, 11)}


def _quant_bit(node) -> int:
    return next((a.i for a in node.attribute if a.name == "quant_bit"), 0)


def int4_cache_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Retypes, in place, every graph input that feeds an op's int4 cache (``quant_bit=4``) from torch's
    packed ``uint8`` form ``(..., Dh/2)`` to ONNX INT4 ``(..., Dh)`` — the same bytes, so a buffer bound
    to it needs no conversion. Returns ``model``. ``ValueError`` when such a cache is not a graph input."""
    inputs = {value.name: value for value in model.graph.input}
    for node in model.graph.node:
        if node.domain != schema.DOMAIN or node.op_type not in IN_PLACE or _quant_bit(node) != 4:
            continue
        name = node.input[IN_PLACE[node.op_type][0]]
        if name not in inputs:
            raise ValueError(f"{node.op_type} node {node.name!r}: int4 cache {name!r} is not a graph input")
        tensor_type = inputs[name].type.tensor_type
        if tensor_type.elem_type == onnx.TensorProto.INT4:
            continue
        if tensor_type.elem_type != onnx.TensorProto.UINT8:
            raise ValueError(f"{node.op_type} node {node.name!r}: int4 cache {name!r} is "
                             f"{onnx.TensorProto.DataType.Name(tensor_type.elem_type)}, expected torch's packed uint8")
        tensor_type.elem_type = onnx.TensorProto.INT4
        last = tensor_type.shape.dim[-1]
        if last.HasField("dim_value"):
            last.dim_value *= 2
        else:
            last.dim_param = f"2*{last.dim_param}" if last.dim_param else ""
    return model
