"""A model run with no per-call overhead, for the benchmarks: every input and output bound once (IOBinding)."""

import numpy as np

#: ONNX Runtime's CPU allocator starts its buffers on 64-byte boundaries (a cache line); numpy's large arrays
#: start 16 bytes past one. The benchmarks place their arrays like ONNX Runtime, so that a kernel's streamed
#: cache lines fall as they do in a session.
ALIGNMENT = 64


def aligned_empty(shape, dtype, offset: int = 0) -> np.ndarray:
    """An uninitialized C-contiguous array of ``shape`` and ``dtype`` whose data (if any) starts ``offset`` bytes
    past an :data:`ALIGNMENT`-byte boundary (0: on one, as ONNX Runtime places its buffers; 16: where numpy's
    large arrays start)."""
    dtype = np.dtype(dtype)
    if offset % dtype.itemsize or not 0 <= offset < ALIGNMENT:
        raise ValueError(f"offset {offset} is not a multiple of {dtype.itemsize} below {ALIGNMENT}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + 2 * ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT + offset
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def aligned_copy(array: np.ndarray, offset: int = 0) -> np.ndarray:
    """A C-contiguous copy of ``array`` placed like :func:`aligned_empty` (``offset`` bytes past a boundary)."""
    out = aligned_empty(array.shape, array.dtype, offset)
    np.copyto(out, array)
    return out


#: Session config of benchmarks that run several sessions side by side: a pool's threads do not spin for work
#: after a run, taking the cores from the next session's run.
NO_SPINNING = {"session.intra_op.allow_spinning": "0"}


def bound_run(model, feeds: dict, outputs: dict, threads: int, config: dict | None = None, library: str | None = None):
    """``run()`` of ``model`` on the CPU EP (the library loaded, or the build at ``library``; graph rules checked;
    ``config``: session config entries): every graph input is bound once to an OrtValue on ``feeds``' memory,
    each ``outputs`` name to its preallocated numpy array, which every run overwrites. The function keeps all of
    them alive."""
    import onnxruntime as ort

    from ..ort_ops import make_session

    session = make_session(model, intra_op_num_threads=threads, config=config, library=library)
    binding = session.io_binding()
    inputs = []
    for info in session.get_inputs():
        value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(feeds[info.name]))
        inputs.append(value)
        binding.bind_ortvalue_input(info.name, value)
    for name, array in outputs.items():
        binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

    def run():
        session.run_with_iobinding(binding)

    run.keep = (inputs, outputs)
    return run
