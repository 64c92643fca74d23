"""The ONNX ``OpSchema`` of opmx.dynamic_batching::KeyValueCache, version 1, with shape inference."""

import onnx
from onnx import defs, helper

DOMAIN = "opmx.dynamic_batching"
OP_TYPE = "KeyValueCache"
VERSION = 1

INPUTS = ("current_key", "current_value", "seqstarts", "kvstarts", "cachestarts", "start_pos", "max_seqlen",
          "max_kvlen", "cache", "scale")
OUTPUTS = ("key", "value")
#: attribute name -> default, in the order ppl.pmx exports them.
ATTRIBUTE_DEFAULTS = {"num_layer": 1, "layer_idx": 0, "quant_bit": 0, "quant_group": 8, "num_repeat": 1,
                      "cache_mode": 0, "cache_layout": 0, "page_size": 128}

_DOC = ("Stores this step's keys/values of a dynamic batch into a (paged) KV cache, in place, and gathers "
        "every sequence's keys/values (dequantized, GQA-repeated). Normative text: spec/KeyValueCache.md.")


def formal_parameter(name, type_str, doc, optional=False):
    option = defs.OpSchema.FormalParameterOption.Optional if optional else defs.OpSchema.FormalParameterOption.Single
    return defs.OpSchema.FormalParameter(name, type_str, doc, param_option=option)


def _infer(ctx) -> None:
    """key/value: dtype of current_key; shape (kvstarts[B] if constant, H * num_repeat, Dh)."""
    key_type = ctx.get_input_type(0)
    if key_type is None or not key_type.HasField("tensor_type"):
        return
    elem = key_type.tensor_type.elem_type
    dims = [None, None, None]
    shape = key_type.tensor_type.shape if key_type.tensor_type.HasField("shape") else None
    repeat = ctx.get_attribute("num_repeat")
    repeat = 1 if repeat is None else helper.get_attribute_value(repeat)
    if shape is not None and len(shape.dim) == 3:
        heads, head_dim = shape.dim[1], shape.dim[2]
        if heads.HasField("dim_value") and heads.dim_value * repeat < 2**63:  # else unknown: the op reports it
            dims[1] = heads.dim_value * repeat
        elif repeat == 1 and heads.HasField("dim_param"):
            dims[1] = heads.dim_param
        dims[2] = head_dim.dim_value if head_dim.HasField("dim_value") else (head_dim.dim_param or None)
    kvstarts = ctx.get_input_data(3) if ctx.has_input(3) else None
    if kvstarts is not None:
        values = onnx.numpy_helper.to_array(kvstarts).reshape(-1)
        if values.size and values[-1] >= 0:  # a negative total is an invalid call (the op reports it): unknown
            dims[0] = int(values[-1])
    out = helper.make_tensor_type_proto(elem, dims)
    ctx.set_output_type(0, out)
    ctx.set_output_type(1, out)


def int_attributes(defaults: dict) -> list:
    """Optional int attributes with their defaults, as OpSchema wants them."""
    return [defs.OpSchema.Attribute(name, helper.make_attribute(name, default), f"default {default}")
            for name, default in defaults.items()]


def register_once(op_type: str, build) -> defs.OpSchema:
    """Registers ``build()`` for ``op_type`` in our domain unless already there; returns the schema."""
    if not defs.has(op_type, VERSION, DOMAIN):
        defs.register_schema(build())
    return defs.get_schema(op_type, VERSION, DOMAIN)


def _build_schema() -> defs.OpSchema:
    attrs = int_attributes(ATTRIBUTE_DEFAULTS)
    schema = defs.OpSchema(
        OP_TYPE, DOMAIN, VERSION, _DOC,
        inputs=[
            formal_parameter("current_key", "T1", "(seqstarts[B], H, Dh)"),
            formal_parameter("current_value", "T1", "(seqstarts[B], H, Dh)"),
            formal_parameter("seqstarts", "I", "(B+1,) int64"),
            formal_parameter("kvstarts", "I", "(B+1,) int64"),
            formal_parameter("cachestarts", "I", "(B,) in cache_mode 0, (B, MaxP) in cache_mode 1"),
            formal_parameter("start_pos", "I", "(B,)"),
            formal_parameter("max_seqlen", "I", "scalar or (1,)"),
            formal_parameter("max_kvlen", "I", "scalar or (1,)"),
            formal_parameter("cache", "T2", "rank 5, order given by cache_layout; written in place"),
            formal_parameter("scale", "T3", "cache shape with last dim Dh/quant_group; written in place", optional=True),
        ],
        outputs=[formal_parameter("key", "T1", "(kvstarts[B], H*num_repeat, Dh)"),
                 formal_parameter("value", "T1", "(kvstarts[B], H*num_repeat, Dh)")],
        type_constraints=[
            ("T1", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "keys and values"),
            ("T2", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(int8)", "tensor(int4)"],
             "cache: T1 when quant_bit is 0, int8 for 8, int4 for 4"),
            # bfloat16 only as ppl.pmx's empty placeholder with quant_bit 0 (a real scale is float32/float16)
            ("T3", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "quantization scales"),
            ("I", ["tensor(int64)"], "indices"),
        ],
        attributes=attrs,
    )
    schema.set_type_and_shape_inference_function(_infer)
    return schema


def register() -> defs.OpSchema:
    """Register the schema once per process (idempotent) and return it."""
    return register_once(OP_TYPE, _build_schema)

