"""The oldest ONNX Runtime the library supports: API version 22, onnxruntime 1.22.

Three ways in, each running the smoke tour (ort_smoke.py) in a fresh interpreter:

* behind the API fence (ort_api_fence.cc) on the installed onnxruntime: every OrtApi function newer than
  version 22 aborts, so the library provably calls none (the C++ wrappers included);
* on onnxruntime 1.22.0 itself, installed with pip into a cache folder the first time;
* behind a fence at version 21: registration fails with the error naming the release needed.
"""

import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys

import pytest

from kvcache_op.ort_ops import library_path
from repo_scripts import load

ort_headers = load("cmake/ort_headers.py")

TESTS = pathlib.Path(__file__).parent
OLDEST_RELEASE = "1.22.0"
API_VERSION = 22
# The first OrtApi function of each next version (its "\since" line in onnxruntime_c_api.h): the fence
# keeps the slots before it.
FIRST_OF_VERSION = {22: "ReleaseValueInfo", 23: "GetTensorSizeInBytes"}


def test_the_sources_ask_for_the_version_tested_here():
    header = (TESTS.parent / "ort_ops" / "kv_ort_op.h").read_text()
    assert f"kOrtApiVersion = {API_VERSION};" in header
    assert f'kOrtMinRelease = "{OLDEST_RELEASE.rsplit(".", 1)[0]}";' in header


def _build_fence(folder: pathlib.Path, version: int, first_new: str) -> pathlib.Path:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.fail("no C++ compiler (c++, g++ or $CXX) to build the API fence with")
    shim = folder / f"libfence_{version}_{first_new}.so"
    command = [compiler, "-std=c++17", "-shared", "-fPIC", f"-I{ort_headers.find_headers()}",
               f"-DKVCACHE_FENCE_VERSION={version}", f"-DKVCACHE_FENCE_FIRST_NEW={first_new}",
               str(TESTS / "ort_api_fence.cc"), "-o", str(shim), "-ldl"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stderr[-3000:]}"
    return shim


def _run(code: str, *, first_on_path=None, library=None, fenced=None, timeout=300):
    """Runs ``code`` in a fresh interpreter; the library's helpers register ``library`` when given."""
    path = ([str(first_on_path)] if first_on_path else []) + [str(TESTS), *sys.path]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    if library:
        env["KVCACHE_OP_LIBRARY"] = str(library)
    if fenced:
        env["KVCACHE_OP_FENCED_LIBRARY"] = str(fenced)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=TESTS)


SMOKE = "import ort_smoke; ort_smoke.main()"


def _assert_smoke_passed(done):
    from ort_smoke import DONE

    assert done.returncode == 0 and DONE in done.stdout, (
        f"exit status {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def test_the_library_calls_nothing_newer_than_its_api_version(tmp_path):
    shim = _build_fence(tmp_path, API_VERSION, FIRST_OF_VERSION[API_VERSION + 1])
    _assert_smoke_passed(_run(SMOKE, library=shim, fenced=library_path()))


def test_the_fence_stops_a_call_past_it(tmp_path):
    """The check above can fail: with the fence one slot too early, the thread-pool call aborts."""
    shim = _build_fence(tmp_path, API_VERSION, "KernelContext_ParallelFor")
    done = _run(SMOKE, library=shim, fenced=library_path())
    assert done.returncode != 0 and re.search(r"api fence: OrtApi slot \d+ called", done.stderr), done.stderr[-2000:]


def test_an_older_runtime_is_refused_naming_the_release_needed(tmp_path):
    shim = _build_fence(tmp_path, API_VERSION - 1, FIRST_OF_VERSION[API_VERSION])
    done = _run("from kvcache_op.ort_ops import session_options; session_options()", library=shim,
                fenced=library_path())
    assert done.returncode != 0
    assert (f"kvcache-op needs onnxruntime >= {OLDEST_RELEASE.rsplit('.', 1)[0]} (ONNX Runtime C API version "
            f"{API_VERSION}), but this is onnxruntime") in done.stderr, done.stderr[-2000:]


def _oldest_onnxruntime() -> pathlib.Path:
    """A folder holding onnxruntime==OLDEST_RELEASE alone (its dependencies come from this environment),
    installed with pip once into ~/.cache/kvcache-op."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}-{platform.system()}-{platform.machine()}".lower()
    target = ort_headers.cache_dir().parent / f"onnxruntime-{OLDEST_RELEASE}-{tag}"
    if (target / "onnxruntime" / "__init__.py").is_file():
        return target
    staging = target.with_name(f"{target.name}.part{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:",
                           "--target", str(staging), f"onnxruntime=={OLDEST_RELEASE}"],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        reason = f"pip could not install onnxruntime=={OLDEST_RELEASE}: {done.stderr.strip()[-500:]}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason + " (offline? CI runs this)")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def test_the_oldest_supported_onnxruntime_runs_the_library():
    folder = _oldest_onnxruntime()
    done = _run(SMOKE, first_on_path=folder)
    _assert_smoke_passed(done)
    assert f"onnxruntime {OLDEST_RELEASE} from {folder}" in done.stdout, done.stdout[-1000:]
