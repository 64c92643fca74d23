"""The ONNX OpSchema of opmx.dynamic_batching::MultiHeadCacheAttention, version 1 (KeyValueCache then
MultiHeadAttention in one node, ppl.pmx's fused export), with shape inference, and a single-node model helper."""

import numpy as np
import onnx
from onnx import defs, helper

from . import mha_schema, schema
from .model import DEFAULT_OPSET, IR_VERSION
from .schema import DOMAIN, VERSION, formal_parameter, register_once

OP_TYPE = "MultiHeadCacheAttention"
INPUTS = ("query", "current_key", "current_value", "seqstarts", "kvstarts", "cachestarts", "start_pos",
          "decoding_batches", "max_seqlen", "max_kvlen", "cache", "scale", "attn_mask")
OUTPUTS = ("output",)
REQUIRED_ATTRIBUTES = mha_schema.REQUIRED_ATTRIBUTES
#: Optional attributes and their defaults: the attention's, the cache's (no num_repeat), then ``softcap``.
ATTRIBUTE_DEFAULTS = {**mha_schema.ATTRIBUTE_DEFAULTS,
                      **{k: v for k, v in schema.ATTRIBUTE_DEFAULTS.items() if k != "num_repeat"}, "softcap": 0.0}
FLOAT_ATTRIBUTES = ("softmax_scale", "softcap")
#: This project's extensions, written into a node only when set.
OMITTED_AT_DEFAULT = mha_schema.OMITTED_AT_DEFAULT + ("softcap",)


def _infer(ctx) -> None:
    """output: query's type and shape."""
    query = ctx.get_input_type(0)
    if query is not None and query.HasField("tensor_type"):
        ctx.set_output_type(0, query)


def _build_schema() -> defs.OpSchema:
    attributes = [defs.OpSchema.Attribute(name, defs.OpSchema.AttrType.INT, "required", required=True)
                  for name in REQUIRED_ATTRIBUTES]
    attributes += [defs.OpSchema.Attribute(name, helper.make_attribute(name, default), f"default {default}")
                   for name, default in ATTRIBUTE_DEFAULTS.items()]
    op = defs.OpSchema(
        OP_TYPE, DOMAIN, VERSION,
        "KeyValueCache (num_repeat 1) then MultiHeadAttention over the keys and values it gathers, in one node: "
        "the step's keys and values are stored into the cache in place and each sequence's queries attend over "
        "its cached keys. Normative text: spec/MultiHeadCacheAttention.md.",
        inputs=[formal_parameter("query", "T1", "(seqstarts[B], num_heads, head_dim)"),
                formal_parameter("current_key", "T1", "(seqstarts[B], num_kv_heads, head_dim)"),
                formal_parameter("current_value", "T1", "(seqstarts[B], num_kv_heads, head_dim)"),
                formal_parameter("seqstarts", "I", "(B+1,)"),
                formal_parameter("kvstarts", "I", "(B+1,)"),
                formal_parameter("cachestarts", "I", "(B,) in cache_mode 0, (B, MaxP) in cache_mode 1"),
                formal_parameter("start_pos", "I", "(B,)"),
                formal_parameter("decoding_batches", "I", "scalar or (1,): the first sequences, never causal"),
                formal_parameter("max_seqlen", "I", "scalar or (1,)"),
                formal_parameter("max_kvlen", "I", "scalar or (1,)"),
                formal_parameter("cache", "T2", "rank 5, order given by cache_layout; written in place"),
                formal_parameter("scale", "T3", "cache shape with last dim Dh/quant_group; written in place "
                                 "(empty: absent)", optional=True),
                formal_parameter("attn_mask", "T1", "(num_heads, seqstarts[B], >= kvstarts[B]) or "
                                 "(seqstarts[B], >= kvstarts[B]), added to the scores", optional=True)],
        outputs=[formal_parameter("output", "T1", "(seqstarts[B], num_heads, head_dim)")],
        type_constraints=[
            ("T1", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations"),
            ("T2", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(int8)", "tensor(int4)"],
             "cache: T1 when quant_bit is 0, int8 for 8, int4 for 4"),
            ("T3", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "quantization scales"),
            ("I", ["tensor(int64)"], "indices")],
        attributes=attributes,
    )
    op.set_type_and_shape_inference_function(_infer)
    return op


def register() -> defs.OpSchema:
    """Register once per process (idempotent) and return the schema."""
    return register_once(OP_TYPE, _build_schema)


def cache_attention_node_attributes(attributes: dict) -> dict:
    """The node's attributes: required ones checked present, unknown ones refused (``ValueError``), defaults
    written as ppl.pmx writes them and the extensions only when set."""
    unknown = set(attributes) - set(REQUIRED_ATTRIBUTES) - set(ATTRIBUTE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown {OP_TYPE} attribute(s) {sorted(unknown)}; known: "
                         f"{list(REQUIRED_ATTRIBUTES) + list(ATTRIBUTE_DEFAULTS)}")
    missing = [name for name in REQUIRED_ATTRIBUTES if name not in attributes]
    if missing:
        raise ValueError(f"{OP_TYPE} needs attribute(s) {missing}")
    merged = {**ATTRIBUTE_DEFAULTS, **attributes}
    node = {}
    for name in REQUIRED_ATTRIBUTES + tuple(ATTRIBUTE_DEFAULTS):
        value = float(merged[name]) if name in FLOAT_ATTRIBUTES else int(merged[name])
        if name in OMITTED_AT_DEFAULT and value == ATTRIBUTE_DEFAULTS[name]:
            continue
        node[name] = value
    return node


def make_cache_attention_model(inputs: dict, **attributes) -> onnx.ModelProto:
    """A single-node MultiHeadCacheAttention model; ``inputs``: name -> example array (``scale`` and
    ``attn_mask`` may be None or left out; an absent scale before a mask is an empty input name)."""
    node_inputs = [n if inputs.get(n) is not None else "" for n in INPUTS]
    while node_inputs and not node_inputs[-1]:
        node_inputs.pop()
    node = helper.make_node(OP_TYPE, node_inputs, list(OUTPUTS), name="cache_attention", domain=DOMAIN,
                            **cache_attention_node_attributes(attributes))
    graph_inputs = []
    for name in filter(None, node_inputs):
        array = np.asarray(inputs[name])
        shape = [f"{name}_d{i}" for i in range(array.ndim)]
        if name in ("query", "current_key", "current_value") and array.ndim == 3:
            shape[1:] = list(array.shape[1:])
        if name in ("cache", "scale"):
            shape = list(array.shape)
        graph_inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), shape))
    query = np.asarray(inputs["query"])
    dims = ["tokens", "num_heads", "head_dim"]
    if query.ndim == 3:
        dims[1:] = list(query.shape[1:])
    output = helper.make_tensor_value_info(OUTPUTS[0], helper.np_dtype_to_tensor_dtype(query.dtype), dims)
    graph = helper.make_graph([node], "multi_head_cache_attention", graph_inputs, [output])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", DEFAULT_OPSET),
                                                   helper.make_opsetid(DOMAIN, VERSION)],
                             ir_version=IR_VERSION, producer_name="kvcache-op")
