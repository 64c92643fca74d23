"""A model run with no per-call overhead, for the benchmarks: every input and output bound once (IOBinding)."""

import numpy as np


def bound_run(model, feeds: dict, outputs: dict, threads: int):
    """``run()`` of ``model`` on the CPU EP (the library loaded, graph rules checked): every graph input is bound
    once to an OrtValue on ``feeds``' memory, each ``outputs`` name to its preallocated numpy array, which
    every run overwrites. The function keeps all of them alive."""
    import onnxruntime as ort

    from ..ort_ops import make_session

    session = make_session(model, intra_op_num_threads=threads)
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
