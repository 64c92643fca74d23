"""A checkpoint's export in a process of its own (what ``kvcache-op serve`` does on first use): it writes the same
export, its progress lines arrive here as they come, this process keeps none of the export's graphs, and its
errors come back as the same type and text (an unexpected one, or a child killed, as RuntimeError)."""

import gc
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

from kvcache_op.export_command import tokenizer_folder  # noqa: E402
from kvcache_op.export_process import _expected_name, child_error, export_in_child  # noqa: E402
from kvcache_op.serve_command import resolve_model  # noqa: E402
from processes import ended_within  # noqa: E402


def _ir_graphs_with_weights() -> dict:
    """{id: graph} of the onnx_ir graphs alive in this process that hold initializers (a model's, not a function's)."""
    gc.collect()
    return {id(o): o for o in gc.get_objects()
            if type(o).__name__ == "Graph" and type(o).__module__.startswith("onnx_ir") and len(o.initializers)}


def test_the_export_runs_elsewhere_writes_the_model_and_leaves_no_graph_here(served_checkpoint, tmp_path):
    folder = served_checkpoint[0]
    before = _ir_graphs_with_weights()  # kept alive here: no graph made later can take one of their ids
    said = []
    result = export_in_child(folder, tmp_path / "model.onnx", progress=said.append)
    assert result["path"] == str(tmp_path / "model.onnx") and (tmp_path / "model.onnx").is_file()
    assert (tokenizer_folder(tmp_path / "model.onnx") / "config.json").is_file()
    assert said[0].startswith("[1/3] loading") and any("[2/3] exporting" in line for line in said)
    assert said[-1].startswith("wrote ")
    kept = set(_ir_graphs_with_weights()) - set(before)
    assert not kept, f"{len(kept)} graph(s) of the export are still alive in the process that asked for it"


def test_serve_exports_a_checkpoint_folder_elsewhere_and_keeps_none_of_it(served_checkpoint, tmp_path):
    before = _ir_graphs_with_weights()  # kept alive here: no graph made later can take one of their ids
    path, _ = resolve_model(served_checkpoint[0], cache_dir=tmp_path, progress=lambda line: None)
    assert path.is_file()
    kept = set(_ir_graphs_with_weights()) - set(before)
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


@pytest.mark.parametrize("error, name", [
    (IsADirectoryError("x"), "IsADirectoryError"), (shutil.SameFileError("x"), "OSError"),
    (json.JSONDecodeError("bad", "{", 0), "ValueError"),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), "ValueError"),
    (NotImplementedError("x"), "NotImplementedError"), (KeyError("x"), None), (RuntimeError("x"), None),
])
def test_an_error_is_sent_as_the_nearest_type_a_caller_can_fix(error, name):
    """A subclass (a JSON decode error, a file copied onto itself) keeps the one-line refusal of its base type."""
    assert _expected_name(error) == name


def test_ctrl_c_reaching_the_child_does_not_stop_the_export(served_checkpoint, tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: the child leaves it to the parent."""
    def interrupt_the_child(line):
        for child in multiprocessing.active_children():
            if child.name == "kvcache-op-export" and line.startswith("[1/3]"):
                os.kill(child.pid, signal.SIGINT)

    assert export_in_child(served_checkpoint[0], tmp_path / "model.onnx", progress=interrupt_the_child)["path"]


def test_an_interrupted_caller_ends_the_child(served_checkpoint, tmp_path):
    def interrupted(line):
        raise KeyboardInterrupt

    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        export_in_child(served_checkpoint[0], tmp_path / "model.onnx", progress=interrupted)
    assert not [c for c in multiprocessing.active_children() if c.name == "kvcache-op-export"]
    assert time.monotonic() - began < 60


def test_a_child_whose_parent_is_killed_ends_too(served_checkpoint, tmp_path):
    """The parent dies at the first progress line (as a SIGKILL would end it); its child ends too."""
    script = textwrap.dedent(f"""
        import multiprocessing, os
        from kvcache_op.export_process import export_in_child

        def die(line):
            print(*[c.pid for c in multiprocessing.active_children()], flush=True)
            os._exit(0)

        if __name__ == "__main__":
            export_in_child({str(served_checkpoint[0])!r}, {str(tmp_path / "model.onnx")!r}, progress=die)
    """)
    (tmp_path / "parent.py").write_text(script)
    done = subprocess.run([sys.executable, str(tmp_path / "parent.py")], capture_output=True, text=True, timeout=120)
    (pid,) = map(int, done.stdout.split())
    assert ended_within(pid, 30), f"the orphaned export {pid} is still running"


def test_the_childs_watch_ends_it_when_its_parent_is_gone(tmp_path):
    """Between progress lines (a long export stage) nothing would tell the child: its watch does."""
    script = textwrap.dedent("""
        import multiprocessing, os
        from kvcache_op.export_process import _end_with_parent

        if __name__ == "__main__":
            child = multiprocessing.get_context("spawn").Process(target=_end_with_parent, args=(os.getpid(),))
            child.start()
            print(child.pid, flush=True)
            os._exit(0)
    """)
    (tmp_path / "parent.py").write_text(script)
    done = subprocess.run([sys.executable, str(tmp_path / "parent.py")], capture_output=True, text=True, timeout=120)
    pid = int(done.stdout)
    assert ended_within(pid, 30), f"the orphaned child {pid} is still running"


def test_a_child_that_dies_without_an_answer_is_a_runtime_error_naming_its_exit_code(served_checkpoint, tmp_path):
    def kill_the_child(line):
        for child in multiprocessing.active_children():
            if child.name == "kvcache-op-export":
                os.kill(child.pid, signal.SIGKILL)

    with pytest.raises(RuntimeError, match=r"ended without an answer \(exit code -9\)"):
        export_in_child(served_checkpoint[0], tmp_path / "model.onnx", progress=kill_the_child)
    assert not [c for c in multiprocessing.active_children() if c.name == "kvcache-op-export"]
