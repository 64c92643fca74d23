"""The installed library: found, loadable by ONNX Runtime, and built with CUDA wherever nvcc exists."""

import os
import pathlib
import shutil

import pytest

from kvcache_op.ort_ops import LIBRARY_ENV, library_path


def test_library_is_installed_and_registers_in_onnxruntime():
    from kvcache_op.ort_ops import session_options

    assert pathlib.Path(library_path()).is_file()
    session_options()  # register_custom_ops_library raises if RegisterCustomOps fails


@pytest.mark.skipif(shutil.which("nvcc") is None or os.environ.get("KVCACHE_OP_CUDA") == "0",
                    reason="no nvcc here (or CUDA disabled): the library is CPU-only by design")
def test_library_contains_the_cuda_variant_when_nvcc_exists():
    assert b"CUDAExecutionProvider" in pathlib.Path(library_path()).read_bytes()


def test_library_override_must_exist(monkeypatch):
    monkeypatch.setenv(LIBRARY_ENV, "/nonexistent/libkvcache_op_ort.so")
    with pytest.raises(FileNotFoundError, match=LIBRARY_ENV):
        library_path()
