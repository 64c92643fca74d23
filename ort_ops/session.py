"""Running KeyValueCache models in ONNX Runtime with the cache written in place.

In-place semantics (what the op needs from its caller):

* CPU EP, ``InferenceSession.run`` with C-contiguous numpy arrays of a numpy-native dtype (float32,
  float16, int8, int64): ORT wraps the caller's memory, so the op's writes land in the caller's
  ``cache``/``scale``. A non-contiguous array is copied by ORT first: the writes would be lost, so
  :func:`run_model` refuses it.
* bfloat16 and int4 have no numpy-native dtype: pass them through IOBinding. :func:`ortvalue_for`
  wraps a bfloat16 array without copying; an int4 cache lives in an ORT-allocated tensor
  (:func:`int4_ortvalue`), read and written through :func:`packed_view`.
* CUDA EP: bind device ``OrtValue``s with ``IOBinding.bind_ortvalue_input``; a numpy feed would be
  copied to the device and the writes would land in that temporary copy.
* The cache must be writable: a read-only array (``np.memmap(mode="r")``, ``np.frombuffer`` of
  ``bytes``) is refused by :func:`ortvalue_for` and :func:`run_model` (ONNX Runtime would write into it).
* ``cache``/``scale`` must come straight from a graph input without an initializer
  (:mod:`.graph_rules`): :func:`make_session` refuses other models; the library itself refuses a
  constant initializer when the session is created.
"""

import ctypes
import itertools
import os
import threading

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto

from ..reference.dtypes import BFLOAT16, INT4
from ..reference.quantize import pack_int4, unpack_int4
from . import library_path
from .graph_rules import as_run, check_attribute_names, in_place_inputs, load_model, refuse_crashing_nodes
from .large_models import serialized


#: Environment variable: ONNX Runtime's log severity in this package's sessions (0 verbose .. 4 fatal).
LOG_SEVERITY_ENV = "KVCACHE_OP_ORT_LOG_SEVERITY"


def session_options(intra_op_num_threads: int = 0, library: str | None = None) -> ort.SessionOptions:
    """SessionOptions with the custom-op library registered (0 threads: ORT's default; ``library``: the path of
    another build of it, default :func:`library_path`). ONNX Runtime's own log lines are off (severity 4, fatal
    only): an op's error reaches the caller as the exception ORT raises, with the same text, and ORT would print
    it a second time; ``$KVCACHE_OP_ORT_LOG_SEVERITY`` (0-4) brings them back for debugging."""
    options = ort.SessionOptions()
    options.register_custom_ops_library(library or library_path())
    options.intra_op_num_threads = intra_op_num_threads
    level = os.environ.get(LOG_SEVERITY_ENV, "4")
    if level not in ("0", "1", "2", "3", "4"):
        raise ValueError(f"{LOG_SEVERITY_ENV}={level!r}: expected 0 (verbose) .. 4 (fatal)")
    options.log_severity_level = int(level)
    return options


DISABLED_OPTIMIZERS = ["NchwcTransformer"]


def make_session(model, providers=("CPUExecutionProvider",), intra_op_num_threads: int = 0,
                 disable_cpu_fallback: bool = False, config: dict | None = None,
                 library: str | None = None) -> ort.InferenceSession:
    """An InferenceSession for ``model`` (ModelProto, bytes or path) with the library loaded (``library``: the
    path of another build of it, see :func:`session_options`); ``config``: more session config entries (e.g.
    ``{"session.intra_op.allow_spinning": "0"}``). ONNX Runtime's :data:`DISABLED_OPTIMIZERS` are off.

    ``ValueError`` when an in-place input (``cache``/``scale``) is not fed directly by a graph input, or when
    a node of the package's ops carries an attribute its schema does not know (see :mod:`.graph_rules`);
    ``RuntimeError`` for a node the onnxruntime imported would crash the process on."""
    from .. import spec  # noqa: F401 - registers the schemas the attribute names are checked against

    # Read once, model-local functions inlined once, for the three checks (ONNX Runtime reads a path itself: its
    # external data).
    graph = as_run(load_model(model))
    in_place_inputs(graph)
    check_attribute_names(graph)
    refuse_crashing_nodes(graph)
    options = session_options(intra_op_num_threads, library)
    if disable_cpu_fallback:
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    source = serialized(model) if isinstance(model, onnx.ModelProto) else bytes(model) if isinstance(
        model, bytearray) else model  # ONNX Runtime takes bytes or a path, not a bytearray
    # ONNX Runtime's NCHWc layout transformer crashes the process while loading some float16 decoders (an exported
    # GPT-NeoX in float16, onnxruntime 1.32); it only rewrites NCHW convolutions and pooling, which decoders have none
    # of, so leaving it out costs nothing.
    return ort.InferenceSession(source, options, providers=list(providers), disabled_optimizers=DISABLED_OPTIMIZERS)


