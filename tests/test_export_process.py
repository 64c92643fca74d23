"""A checkpoint's export in a process of its own (what ``kvcache-op serve`` does on first use): it writes the same
export, its progress lines arrive here as they come, this process keeps none of the export's graphs, and its
errors come back as the same type and text (an unexpected one, or a child killed, as RuntimeError)."""

import gc
import multiprocessing
import os
import signal

import pytest

pytest.importorskip("transformers")

from kvcache_op.export_command import tokenizer_folder  # noqa: E402
from kvcache_op.export_process import child_error, export_in_child  # noqa: E402
from kvcache_op.serve_command import resolve_model  # noqa: E402


def _ir_graphs_with_weights() -> dict:
    """{id: graph} of the onnx_ir graphs alive in this process that hold initializers (a model's, not a function's)."""
    gc.collect()
    return {id(o): o for o in gc.get_objects()
            if type(o).__name__ == "Graph" and type(o).__module__.startswith("onnx_ir") and len(o.initializers)}


def test_the_export_runs_elsewhere_writes_the_model_and_leaves_no_graph_here(served_checkpoint, tmp_path):
    folder = served_checkpoint[0]
    before = set(_ir_graphs_with_weights())
    said = []
    result = export_in_child(folder, tmp_path / "model.onnx", progress=said.append)
    assert result["path"] == str(tmp_path / "model.onnx") and (tmp_path / "model.onnx").is_file()
    assert (tokenizer_folder(tmp_path / "model.onnx") / "config.json").is_file()
    assert said[0].startswith("[1/3] loading") and any("[2/3] exporting" in line for line in said)
    assert said[-1].startswith("wrote ")
    kept = set(_ir_graphs_with_weights()) - before
    assert not kept, f"{len(kept)} graph(s) of the export are still alive in the process that asked for it"


def test_serve_exports_a_checkpoint_folder_elsewhere_and_keeps_none_of_it(served_checkpoint, tmp_path):
    before = set(_ir_graphs_with_weights())
    path, _ = resolve_model(served_checkpoint[0], cache_dir=tmp_path, progress=lambda line: None)
    assert path.is_file()
    kept = set(_ir_graphs_with_weights()) - before
    assert not kept, f"{len(kept)} graph(s) of the export are still alive in the server's process"


@pytest.mark.parametrize("settings, error, message", [
    ({"page_size": 0}, ValueError, "page_size"),
    ({"no_such_setting": 1}, TypeError, "no_such_setting"),
])
def test_errors_the_caller_can_fix_come_back_as_the_same_type(served_checkpoint, tmp_path, settings, error, message):
    with pytest.raises(error, match=message):
        export_in_child(served_checkpoint[0], tmp_path / "model.onnx", settings=settings, progress=lambda line: None)


def test_a_missing_checkpoint_is_the_same_error_as_in_process(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint folder at"):
        export_in_child(tmp_path / "none", tmp_path / "model.onnx", progress=lambda line: None)


def test_any_other_error_is_a_runtime_error_naming_its_type():
    error = child_error("ckpt", "KeyError", "'rope_theta'")
    assert type(error) is RuntimeError and str(error) == "the export of ckpt failed: KeyError: 'rope_theta'"
    assert type(child_error("ckpt", "ValueError", "bad")) is ValueError


def test_a_child_that_dies_without_an_answer_is_a_runtime_error_naming_its_exit_code(served_checkpoint, tmp_path):
    def kill_the_child(line):
        for child in multiprocessing.active_children():
            if child.name == "kvcache-op-export":
                os.kill(child.pid, signal.SIGKILL)

    with pytest.raises(RuntimeError, match=r"ended without an answer \(exit code -9\)"):
        export_in_child(served_checkpoint[0], tmp_path / "model.onnx", progress=kill_the_child)
    assert not [c for c in multiprocessing.active_children() if c.name == "kvcache-op-export"]
