"""ONNX Runtime custom-op library for opmx.dynamic_batching::KeyValueCache (CPU EP, and CUDA EP when built
with CUDA)."""

import pathlib

LIBRARY_NAME = "libkvcache_op_ort.so"


def library_path() -> str:
    """Absolute path of the custom-op shared library; ``FileNotFoundError`` if this install has none."""
    path = pathlib.Path(__file__).resolve().parent / LIBRARY_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: the custom-op library was not built in this install")
    return str(path)


def library_available() -> bool:
    """True when :func:`library_path` would succeed."""
    return (pathlib.Path(__file__).resolve().parent / LIBRARY_NAME).exists()
