"""One call from a torch module that uses the ops to a checked ONNX file."""

from __future__ import annotations

import collections
import contextlib
import io
import itertools
import logging
import os
import tempfile
import warnings

import onnx
import onnx_ir as ir
import torch

from ..ort_ops.graph_rules import in_place_inputs
from ..ort_ops import large_models
from ..spec import rotary_schema, schema
from . import onnx_export, weightless
from .model_files import check_writable, forget_removed_inputs, save_whole


def export_onnx(module: torch.nn.Module, args: tuple, path=None, *, dynamo: bool = True, **export_kwargs) -> onnx.ModelProto:
    """``torch.onnx.export(module, args, dynamo=dynamo, **export_kwargs)``, then: every call of the ops is
    one node (``ValueError`` when the exporter dropped a call whose outputs nothing uses, or merged identical
    calls), int4 cache inputs retyped (:func:`~kvcache_op.torch.int4_cache_inputs`),
    ``onnx.checker.check_model(full_check=True)`` with the ops' schemas, and the graph rules for in-place
    inputs (``ValueError`` when a cache is an initializer or computed, or when writes of one cache layer
    are not ordered by data). Saves to ``path`` when given, whole or not at all
    (weights over 1 GiB in ``<file name>.<tag>.data`` beside it); returns the model.

    The dynamo exporter's onnxscript optimizer merges identical calls (two equal rotations become one), so
    it is off unless ``optimize=True`` is passed: ONNX Runtime optimizes the graph when it loads it.
    Pass the cache (and scale) as forward arguments, not module buffers: a buffer is exported as a
    constant initializer and the in-place writes would be lost. The TorchScript exporter
    (``dynamo=False``) runs the module once on ``args``, so it writes their cache."""
    if path is not None:
        check_writable(path)  # before the export, not after it
    work_folder = None if path is None else os.path.dirname(os.path.abspath(path))
    model = checked_export(module, args, dynamo=dynamo, work_folder=work_folder, **export_kwargs)
    if path is not None:
        save_whole(model, os.fspath(path))
    return ir.to_proto(model)


def checked_export(module: torch.nn.Module, args: tuple, *, dynamo: bool = True, work_folder: str = None,
                   **export_kwargs) -> ir.Model:
    """:func:`export_onnx`'s export and checks, the model in onnx_ir and not saved. A dynamo export's weights are the
    module's own tensors, not copies, and the checks copy none (:mod:`~kvcache_op.torch.weightless`): a large model
    is held once. ``work_folder``: where the TorchScript exporter writes a model of over 1 GiB of tensors (the
    system's temporary folder by default)."""
    onnx_export.start_recording()
    try:
        with _exporter_quiet(export_kwargs.get("verbose")):
            model = _export(module, args, dynamo, export_kwargs, work_folder)
    except Exception as error:
        if onnx_export.first_error() is None:
            raise
        raise onnx_export.first_error() from error  # the op's own message, not the exporter's retries'

    _check_one_node_per_call(model, onnx_export.calls_of_last_trace())
    light = weightless.weightless_proto(model)
    onnx_export.int4_cache_inputs(light)
    weightless.copy_input_types(light, model)
    schema.register()
    rotary_schema.register()
    weightless.check_model(model, light)
    in_place_inputs(light)
    return model


def _export(module, args, dynamo: bool, export_kwargs: dict, work_folder: str | None) -> ir.Model:
    export_kwargs.setdefault("verbose", False)  # torch's dynamo exporter prints its progress for None
    if dynamo:
        _refuse_repeated_tensors(args, export_kwargs.get("kwargs"))
        export_kwargs.setdefault("optimize", False)
        model = torch.onnx.export(module, args, dynamo=True, **export_kwargs).model
        forget_removed_inputs(model)
        return model
    if _tensor_bytes(module) <= large_models.EXTERNAL_DATA_BYTES:
        buffer = io.BytesIO()
        torch.onnx.export(module, args, buffer, dynamo=False, **export_kwargs)
        return ir.from_proto(onnx.load_from_string(buffer.getvalue()))
    # Through a file: torch's TorchScript exporter refuses to write a model over 2 GiB to memory. Beside the
    # destination where there is one: the system's temporary folder may be small, or in memory (tmpfs).
    with tempfile.TemporaryDirectory(prefix="kvcache-op-export-", dir=work_folder) as folder:
        path = os.path.join(folder, "model.onnx")
        torch.onnx.export(module, args, path, dynamo=False, **export_kwargs)
        return ir.from_proto(onnx.load(path))  # its weights too, wherever the exporter put them


def _tensor_bytes(module: torch.nn.Module) -> int:
    """The bytes of ``module``'s parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _refuse_repeated_tensors(args, kwargs=None) -> None:
    """torch.export makes one graph input of a tensor passed twice (k as both current_key and current_value), and
    the one input then feeds both: a graph that ignores what is fed for the other at run time. Found wherever the
    inputs hold it: in ``args`` and the export's ``kwargs``, inside tuples, lists and dicts (a batch dict)."""
    seen = {}
    for where, tensor in itertools.chain(_tensors_in(args if isinstance(args, tuple) else (args,), "args"),
                                         _tensors_in(kwargs or {}, "kwargs")):
        if id(tensor) in seen:
            raise ValueError(f"{seen[id(tensor)]} and {where} are the same tensor: torch.export (dynamo=True) exports "
                             f"them as one graph input feeding both places. Pass distinct tensors (e.g. a clone)")
        seen[id(tensor)] = where


def _tensors_in(value, where: str):
    """(path, tensor) of every tensor in ``value``, through tuples, lists and dicts (as torch.export flattens them)."""
    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _tensors_in(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors_in(item, f"{where}[{key!r}]")


@contextlib.contextmanager
def _exporter_quiet(verbose):
    """While torch exports (unless ``verbose``): its exporter's INFO/WARNING log lines (progress, "torchvision is
    not installed. Skipping torchvision::nms") and the Future/Deprecation warnings torch's own code raises
    inside the export are not the caller's to read. Errors still raise; nothing outside the export changes."""
    if verbose:
        yield
        return
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            for category in (FutureWarning, DeprecationWarning):
                warnings.filterwarnings("ignore", category=category, module=r"(torch|onnxscript|onnx_ir|copyreg)(\.|$)")
            yield
    finally:
        logger.setLevel(level)


def _check_one_node_per_call(model: ir.Model, calls: collections.Counter) -> None:
    nodes = collections.Counter(n.op_type for n in model.graph if n.domain == schema.DOMAIN)
    for op_type, count in calls.items():
        if nodes[op_type] < count:
            raise ValueError(
                f"{count} {op_type} call(s) exported as {nodes[op_type]} node(s): the exporter dropped a call "
                "whose outputs nothing uses, or merged identical calls. Use every call's outputs (return them "
                "from forward) and keep the dynamo optimizer off (optimize=False)")
