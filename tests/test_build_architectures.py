"""The build where the compiler does not target x86-64: the generic CPU kernel alone, and a dispatch that
names neither the AVX2 build nor x86-only builtins. (A real cross build for aarch64 takes the same path.)"""

import os
import pathlib
import platform
import shutil
import subprocess

import pytest

from repo_scripts import load

ort_headers = load("cmake/ort_headers.py")

ROOT = pathlib.Path(__file__).parents[1]


def _cmake():
    found = shutil.which("cmake")
    if found is None:
        try:
            import cmake  # the PyPI package that scikit-build-core may use
        except ImportError:
            pytest.fail("cmake is needed to build the library and is not installed")
        found = str(pathlib.Path(cmake.CMAKE_BIN_DIR) / "cmake")
    return found


def _configure(build_dir, cxx_flags=""):
    """Configures the project (CUDA off, headers found as the build finds them); returns CMake's output."""
    env = dict(os.environ, KVCACHE_OP_CUDA="0", KVCACHE_OP_ORT_INCLUDE_DIR=str(ort_headers.find_headers()))
    done = subprocess.run([_cmake(), "-S", str(ROOT), "-B", str(build_dir), f"-DCMAKE_CXX_FLAGS={cxx_flags}"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def _targets(build_dir):
    done = subprocess.run([_cmake(), "--build", str(build_dir), "--target", "help"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_no_avx2_build_where_the_compiler_does_not_target_x86_64(tmp_path):
    # -U__x86_64__ makes the compiler answer CMake's question as a compiler for another CPU would.
    output = _configure(tmp_path / "other", "-U__x86_64__")
    assert "kvcache-op CPU kernel builds: kv_cpu_generic\n" in output
    assert "kv_cpu_avx2" not in _targets(tmp_path / "other") and "kv_cpu_avx512" not in _targets(tmp_path / "other")
    assert not [p for p in (tmp_path / "other").rglob("flags.make") if "-mavx" in p.read_text()]


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the AVX2 build is x86-64 only")
def test_x86_64_builds_every_kernel(tmp_path):
    assert "kvcache-op CPU kernel builds: kv_cpu_generic;kv_cpu_avx2;kv_cpu_avx512\n" in _configure(tmp_path / "x86")
    targets = _targets(tmp_path / "x86")
    assert "kv_cpu_avx2" in targets and "kv_cpu_avx512" in targets


def _undefined_symbols(tmp_path, *defines):
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    obj = tmp_path / "dispatch.o"
    done = subprocess.run([compiler, "-std=c++17", "-c", *defines, f"-I{ROOT / 'cpu'}",
                           str(ROOT / "cpu" / "kv_cpu_dispatch.cc"), "-o", str(obj)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    nm = subprocess.run(["nm", "-C", "--undefined-only", str(obj)], capture_output=True, text=True, check=True)
    return nm.stdout


def test_dispatch_without_the_avx2_build_names_only_the_generic_kernel(tmp_path):
    undefined = _undefined_symbols(tmp_path)
    assert "kvcache::generic::ComputeCpu" in undefined
    assert "avx2" not in undefined and "__cpu_model" not in undefined and "__cpu_indicator_init" not in undefined


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the AVX2 build is x86-64 only")
def test_dispatch_with_the_avx2_build_picks_by_cpu(tmp_path):
    undefined = _undefined_symbols(tmp_path, "-DKVCACHE_CPU_AVX2")
    assert "kvcache::avx2::ComputeCpu" in undefined and "__cpu_model" in undefined


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the AVX-512 build is x86-64 only")
def test_dispatch_with_the_avx512_build_has_every_kernel(tmp_path):
    undefined = _undefined_symbols(tmp_path, "-DKVCACHE_CPU_AVX2", "-DKVCACHE_CPU_AVX512")
    for op in ("ComputeCpu", "MhaComputeCpu", "MhcaComputeCpu"):
        assert f"kvcache::avx512::{op}" in undefined and f"kvcache::avx2::{op}" in undefined, op
