"""What every benchmark shares: the median of repeated calls, and the machine and runtime in words for a
results table."""

import os
import platform
import statistics
import time


def median_seconds(fn, warmup: int, repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (the machines are noisy:
    medians, never means)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ort_version() -> str:
    """The onnxruntime version that runs the benchmark."""
    import onnxruntime

    return onnxruntime.__version__


def cpu_device() -> str:
    """The machine in words, for a results table: processor and usable cores."""
    return f"CPU {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores"


def kernel_build() -> str:
    """", <name> kernel build": the KeyValueCache CPU kernel build that runs (empty for a library from before its
    builds were named)."""
    from ..capi import c_api

    try:
        return f", {c_api.cpu_kernel()} kernel build"
    except AttributeError:
        return ""
