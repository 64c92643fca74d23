"""Registering the library in many SessionOptions does not grow the native heap: the library adds one
process-wide op domain to every SessionOptions instead of allocating a new one each time."""

import ctypes
import ctypes.util
import gc

import onnxruntime as ort
import pytest

from kvcache_op.ort_ops import library_path

REGISTRATIONS = 3000
# Well below the old growth (one leaked domain per registration: about 2 MB for 3000 here).
MAX_GROWTH_BYTES = 64 * 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _allocated_bytes():
    """Bytes in use in glibc's heap (mallinfo2().uordblks), or None where that is not available."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    return mallinfo2().uordblks


def _register(count, path):
    for _ in range(count):
        options = ort.SessionOptions()
        options.register_custom_ops_library(path)
        del options
    gc.collect()


def test_registering_in_many_session_options_keeps_the_heap_bounded():
    path = library_path()
    if _allocated_bytes() is None:
        pytest.skip("glibc mallinfo2 is not available here")
    _register(200, path)  # warm up: the library is loaded, its domain created, python's caches filled
    before = _allocated_bytes()
    _register(REGISTRATIONS, path)
    growth = _allocated_bytes() - before
    assert growth < MAX_GROWTH_BYTES, f"native heap grew by {growth} bytes over {REGISTRATIONS} registrations"


def test_sessions_from_options_registered_after_others_were_dropped_still_run():
    """The shared domain outlives every SessionOptions it was added to."""
    import numpy as np

    from kvcache_op import spec
    from kvcache_op.reference import key_value_cache
    from kvcache_op.validation.cases import CASES

    _register(5, library_path())
    case = CASES["offset_layout0"]()
    feeds = {k: v.copy() for k, v in case.inputs.items() if v is not None}
    want = {k: (None if v is None else v.copy()) for k, v in case.inputs.items()}
    want_key, _ = key_value_cache(**want, **case.attributes)
    options = ort.SessionOptions()
    options.register_custom_ops_library(library_path())
    session = ort.InferenceSession(spec.make_model(case.inputs, **case.attributes).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    del options
    key, _ = session.run(None, feeds)
    assert np.array_equal(key, want_key) and feeds["cache"].tobytes() == want["cache"].tobytes()
