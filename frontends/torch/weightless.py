"""onnx's checks of an exported model held in onnx_ir, without a copy of its weights.

A dynamo export's onnx_ir model holds the module's own tensors; its ModelProto (``ir.to_proto``) would copy every
weight into protobuf. The checks need the weights' names, element types and shapes only: they run on a proto whose
large weights are references to no file (:func:`weightless_proto`), and onnx's checker on the stand-in that makes
those weights typed graph inputs (:func:`~kvcache_op.ort_ops.large_models.without_large_weights`)."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from ..ort_ops import large_models

#: The location the left-out weights of :func:`weightless_proto` name: a file that is never written or read.
LEFT_OUT = "<weight left out of this proto>"


def _large_initializers(model: ir.Model) -> list:
    return [value for value in model.graph.initializers.values()
            if value.const_value is not None and value.const_value.nbytes > large_models.CONSTANT_BYTES]


def weightless_proto(model: ir.Model) -> onnx.ModelProto:
    """``model``'s ModelProto with each main-graph initializer of more than
    :data:`~kvcache_op.ort_ops.large_models.CONSTANT_BYTES` an external-data reference to :data:`LEFT_OUT` (its name,
    element type and shape kept, no values): everything onnx checks of the graph, at any size of weights. ``model`` is
    left as it was."""
    large = _large_initializers(model)
    tensors = [value.const_value for value in large]
    try:
        for value, tensor in zip(large, tensors):
            value.const_value = ir.ExternalTensor(LEFT_OUT, 0, tensor.nbytes, tensor.dtype, shape=tensor.shape,
                                                  name=value.name)
        return ir.to_proto(model)
    finally:
        for value, tensor in zip(large, tensors):
            value.const_value = tensor


def left_out(tensor: onnx.TensorProto) -> bool:
    """Whether ``tensor`` is one of :func:`weightless_proto`'s references to no file."""
    return tensor.data_location == onnx.TensorProto.EXTERNAL and any(
        entry.key == "location" and entry.value == LEFT_OUT for entry in tensor.external_data)


def check_model(model: ir.Model, proto: onnx.ModelProto) -> None:
    """``onnx.checker.check_model(full_check=True)`` for ``model``, given its :func:`weightless_proto`: the stand-in
    that declares the left-out weights as typed graph inputs, and each left-out weight that is also a graph input
    against that input's declaration (the stand-in keeps only the declaration), or, in IR version 3, that it is one.
    Raises what onnx's checker raises. The left-out weights' values are not checked: onnx_ir's tensors hold the
    bytes their type and shape need (a dynamo export's are the module's own torch tensors)."""
    inputs = {value.name for value in model.graph.inputs}
    for value in _large_initializers(model):
        tensor = value.const_value
        if value.name not in inputs and model.ir_version < 4:
            raise onnx.checker.ValidationError(f"{value.name} in initializer but not in graph input")
        if value.name in inputs and (value.dtype != tensor.dtype or (value.shape is not None and (
                len(value.shape) != len(tensor.shape) or any(isinstance(d, int) and d != t
                                                           for d, t in zip(value.shape, tensor.shape))))):
            raise onnx.checker.ValidationError(
                f"initializer {value.name} (type {tensor.dtype}, shape {list(tensor.shape)}) differs from its graph "
                f"input's declaration (type {value.dtype}, shape {value.shape})")
    onnx.checker.check_model(large_models.without_large_weights(proto, left_out), full_check=True)


def copy_input_types(proto: onnx.ModelProto, model: ir.Model) -> None:
    """Gives ``model``'s graph inputs the element types and shapes ``proto`` (its :func:`weightless_proto`, retyped)
    declares where they differ."""
    for declared, value in zip(proto.graph.input, model.graph.inputs):
        dtype = ir.serde.deserialize_type_proto_for_type(declared.type)
        shape = ir.serde.deserialize_type_proto_for_shape(declared.type)
        if dtype != value.type or shape != value.shape:
            value.type, value.shape = dtype, shape
