"""The ONNX OpSchema of opmx.dynamic_batching::MultiHeadCacheAttention, version 1 (KeyValueCache then
MultiHeadAttention in one node, ppl.pmx's fused export), with shape inference, and a single-node model helper."""

import onnx
from onnx import defs

from . import mha_schema, schema
from .schema import DOMAIN, VERSION, formal_parameter, register_once

OP_TYPE = "MultiHeadCacheAttention"
INPUTS = ("query", "current_key", "current_value", "seqstarts", "kvstarts", "cachestarts", "start_pos",
          "decoding_batches", "max_seqlen", "max_kvlen", "cache", "scale", "attn_mask")
OUTPUTS = ("output",)
REQUIRED_ATTRIBUTES = mha_schema.REQUIRED_ATTRIBUTES
#: Optional attributes and their defaults: the attention's, then the cache's (no num_repeat).
ATTRIBUTE_DEFAULTS = {**mha_schema.ATTRIBUTE_DEFAULTS,
                      **{k: v for k, v in schema.ATTRIBUTE_DEFAULTS.items() if k != "num_repeat"}}
FLOAT_ATTRIBUTES = mha_schema.FLOAT_ATTRIBUTES
#: This project's extensions, written into a node only when set.
OMITTED_AT_DEFAULT = mha_schema.OMITTED_AT_DEFAULT


def _build_schema() -> defs.OpSchema:
    attributes = mha_schema.schema_attributes(REQUIRED_ATTRIBUTES, ATTRIBUTE_DEFAULTS)
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
    op.set_type_and_shape_inference_function(mha_schema.infer_like_query)
    return op


def register() -> defs.OpSchema:
    """Register once per process (idempotent) and return the schema."""
    return register_once(OP_TYPE, _build_schema)


def cache_attention_node_attributes(attributes: dict) -> dict:
    """The node's attributes (see :func:`~kvcache_op.spec.mha_schema.node_attributes`)."""
    return mha_schema.node_attributes(OP_TYPE, REQUIRED_ATTRIBUTES, ATTRIBUTE_DEFAULTS, FLOAT_ATTRIBUTES,
                                      OMITTED_AT_DEFAULT, attributes)


def make_cache_attention_model(inputs: dict, **attributes) -> onnx.ModelProto:
    """A single-node MultiHeadCacheAttention model; ``inputs``: name -> example array (``scale`` and
    ``attn_mask`` may be None or left out; an absent scale before a mask is an empty input name). Dims are
    symbolic except the heads and head_dim of query and the current key/value, and the cache's and scale's."""
    heads_and_dim = (1, 2)
    return mha_schema.one_node_model(OP_TYPE, ("cache_attention", "multi_head_cache_attention"), INPUTS, OUTPUTS[0],
                                     inputs, cache_attention_node_attributes(attributes),
                                     {"query": heads_and_dim, "current_key": heads_and_dim,
                                      "current_value": heads_and_dim, "cache": None, "scale": None})
