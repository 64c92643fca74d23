"""ONNX Runtime custom ops of the opmx.dynamic_batching ops (CPU EP, and CUDA EP when built with CUDA).

The folder holds the ONNX Runtime glue only: the C++ ``*_ort_op`` classes and ``register.cc`` (the kernels
they call live in ``cpu/`` and ``cuda/``), and the Python side: where the one built library lies
(:func:`library_path`, also the C entry points' library) and sessions with it registered (``session``,
``graph_rules``, ``write_order``, ``large_models`` for models whose weights pass 2 GiB). It may import
``kvcache_op.reference``."""

import os
import pathlib

LIBRARY_NAME = "libkvcache_op_ort.so"
#: Environment variable naming another build of the library (tools/sanitize_tests.sh uses it).
LIBRARY_ENV = "KVCACHE_OP_LIBRARY"


def _find_library():
    override = os.environ.get(LIBRARY_ENV)
    if override:
        if not pathlib.Path(override).is_file():
            raise FileNotFoundError(f"{LIBRARY_ENV}={override} is not a file")
        return pathlib.Path(override).resolve()
    # An editable install keeps the built library in site-packages and the sources here: search both.
    for folder in __path__:
        candidate = pathlib.Path(folder).resolve() / LIBRARY_NAME
        if candidate.exists():
            return candidate
    return None


def library_path() -> str:
    """Absolute path of the custom-op shared library; ``FileNotFoundError`` if this install has none."""
    path = _find_library()
    if path is None:
        raise FileNotFoundError(f"{LIBRARY_NAME} not found in {list(__path__)}: the custom-op library was not built "
                                "in this install (reinstall with 'pip install .' and read the build log)")
    return str(path)


def library_available() -> bool:
    """True when :func:`library_path` would succeed."""
    return _find_library() is not None


def __getattr__(name):
    # The session helpers import onnxruntime; load them on first use only.
    if name in ("session_options", "make_session", "run_model", "ortvalue_for", "int4_ortvalue", "packed_view",
                "to_numpy", "DISABLED_OPTIMIZERS"):
        from . import session

        return getattr(session, name)
    raise AttributeError(name)
