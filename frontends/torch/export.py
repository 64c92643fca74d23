"""One call from a torch module that uses the ops to a checked ONNX file."""

from __future__ import annotations

import io

import onnx
import torch

from ..ort_ops.graph_rules import in_place_inputs
from ..spec import rotary_schema, schema
from .onnx_export import int4_cache_inputs


def export_onnx(module: torch.nn.Module, args: tuple, path=None, *, dynamo: bool = True, **export_kwargs) -> onnx.ModelProto:
    """``torch.onnx.export(module, args, dynamo=dynamo, **export_kwargs)``, then: int4 cache inputs retyped
    (:func:`~kvcache_op.torch.int4_cache_inputs`), ``onnx.checker.check_model(full_check=True)`` with the
    ops' schemas, and the graph-input rule for in-place inputs checked (``ValueError`` when a cache is an
    initializer or computed). Saves to ``path`` when given; returns the model.

    Pass the cache (and scale) as forward arguments, not module buffers: a buffer is exported as a
    constant initializer and the in-place writes would be lost. The TorchScript exporter
    (``dynamo=False``) runs the module once on ``args``, so it writes their cache."""
    if dynamo:
        model = torch.onnx.export(module, args, dynamo=True, **export_kwargs).model_proto
    else:
        buffer = io.BytesIO()
        torch.onnx.export(module, args, buffer, dynamo=False, **export_kwargs)
        model = onnx.load_from_string(buffer.getvalue())
    int4_cache_inputs(model)
    schema.register()
    rotary_schema.register()
    onnx.checker.check_model(model, full_check=True)
    in_place_inputs(model)
    if path is not None:
        onnx.save(model, str(path))
    return model
