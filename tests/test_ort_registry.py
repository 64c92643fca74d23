"""Registering the library in many SessionOptions does not grow the native heap: the library adds one
process-wide op domain to every SessionOptions instead of allocating a new one each time, and allocates
nothing that outlives its own unloading.

What ONNX Runtime does on each registration (the same in 1.31.1 and 1.32.0):
OrtSessionOptions::RegisterCustomOpsLibrary (onnxruntime/core/session/abi_session_options.cc; the Python
register_custom_ops_library in onnxruntime_pybind_state.cc calls it) dlopens the library
(Env::LoadDynamicLibrary), calls RegisterCustomOps, and hands the handle to
SessionOptions::AddCustomOpLibraryHandle (core/framework/session_options.cc): a shared_ptr<LibraryHandles>
that sessions created from those options share. ~LibraryHandles (core/framework/library_handles.cc,
UnloadLibraries) dlcloses it. So when the last SessionOptions or session holding the library goes and nothing
else has it open, glibc unmaps it, and the next registration loads it afresh: its static initializers run
again, and anything they put on the heap without freeing it at unload is lost once per registration.
ONNX Runtime's own cost is nil: with the library kept loaded, 3000 registrations grow the heap by 0 bytes.

The check runs in a fresh interpreter: in a pytest process the library is often held open by ctypes (the C
API binding, kvcache_op.capi.c_api.library, which conftest.py calls while collecting GPU tests), and that
extra handle keeps ONNX Runtime's dlclose from unloading it, hiding a leak at load time in a full run while
the same test fails alone."""

import ctypes
import ctypes.util
import gc
import os

import onnxruntime as ort
import pytest

from kvcache_op.ort_ops import library_path

REGISTRATIONS = 3000
# Well below either known leak: a domain per registration (about 0.5 MB for 3000 in a CPU build, 2 MB in the
# old code) or the ops' registry re-allocated at every load (about 1 KB a registration in a CPU build).
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


def _mapped(path):
    """Whether ``path`` is mapped in this process (None where /proc/self/maps cannot be read)."""
    try:
        with open("/proc/self/maps") as maps:
            return any(line.rstrip("\n").endswith(path) for line in maps)
    except OSError:
        return None


def check_heap_bounded():
    """The check itself, run by the test below in a fresh interpreter (tests/isolated.py)."""
    path = os.path.realpath(library_path())
    _register(200, path)  # warm up: ONNX Runtime's and python's lazily created state, the first loads
    before = _allocated_bytes()
    _register(REGISTRATIONS, path)
    growth = _allocated_bytes() - before
    kept = _mapped(path)
    where = {True: "the library stayed loaded, so the growth is per registration",
             False: "ONNX Runtime unloaded the library with its last SessionOptions, so the growth may be "
                    "allocations made when the library is loaded (its static initializers) and never freed",
             None: "whether the library stayed loaded is unknown"}[kept]
    assert growth < MAX_GROWTH_BYTES, (
        f"native heap grew by {growth} bytes ({growth / REGISTRATIONS:.0f} a registration) over {REGISTRATIONS} "
        f"registrations; {where}")


def test_registering_in_many_session_options_keeps_the_heap_bounded():
    from isolated import assert_passes_isolated

    if _allocated_bytes() is None:
        pytest.skip("glibc mallinfo2 is not available here")
    assert_passes_isolated("test_ort_registry", "check_heap_bounded()")


def test_sessions_from_options_registered_after_others_were_dropped_still_run():
    """Sessions still run from options registered after earlier ones were dropped (whether or not the
    library was unloaded and loaded again in between)."""
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
