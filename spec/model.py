"""Helpers that build KeyValueCache nodes and single-node models."""

import numpy as np
import onnx
from onnx import helper

from .schema import ATTRIBUTE_DEFAULTS, DOMAIN, INPUTS, OP_TYPE, OUTPUTS, VERSION

#: Fixed versions so generated models (and the committed conformance vectors) are reproducible.
IR_VERSION = 10
DEFAULT_OPSET = 21


def make_node(with_scale: bool = False, *, inputs=None, outputs=OUTPUTS, name: str = "kv_cache", **attributes):
    """A KeyValueCache node with ppl.pmx's input names (9 inputs, or 10 with ``scale``).

    Unknown attribute names raise ``ValueError``; attributes equal to the default are still written,
    as ppl.pmx does, so the node is self-describing.
    """
    unknown = set(attributes) - set(ATTRIBUTE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown KeyValueCache attribute(s) {sorted(unknown)}; known: {list(ATTRIBUTE_DEFAULTS)}")
    names = list(inputs) if inputs is not None else list(INPUTS if with_scale else INPUTS[:-1])
    attrs = {**ATTRIBUTE_DEFAULTS, **{k: int(v) for k, v in attributes.items()}}
    return helper.make_node(OP_TYPE, names, list(outputs), name=name, domain=DOMAIN, **attrs)


def _value_info(name, array):
    elem = helper.np_dtype_to_tensor_dtype(np.asarray(array).dtype)
    return helper.make_tensor_value_info(name, elem, list(np.asarray(array).shape))


def make_model(inputs: dict, outputs: dict = None, **attributes) -> onnx.ModelProto:
    """A single-node model whose graph inputs are ``inputs`` (name -> example array, fixes dtypes/ranks).

    Input dims are written as symbols except the last two of the data tensors, so one model serves
    every batch. ``outputs`` (name -> array) fixes output types; by default they follow ``current_key``.
    """
    with_scale = inputs.get("scale") is not None
    node = make_node(with_scale, **attributes)
    graph_inputs = []
    for name in node.input:
        array = np.asarray(inputs[name])
        elem = helper.np_dtype_to_tensor_dtype(array.dtype)
        shape = [f"{name}_d{i}" for i in range(array.ndim)]
        if name in ("current_key", "current_value"):
            shape[1:] = list(array.shape[1:])
        elif name in ("cache", "scale"):
            shape = list(array.shape)
        graph_inputs.append(helper.make_tensor_value_info(name, elem, shape))
    key = np.asarray(inputs["current_key"])
    elem = helper.np_dtype_to_tensor_dtype(key.dtype)
    if outputs is None:
        dims = ["kv_tokens", "kv_heads", "head_dim"]
        if key.ndim == 3:  # a malformed key (for error tests) keeps symbolic output dims
            heads = key.shape[1] * int(attributes.get("num_repeat", 1))
            dims[1:] = [heads if heads < 2**63 else "kv_heads", key.shape[2]]  # too many heads: the op reports it
        graph_outputs = [helper.make_tensor_value_info(n, elem, dims) for n in OUTPUTS]
    else:
        graph_outputs = [_value_info(n, outputs[n]) for n in OUTPUTS]
    graph = helper.make_graph([node], "key_value_cache", graph_inputs, graph_outputs)
    opsets = [helper.make_opsetid("", DEFAULT_OPSET), helper.make_opsetid(DOMAIN, VERSION)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION, producer_name="kvcache-op")
