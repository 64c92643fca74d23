"""Writing an exported model to its file: whole or not at all, its weights beside it when they are large.

Both exporters (``export_onnx``, ``kvcache_op.hf.export_model``) write through :func:`save_whole`, in onnx_ir, which
writes the weights tensor by tensor without a second copy in memory, resolves the data file beside the model (onnx
resolves it against the working directory when it checks for an existing one) and leaves the model it saves
unchanged (``onnx.save`` moves the weights of the ModelProto it is given out to the file)."""

from __future__ import annotations

import collections
import os
import stat
import tempfile
import uuid

import onnx
import onnx_ir as ir

from ..ort_ops import large_models


def weight_bytes(model: ir.Model) -> int:
    """The bytes of the initializers of ``model``'s main graph."""
    return sum(value.const_value.nbytes for value in model.graph.initializers.values() if value.const_value is not None)


def forget_removed_inputs(model: ir.Model) -> None:
    """Drops the graph's references to values that were its inputs and are no longer. onnx_ir's input list counts its
    values and keeps a removed one's entry at zero; torch's exporter lifts the weights out of the inputs, and onnx_ir's
    shape inference makes every initializer an input for a while, so without this every weight a rewrite replaces
    stays in memory as long as the graph does."""
    counter = getattr(model.graph.inputs, "_ref_counter", None)
    if isinstance(counter, collections.Counter):
        counter += collections.Counter()  # in place: keeps the positive counts only


def check_writable(path) -> None:
    """``FileNotFoundError``/``ValueError`` naming ``path`` where :func:`save_whole` could not write it, found before
    an export's slow work rather than after it: its folder missing, a folder at ``path``, a folder that refuses a new
    file (tried: a permission check says yes to root anywhere)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"the folder of {path} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder: name the ONNX file to write")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as error:
        raise ValueError(f"cannot write {path}: {error.strerror or error}") from None


def save_whole(model: ir.Model, path: str) -> None:
    """Writes ``model`` to ``path`` so that it appears whole or not at all, with its weights, when they pass
    :data:`~kvcache_op.ort_ops.large_models.EXTERNAL_DATA_BYTES`, in a data file of this save's own name beside it
    (``<file name>.<tag>.data``), as readable as the model's file. A failed or interrupted save leaves an earlier
    file at ``path`` and its weights as they were, never a file that looks complete; a save over an earlier one
    removes that one's data files once it has replaced it; two saves to one path write apart."""
    folder, name = os.path.split(os.path.abspath(path))
    tag = uuid.uuid4().hex[:12]
    partial = os.path.join(folder, f"{name}.partial-{tag}")
    data = f"{name}.{tag}.data" if weight_bytes(model) > large_models.EXTERNAL_DATA_BYTES else None
    earlier = _data_files(path)
    try:
        ir.save(model, partial, external_data=data)
        if data is not None:
            _readable_as(os.path.join(folder, data), partial)
        os.replace(partial, path)
    except BaseException:
        for leftover in (partial, data and os.path.join(folder, data)):
            if leftover and os.path.exists(leftover):
                os.remove(leftover)
        raise
    for old in earlier:
        os.remove(old)


def _readable_as(data_path: str, model_path: str) -> None:
    """Gives the data file the model file's permissions: a writer that makes it as a temporary file (onnx does;
    onnx_ir has, in some versions) makes it its owner's alone, and a server under another account could open the
    model but not read its weights."""
    os.chmod(data_path, stat.S_IMODE(os.stat(model_path).st_mode))


def _data_files(path: str) -> list:
    """The external data files the ONNX file at ``path`` (if any) names beside it."""
    if not os.path.isfile(path):
        return []
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 - not a readable model: nothing of it to remove
        return []
    folder = os.path.dirname(os.path.abspath(path))
    names = {entry.value for tensor in model.graph.initializer  # where an export keeps its weights
             for entry in tensor.external_data if entry.key == "location"}
    return [os.path.join(folder, n) for n in sorted(names) if os.path.isfile(os.path.join(folder, n))]