def packed_view(value: ort.OrtValue) -> np.ndarray:
    """A writable uint8 numpy view of an int4 OrtValue's packed bytes in host memory (no copy)."""
    count = int(np.prod(value.shape()))
    buffer = (ctypes.c_uint8 * ((count + 1) // 2)).from_address(value.data_ptr())
    return np.ctypeslib.as_array(buffer)


def int4_ortvalue(codes: np.ndarray) -> ort.OrtValue:
    """An ORT-owned int4 tensor (CPU) holding ``codes`` (an ``ml_dtypes.int4`` array)."""
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(codes.shape), TensorProto.INT4, "cpu", 0)
    packed_view(value)[:] = pack_int4(codes)
    return value


def ortvalue_for(array: np.ndarray) -> ort.OrtValue:
    """An OrtValue on ``array``'s memory (bfloat16 reinterpreted without a copy); int4 is copied.

    The OrtValue shares the array's memory, so ONNX Runtime may write it (the ops' caches): a
    read-only array is refused with ``ValueError`` (pass a copy for an input that is only read), int4 too (its
    writes are copied back into it: :func:`run_model`)."""
    if not array.flags.writeable:
        raise ValueError("this array is read-only (e.g. np.memmap(mode='r') or np.frombuffer of bytes), but an "
                         "OrtValue on its memory can be written in place (KeyValueCache writes its cache and "
                         "scale): pass a writable array, or a copy (np.array(x)) for an input that is only read")
    if array.dtype == INT4:
        return int4_ortvalue(array)
    if not array.flags.c_contiguous:
        raise ValueError("this array is not C-contiguous: an OrtValue needs C order, and the in-place writes to an "
                         "op's cache or scale must land in the caller's array, so no copy is made here "
                         "(np.ascontiguousarray makes a copy you then keep)")
    if array.dtype == BFLOAT16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(array)


def to_numpy(value: ort.OrtValue) -> np.ndarray:
    """A numpy copy of a CPU OrtValue, bfloat16 and int4 included."""
    kind = value.data_type()
    if kind == "tensor(bfloat16)":
        count = int(np.prod(value.shape()))
        raw = np.ctypeslib.as_array((ctypes.c_uint16 * max(count, 1)).from_address(value.data_ptr()))[:count]
        return raw.copy().view(BFLOAT16).reshape(value.shape())
    if kind == "tensor(int4)":
        count = int(np.prod(value.shape()))
        return unpack_int4(packed_view(value), count).astype(INT4).reshape(value.shape())
    return value.numpy()


class KeptSessions:
    """The sessions of the last few models (first made, first dropped), each made once: ``get(key, make)`` returns
    the one kept under ``key`` or keeps what ``make()`` returns. Safe from any thread: ``make`` runs outside the lock,
    so two threads may each make one, and the first kept is the one both use."""

    def __init__(self, size: int):
        self.size, self._kept, self._lock = size, {}, threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def clear(self) -> None:
        """Drops every kept session."""
        with self._lock:
            self._kept.clear()

    def get(self, key, make):
        with self._lock:
            kept = self._kept.get(key)
        if kept is None:
            made = make()
            with self._lock:
                kept = self._kept.get(key)
                if kept is None:
                    while len(self._kept) >= self.size:
                        del self._kept[next(iter(self._kept))]
                    kept = self._kept[key] = made
        return kept


_MAX_CACHED_SESSIONS = 8
# model bytes + threads -> (session, in-place input names); the graph is checked once per kept session, not per run
_SESSIONS = KeptSessions(_MAX_CACHED_SESSIONS)


def _refuse_shared_written(inputs: dict, written) -> None:
    """``ValueError`` where two inputs the model writes in place (two caches, a cache and a scale) share memory: the
    graph rules order writes per input, so writes into one buffer through two names would be unordered."""
    arrays = [(name, inputs[name]) for name in sorted(written or ()) if isinstance(inputs.get(name), np.ndarray)]
    for (a, first), (b, second) in itertools.combinations(arrays, 2):
        if np.may_share_memory(first, second):
            raise ValueError(f"inputs {a!r} and {b!r} share memory, and the model writes both in place: their writes "
                             "would land in one buffer, in no set order; pass separate arrays")


def run_model(model, inputs: dict, intra_op_num_threads: int = 0, session=None) -> tuple:
    """Runs a model using the ops on the CPU EP through IOBinding; returns its outputs in graph order as
    numpy arrays (``(key, value)`` for a single KeyValueCache node, ``(attention_output,)`` for
    MultiHeadAttention).

    ``inputs`` maps graph input names to numpy arrays. ``cache``/``scale`` are updated in place
    (an int4 cache through a packed ORT tensor, copied back after the run) and must be writable and
    C-contiguous; other inputs (only read) are copied when they are read-only or not C-contiguous (a
    Fortran-ordered MultiHeadAttention key, a transposed view). When only a ``session`` is given its graph
    cannot be checked, and every input is held to the in-place rule. ``model``: a ModelProto, its bytes or a path.
    The sessions of the last few models given as a ModelProto or bytes are kept for repeated calls (callers in several
    threads may share them); a path's session is made on each call, as its file (and external data) may change
    between calls: pass ``session=make_session(path)`` to run one repeatedly.
    """
    def make():
        return make_session(model, intra_op_num_threads=intra_op_num_threads), in_place_inputs(model)

    if session is None and isinstance(model, (onnx.ModelProto, bytes, bytearray)):
        source = serialized(model) if isinstance(model, onnx.ModelProto) else bytes(model)
        session, written = _SESSIONS.get((source, intra_op_num_threads), make)
    elif session is None:
        session, written = make()
    else:
        written = in_place_inputs(model) if model is not None else None
    _refuse_shared_written(inputs, written)
    binding = session.io_binding()
    values = {}
    for info in session.get_inputs():
        array = np.asarray(inputs[info.name])
        if written is not None and info.name not in written and \
                not (array.flags.writeable and array.flags.c_contiguous):
            array = np.array(array, order="C")  # only read: a C-ordered copy is as good, and ORT needs one
        values[info.name] = ortvalue_for(array)
        binding.bind_ortvalue_input(info.name, values[info.name])
    for info in session.get_outputs():
        binding.bind_output(info.name, "cpu")
    try:
        session.run_with_iobinding(binding)
    finally:
        for name, value in values.items():  # copy int4 caches back (also after an error: unchanged then)
            if value.data_type() == "tensor(int4)":
                inputs[name][...] = to_numpy(value)
    return tuple(to_numpy(v) for v in binding.get_outputs())
