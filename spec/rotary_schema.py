"""The ONNX OpSchema of opmx.dynamic_batching::KeyCacheRotaryShift, version 1, and a model helper."""

import numpy as np
import onnx
from onnx import defs, helper

from .model import DEFAULT_OPSET, IR_VERSION
from .schema import DOMAIN, VERSION, formal_parameter, int_attributes, register_once

OP_TYPE = "KeyCacheRotaryShift"
INPUTS = ("cache", "scale", "slots", "cos", "sin")
ATTRIBUTE_DEFAULTS = {"num_layer": 1, "layer_idx": 0, "cache_layout": 0, "quant_bit": 0, "quant_group": 8,
                      "rotary_dim": 0, "rotary_interleaved": 0}


def _infer(ctx) -> None:
    """slots_out: int64 with the shape of slots."""
    slots = ctx.get_input_type(2)
    if slots is not None and slots.HasField("tensor_type"):
        ctx.set_output_type(0, slots)
    else:
        ctx.set_output_type(0, helper.make_tensor_type_proto(onnx.TensorProto.INT64, None))


def _build_schema() -> defs.OpSchema:
    schema = defs.OpSchema(
        OP_TYPE, DOMAIN, VERSION,
        "Rotates the keys stored in given cache slots by per-slot RoPE tables, in place (shift-RoPE-K). "
        "Normative text: spec/KeyCacheRotaryShift.md.",
        inputs=[formal_parameter("cache", "T2", "KeyValueCache's cache; written in place"),
                formal_parameter("scale", "T3", "KeyValueCache's scale; written in place", optional=True),
                formal_parameter("slots", "I", "(N,) distinct slots"),
                formal_parameter("cos", "F", "(N, rotary_dim/2)"),
                formal_parameter("sin", "F", "(N, rotary_dim/2)")],
        outputs=[formal_parameter("slots_out", "I", "(N,) = slots")],
        type_constraints=[
            ("T2", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(int8)", "tensor(int4)"], "cache"),
            ("T3", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "scales (bfloat16: empty placeholder)"),
            ("I", ["tensor(int64)"], "slots"),
            ("F", ["tensor(float)"], "rotation tables"),
        ],
        attributes=int_attributes(ATTRIBUTE_DEFAULTS),
    )
    schema.set_type_and_shape_inference_function(_infer)
    return schema


def register() -> defs.OpSchema:
    """Register once per process (idempotent)."""
    return register_once(OP_TYPE, _build_schema)


def make_rotary_shift_model(inputs: dict, **attributes) -> onnx.ModelProto:
    """A single-node KeyCacheRotaryShift model; ``inputs`` name -> example array (``scale`` may be None)."""
    unknown = set(attributes) - set(ATTRIBUTE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown KeyCacheRotaryShift attribute(s) {sorted(unknown)}")
    names = [n for n in INPUTS if inputs.get(n) is not None]
    node_inputs = [n if inputs.get(n) is not None else "" for n in INPUTS]
    node = helper.make_node(OP_TYPE, node_inputs, ["slots_out"], domain=DOMAIN,
                            **{**ATTRIBUTE_DEFAULTS, **{k: int(v) for k, v in attributes.items()}})
    graph_inputs = []
    for name in names:
        array = np.asarray(inputs[name])
        shape = list(array.shape) if name in ("cache", "scale") else [f"{name}_d{i}" for i in range(array.ndim)]
        graph_inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), shape))
    output = helper.make_tensor_value_info("slots_out", onnx.TensorProto.INT64, ["n"])
    graph = helper.make_graph([node], "key_cache_rotary_shift", graph_inputs, [output])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", DEFAULT_OPSET), helper.make_opsetid(DOMAIN, VERSION)],
                             ir_version=IR_VERSION, producer_name="kvcache-op")
