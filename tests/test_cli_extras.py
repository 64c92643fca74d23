"""A command that misses an optional module (its extra not installed) says in one line which extra to install and
exits with status 2, in this process or in the export's child; a broken install of one is not passed off as
missing; a reader that goes away (``| head``) ends the command quietly. The missing module is made by a folder put
first on PYTHONPATH whose package of that name fails to import as an absent one does."""

import os
import subprocess
import sys

import pytest

from kvcache_op.extras import EXTRA_OF_MODULE, install_hint, missing_optional_module


def _without(tmp_path, module: str, missing_name: str | None = None) -> dict:
    """An environment whose ``import module`` fails as if it were not installed (or, with ``missing_name``, as if a
    part of it were missing: a broken install)."""
    folder = tmp_path / f"without_{module}" / module
    folder.mkdir(parents=True)
    name = missing_name or module
    (folder / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder.parent), env.get("PYTHONPATH")]))
    return env


def _run(argv, env, cwd, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcache_op", *argv], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _assert_one_line_hint(result, command: str, module: str, extra: str) -> None:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == [f"kvcache-op {command}: error: {module} is not installed: pip install 'kvcache-op[{extra}]'"], \
        result.stderr


@pytest.mark.parametrize("argv, module, extra", [
    (["demo"], "torch", "demo"),
    (["demo"], "transformers", "demo"),
    (["export", "no-such-checkpoint", "out.onnx"], "torch", "hf"),
    (["export", "no-such-checkpoint", "out.onnx"], "transformers", "hf"),
    (["serve", "model.onnx"], "fastapi", "serve"),
    (["serve", "model.onnx"], "uvicorn", "serve"),
])
def test_a_command_missing_its_extra_names_it_in_one_line(tmp_path, argv, module, extra):
    for other in {"demo": ("torch", "transformers"), "hf": ("torch", "transformers"),
                  "serve": ("fastapi", "uvicorn")}[extra]:
        if other != module:  # else the command stops at that one first
            pytest.importorskip(other)
    _assert_one_line_hint(_run(argv, _without(tmp_path, module), tmp_path), argv[0], module, extra)


def test_a_checkpoint_exported_in_a_child_missing_torch_names_the_extra(tmp_path):
    pytest.importorskip("torch")  # kvcache_op.hf imports it
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    from kvcache_op.hf import tiny_checkpoint

    tiny_checkpoint(tmp_path / "checkpoint")
    result = _run(["serve", str(tmp_path / "checkpoint"), "--cache-dir", str(tmp_path / "cache"), "--stop-after", "1"],
                  _without(tmp_path, "torch"), tmp_path)
    _assert_one_line_hint(result, "serve", "torch", "hf")


def test_a_broken_install_is_reported_in_full_not_as_missing(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    result = _run(["demo"], _without(tmp_path, "torch", missing_name="torch._C"), tmp_path)
    assert result.returncode == 1 and "Traceback" in result.stderr and "not installed" not in result.stderr, result


@pytest.mark.parametrize("argv", [["conformance", "--list"],
                                  # prints progress inside a command that reports a write it cannot do (OSError)
                                  ["conformance", "--out", "vectors", "--case", "paged_layout0"]])
def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path, argv):
    process = subprocess.Popen([sys.executable, "-m", "kvcache_op", *argv], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # before the command has printed (it is still starting): every write finds no reader
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1 and stderr == "", (process.returncode, stderr)


def test_a_command_started_with_stdout_closed_still_succeeds(tmp_path):
    result = subprocess.run(f'exec "{sys.executable}" -m kvcache_op conformance --list >&-', shell=True,
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == "", result


def test_a_closed_pipe_in_process_leaves_the_callers_stdout_alone(monkeypatch, capsys):
    from kvcache_op import cli

    def closed_pipe(args):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(cli, "_conformance", closed_pipe)
    assert cli.main(["conformance", "--list"]) == 1
    print("still printing")
    assert capsys.readouterr().out == "still printing\n"


def test_the_missing_module_is_found_behind_the_errors_raised_from_it():
    try:
        try:
            raise ModuleNotFoundError("No module named 'onnxscript'", name="onnxscript")
        except ImportError as error:
            raise ImportError("kvcache_op.hf needs onnxscript") from error
    except ImportError as wrapped:
        assert missing_optional_module(wrapped) == "onnxscript"
    assert missing_optional_module(ModuleNotFoundError("x", name="numpy")) is None  # not optional: a real failure
    try:
        try:
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        except ImportError:
            raise ValueError("a bad argument, found while torch was missing") from None
    except ValueError as hidden:
        assert missing_optional_module(hidden) is None  # the context was hidden: not the cause
    assert missing_optional_module(ValueError("x")) is None


def test_every_extra_named_is_one_the_package_declares():
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path

    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    named = {install_hint(module, command).rpartition("[")[2].rstrip("]'")
             for module in EXTRA_OF_MODULE for command in (None, "demo", "serve", "bench", "export")}
    assert named <= set(declared), named - set(declared)
    for module, extra in EXTRA_OF_MODULE.items():  # the extra named for a module does bring it
        requirements = " ".join(declared[extra]).replace("-", "_")
        brought_by_onnxscript = module == "onnx_ir" and "onnxscript" in requirements
        assert module in requirements or brought_by_onnxscript, (module, extra)


@pytest.mark.parametrize("missing", ["ray", "starlette"])
def test_replicas_without_ray_serve_say_why_in_one_line(exported, tmp_path, missing):
    """Ray missing, or Ray present without a package Ray Serve imports: one line naming what failed and the extra."""
    folder = tmp_path / "without" / "ray"
    (folder / "serve").mkdir(parents=True)
    failing = f"raise ModuleNotFoundError(\"No module named '{missing}'\", name={missing!r})\n"
    (folder / "__init__.py").write_text(failing if missing == "ray" else "")
    (folder / "serve" / "__init__.py").write_text(failing)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder.parent), env.get("PYTHONPATH")]))
    result = _run(["serve", str(exported), "--replicas", "1", "--port", "0"], env, tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"No module named '{missing}'" in errors[0], result.stderr
    assert errors[0].endswith("pip install 'kvcache-op[ray]'"), errors
