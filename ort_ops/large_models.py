"""ONNX models whose weights pass protobuf's 2 GiB limit: their size, onnx's checks on them, and a clear error where
one would be serialized whole.

A ModelProto holds its weights in memory, and protobuf serializes at most 2 GiB: ``ModelProto.ByteSize()``,
``SerializeToString()`` and onnx's checker (which serializes the model it checks) fail on a float32 decoder of about
half a billion parameters or more. The checks need the weights' element types and shapes, not their values."""

from __future__ import annotations

import math

import numpy as np
import onnx
from google.protobuf.message import EncodeError, Message

#: Weights above this are saved to an external data file beside the model, and a model holding more is checked on
#: :func:`without_large_weights`: half of protobuf's 2 GiB, leaving room for the graph and for typed-field tensors.
EXTERNAL_DATA_BYTES = 1 << 30
#: Initializers larger than this become typed graph inputs in :func:`without_large_weights`; smaller ones stay, so
#: shape inference still reads the constant shapes, axes and indices that Reshape, Slice and Gather take.
CONSTANT_BYTES = 1 << 16
# onnx.checker.check_tensor serializes the tensor it checks.
_SERIALIZABLE_BYTES = (1 << 31) - (1 << 20)


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """The bytes ``tensor``'s values take in memory (its raw data, else its serialized size), without serializing
    it when it holds raw data (a tensor over 2 GiB cannot be)."""
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    return tensor.ByteSize()


def weight_bytes(model: onnx.ModelProto) -> int:
    """The bytes of ``model``'s main graph's initializers held in memory (external data not counted)."""
    return sum(tensor_bytes(t) for t in model.graph.initializer)


def check_model(model: onnx.ModelProto) -> None:
    """``onnx.checker.check_model(model, full_check=True)`` for a model of any size: on ``model`` itself up to
    :data:`EXTERNAL_DATA_BYTES` of weights; above, each weight left out of :func:`without_large_weights` is checked
    on its own (one value field, the bytes its type and shape need, its declaration where it is also a graph input),
    then the stand-in. Raises what onnx's checker raises."""
    if weight_bytes(model) <= EXTERNAL_DATA_BYTES:
        onnx.checker.check_model(model, full_check=True)
        return
    inputs = {value.name: value for value in model.graph.input}
    for tensor in model.graph.initializer:
        if tensor_bytes(tensor) > CONSTANT_BYTES:
            _check_left_out(tensor, inputs.get(tensor.name), model.ir_version)
    onnx.checker.check_model(without_large_weights(model), full_check=True)


def without_large_weights(model: onnx.ModelProto, large=None) -> onnx.ModelProto:
    """A copy of ``model`` whose main-graph initializers of more than :data:`CONSTANT_BYTES` (or those for which
    ``large(tensor)`` is true, when given) are graph inputs of the same element type and shape (or, where one is
    already a graph input, that input alone): shape inference infers the same types and shapes on it at any size of
    weights. The left-out tensors themselves are not checked on it (:func:`check_model` checks them). ``model`` is not
    changed, and no large weight is copied."""
    large = large or (lambda tensor: tensor_bytes(tensor) > CONSTANT_BYTES)
    light = _copy_fields(model, onnx.ModelProto(), skip={"graph"})
    graph = _copy_fields(model.graph, light.graph, skip={"initializer"})
    inputs = {value.name for value in graph.input}
    for tensor in model.graph.initializer:
        if not large(tensor):
            graph.initializer.append(tensor)
        elif tensor.name not in inputs:
            graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    return light


def serialized(model: onnx.ModelProto) -> bytes:
    """``model.SerializeToString()``; ``ValueError`` saying what to pass instead where its weights are too large for
    one protobuf message."""
    try:
        return model.SerializeToString()
    except EncodeError:
        raise ValueError(f"the model holds {weight_bytes(model) / 2**30:.1f} GiB of weights in memory, more than one "
                         "protobuf message takes (2 GiB): save it with its weights in an external data file "
                         "(onnx.save(model, path, save_as_external_data=True), or the exporter's path argument) "
                         "and pass the file's path") from None


def _check_left_out(tensor: onnx.TensorProto, declared, ir_version: int) -> None:
    """What onnx's checker checks of an initializer that :func:`without_large_weights` leaves out."""
    if tensor_bytes(tensor) <= _SERIALIZABLE_BYTES:
        onnx.checker.check_tensor(tensor)
    else:  # a single tensor over 2 GiB: its raw bytes, without serializing it
        fields = [f.name for f, _ in tensor.ListFields() if f.name.endswith("_data") and f.name != "external_data"]
        if fields != ["raw_data"]:
            raise onnx.checker.ValidationError(
                f"TensorProto (tensor name: {tensor.name}) should contain one and only one value field.")
        needed = _raw_bytes(tensor)
        if needed is not None and len(tensor.raw_data) != needed:
            raise onnx.checker.ValidationError(
                f"TensorProto (tensor name: {tensor.name}) raw_data size ({len(tensor.raw_data)} bytes) does not "
                f"match the declared shape and type ({needed} bytes required).")
    if declared is None:
        if ir_version < 4:
            raise onnx.checker.ValidationError(f"{tensor.name} in initializer but not in graph input")
        return
    kind = declared.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in kind.shape.dim]
    if kind.elem_type != tensor.data_type or (kind.HasField("shape") and (
            len(dims) != len(tensor.dims) or any(d is not None and d != t for d, t in zip(dims, tensor.dims)))):
        raise onnx.checker.ValidationError(
            f"initializer {tensor.name} (type {tensor.data_type}, shape {list(tensor.dims)}) differs from its graph "
            f"input's declaration (type {kind.elem_type}, shape {dims})")


def _raw_bytes(tensor: onnx.TensorProto):
    """The raw bytes ``tensor``'s type and shape take (sub-byte types packed), or None for a type without a fixed
    size."""
    count = math.prod(tensor.dims)
    bits = {getattr(onnx.TensorProto, name): width for name, width in
            (("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2)) if hasattr(onnx.TensorProto, name)}
    if tensor.data_type in bits:
        return (count * bits[tensor.data_type] + 7) // 8
    try:
        return count * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        return None


def _copy_fields(source, target, skip: set):
    """``target`` with every set field of ``source`` but those named in ``skip`` copied into it."""
    for field, value in source.ListFields():
        if field.name in skip:
            continue
        if isinstance(value, Message):
            getattr(target, field.name).CopyFrom(value)
        elif isinstance(value, (str, bytes, int, float)):  # scalars, enums included
            setattr(target, field.name, value)
        else:  # a repeated field
            getattr(target, field.name).extend(value)
    return target
