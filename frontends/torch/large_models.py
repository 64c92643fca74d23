"""Models whose weights pass protobuf's 2 GiB limit: their size, and a weightless stand-in for onnx's checks.

A ModelProto holds its weights in memory, and protobuf serializes at most 2 GiB: ``ModelProto.ByteSize()`` and onnx's
checker (which serializes the model it checks) fail on a float32 decoder of about half a billion parameters or more.
The checks need the weights' element types and shapes, not their values."""

from __future__ import annotations

import os
import stat

import onnx
from google.protobuf.message import Message

#: Weights above this go to an external data file when a model is saved (protobuf stops at 2 GiB; half of that leaves
#: room for the graph and for weights counted in typed fields).
PROTO_LIMIT = 1 << 30
#: Initializers larger than this become typed graph inputs in :func:`without_large_weights`; smaller ones stay, so
#: shape inference still reads the constant shapes, axes and indices that Reshape, Slice and Gather take.
CONSTANT_BYTES = 1 << 16


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """The bytes ``tensor`` holds in memory (its raw data, or the size of its typed fields), without serializing it
    whole (a tensor over 2 GiB cannot be)."""
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    return tensor.ByteSize()


def weight_bytes(model: onnx.ModelProto) -> int:
    """The bytes of ``model``'s main graph's initializers held in memory (external data not counted): what decides
    whether the model fits one protobuf message."""
    return sum(tensor_bytes(t) for t in model.graph.initializer)


def save(model: onnx.ModelProto, path: str, data: str | None = None) -> None:
    """``onnx.save`` of ``model`` to ``path``, with its weights in the file named ``data`` beside it when ``data`` is
    given; a data file of that name is replaced (onnx would append to it). The data file is made as readable as
    the model file: onnx creates it for its owner alone, and a model that another account (a server's) can open
    but whose weights it cannot read fails only when loaded."""
    data_path = None if data is None else os.path.join(os.path.dirname(os.path.abspath(path)), data)
    if data_path is not None and os.path.exists(data_path):
        os.remove(data_path)
    onnx.save(model, path, save_as_external_data=data is not None, location=data)
    if data_path is not None:
        readable_as(data_path, path)


def readable_as(data_path: str, model_path: str) -> None:
    """Gives the weights' data file at ``data_path`` the permissions of the model file at ``model_path`` (onnx and
    onnx_ir create it for its owner alone, as a temporary file)."""
    os.chmod(data_path, stat.S_IMODE(os.stat(model_path).st_mode))


def ir_weight_bytes(model) -> int:
    """:func:`weight_bytes` of an ``onnx_ir`` model."""
    return sum(value.const_value.nbytes for value in model.graph.initializers.values() if value.const_value is not None)


def without_large_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose main-graph initializers of more than :data:`CONSTANT_BYTES` are graph inputs of the
    same element type and shape: onnx's checker and shape inference infer and check the same types and shapes on
    it, at any size of weights. ``model`` is not changed, and no large weight is copied."""
    light = _copy_fields(model, onnx.ModelProto(), skip={"graph"})
    graph = _copy_fields(model.graph, light.graph, skip={"initializer"})
    inputs = {value.name for value in graph.input}
    for tensor in model.graph.initializer:
        if tensor_bytes(tensor) <= CONSTANT_BYTES:
            graph.initializer.append(tensor)
        elif tensor.name not in inputs:
            graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    return light


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
