"""The ONNX OpSchema of opmx.dynamic_batching::MultiHeadAttention, version 1, with shape inference, and a
single-node model helper."""

import numpy as np
import onnx
from onnx import defs, helper

from .model import DEFAULT_OPSET, IR_VERSION
from .schema import DOMAIN, VERSION, formal_parameter, register_once

OP_TYPE = "MultiHeadAttention"
INPUTS = ("query", "key", "value", "seqstarts", "kvstarts", "decoding_batches", "max_seqlen", "max_kvlen",
          "attn_mask")
OUTPUTS = ("attention_output",)
#: Attributes every node must carry (ppl gives them no default).
REQUIRED_ATTRIBUTES = ("num_heads", "head_dim")
#: Optional attributes and their defaults, ppl's first; ``sliding_window`` and ``softcap`` are this project's
#: extensions.
ATTRIBUTE_DEFAULTS = {"is_causal": 1, "is_alibi": 0, "softmax_scale": 0.0, "num_kv_heads": 0, "sliding_window": 0,
                      "softcap": 0.0}
FLOAT_ATTRIBUTES = ("softmax_scale", "softcap")
#: Written into a node only when not at their default, so a default node is exactly what ppl.pmx exports.
OMITTED_AT_DEFAULT = ("softmax_scale", "sliding_window", "softcap")


def infer_like_query(ctx) -> None:
    """The output: query's (input 0's) type and shape."""
    query = ctx.get_input_type(0)
    if query is not None and query.HasField("tensor_type"):
        ctx.set_output_type(0, query)


def schema_attributes(required: tuple, defaults: dict) -> list:
    """OpSchema attributes: the required INT ones, then the optional ones with their defaults."""
    attributes = [defs.OpSchema.Attribute(name, defs.OpSchema.AttrType.INT, "required", required=True)
                  for name in required]
    return attributes + [defs.OpSchema.Attribute(name, helper.make_attribute(name, default), f"default {default}")
                         for name, default in defaults.items()]


def _build_schema() -> defs.OpSchema:
    attributes = schema_attributes(REQUIRED_ATTRIBUTES, ATTRIBUTE_DEFAULTS)
    schema = defs.OpSchema(
        OP_TYPE, DOMAIN, VERSION,
        "Attention of each sequence of a dynamic batch over its own keys/values, packed as KeyValueCache "
        "outputs them (causal aligned to the end of the keys, decoding sequences unmasked, GQA, optional "
        "additive mask, ALiBi, sliding window). Normative text: spec/MultiHeadAttention.md.",
        inputs=[formal_parameter("query", "T", "(seqstarts[B], num_heads, head_dim)"),
                formal_parameter("key", "T", "(kvstarts[B], num_kv_heads, head_dim)"),
                formal_parameter("value", "T", "(kvstarts[B], num_kv_heads, head_dim)"),
                formal_parameter("seqstarts", "I", "(B+1,)"),
                formal_parameter("kvstarts", "I", "(B+1,)"),
                formal_parameter("decoding_batches", "I", "scalar or (1,): the first sequences, never causal"),
                formal_parameter("max_seqlen", "I", "scalar or (1,)"),
                formal_parameter("max_kvlen", "I", "scalar or (1,)"),
                formal_parameter("attn_mask", "T", "(num_heads, seqstarts[B], >= kvstarts[B]) or "
                                 "(seqstarts[B], >= kvstarts[B]), added to the scores", optional=True)],
        outputs=[formal_parameter("attention_output", "T", "(seqstarts[B], num_heads, head_dim)")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations"),
                          ("I", ["tensor(int64)"], "indices")],
        attributes=attributes,
    )
    schema.set_type_and_shape_inference_function(infer_like_query)
    return schema


def register() -> defs.OpSchema:
    """Register once per process (idempotent) and return the schema."""
    return register_once(OP_TYPE, _build_schema)


def node_attributes(op_type: str, required: tuple, defaults: dict, float_names: tuple, omitted: tuple,
                    attributes: dict) -> dict:
    """A node's attributes: required ones checked present, unknown ones refused (``ValueError``), the defaults
    written as ppl.pmx writes them and the extensions (``omitted``) only when set."""
    unknown = set(attributes) - set(required) - set(defaults)
    if unknown:
        raise ValueError(f"unknown {op_type} attribute(s) {sorted(unknown)}; known: {list(required) + list(defaults)}")
    missing = [name for name in required if name not in attributes]
    if missing:
        raise ValueError(f"{op_type} needs attribute(s) {missing}")
    merged = {**defaults, **attributes}
    node = {}
    for name in tuple(required) + tuple(defaults):
        value = float(merged[name]) if name in float_names else int(merged[name])
        if name in omitted and value == defaults[name]:
            continue
        node[name] = value
    return node


def attention_node_attributes(attributes: dict) -> dict:
    """MultiHeadAttention's node attributes (see :func:`node_attributes`)."""
    return node_attributes(OP_TYPE, REQUIRED_ATTRIBUTES, ATTRIBUTE_DEFAULTS, FLOAT_ATTRIBUTES, OMITTED_AT_DEFAULT,
                           attributes)


def one_node_model(op_type: str, names: tuple, input_names: tuple, output_name: str, inputs: dict, attributes: dict,
                   static: dict) -> onnx.ModelProto:
    """A one-node model of ``op_type`` on the present ``inputs`` (name -> example array; trailing absent optional
    inputs dropped, inner ones left as empty names), ``names``: (the node's, the graph's). Dims are symbolic except
    where ``static`` (input name -> the axes kept from its example; None: all) says; the output is typed and
    shaped like ``query``."""
    node_inputs = [n if inputs.get(n) is not None else "" for n in input_names]
    while node_inputs and not node_inputs[-1]:
        node_inputs.pop()
    node = helper.make_node(op_type, node_inputs, [output_name], name=names[0], domain=DOMAIN, **attributes)
    graph_inputs = []
    for name in filter(None, node_inputs):
        array = np.asarray(inputs[name])
        shape = [f"{name}_d{i}" for i in range(array.ndim)]
        if name in static and (static[name] is None or array.ndim == 3):
            for axis in (range(array.ndim) if static[name] is None else static[name]):
                shape[axis] = array.shape[axis]
        graph_inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), shape))
    query = np.asarray(inputs["query"])
    dims = ["tokens", "num_heads", "head_dim"]
    if query.ndim == 3:
        dims[1:] = list(query.shape[1:])
    output = helper.make_tensor_value_info(output_name, helper.np_dtype_to_tensor_dtype(query.dtype), dims)
    graph = helper.make_graph([node], names[1], graph_inputs, [output])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", DEFAULT_OPSET),
                                                   helper.make_opsetid(DOMAIN, VERSION)],
                             ir_version=IR_VERSION, producer_name="kvcache-op")


def make_attention_model(inputs: dict, **attributes) -> onnx.ModelProto:
    """A single-node MultiHeadAttention model; ``inputs``: name -> example array (``attn_mask`` may be None or
    left out). Dims are symbolic except the heads and head_dim of query, key and value."""
    heads_and_dim = (1, 2)
    return one_node_model(OP_TYPE, ("attention", "multi_head_attention"), INPUTS, OUTPUTS[0], inputs,
                          attention_node_attributes(attributes),
                          {"query": heads_and_dim, "key": heads_and_dim, "value": heads_and_dim})
