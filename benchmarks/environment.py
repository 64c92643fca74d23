"""Settings the kernels read from the environment at each call, put in force for a block of work."""

import contextlib
import os
import shlex
import sys


@contextlib.contextmanager
def environment(settings: dict):
    """``settings`` in os.environ (a value of None unsets the name) for the block; every name as it was before
    afterwards, whether the block returns or raises."""
    before = {key: os.environ.get(key) for key in settings}
    try:
        _apply(settings)
        yield
    finally:
        _apply(before)


def _apply(settings: dict) -> None:
    for key, value in settings.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


#: The switches the CPU kernels read at each call (cpu/kv_cpu_dispatch.cc), with the values each takes: a tuple of
#: words, or the least whole number.
CPU_SWITCHES = {
    "KVCACHE_OP_CPU_KERNEL": ("avx512", "avx2", "generic"), "KVCACHE_OP_CPU_VENDOR": ("amd", "intel"),
    "KVCACHE_OP_STORES": ("side-by-side", "stream", "cached"), "KVCACHE_OP_CACHED_GATHER": ("head-runs", "tokens"),
    "KVCACHE_OP_CODE_STORES": ("stream", "cached"), "KVCACHE_OP_HEAD_PREFETCH": ("l2", "l1"),
    "KVCACHE_OP_CPU_VERBOSE": ("1", "0"), "KVCACHE_OP_STREAMED_HEADS": 1, "KVCACHE_OP_TOKEN_STREAMS": 1,
    "KVCACHE_OP_GATHER_TILE": 0, "KVCACHE_OP_TOKEN_PREFETCH": 0,
}
#: The switches the CUDA kernels' routes read at each call (cuda/kv_cuda_run.cc).
CUDA_SWITCHES = ("KVCACHE_OP_CUDA_DECODE_KERNEL", "KVCACHE_OP_CUDA_MMA", "KVCACHE_OP_CUDA_MMA_DECODE")
#: What a results file records of the environment: the library loaded, the kernels' switches, BLAS threads. No other
#: variable: the build's settings (KVCACHE_OP_CUDA, KVCACHE_OP_ORT_INCLUDE_DIR, ...) do not change what runs, and
#: another may hold a secret (KVCACHE_OP_API_KEY).
RECORDED_SETTINGS = frozenset(CPU_SWITCHES) | frozenset(CUDA_SWITCHES) | {"KVCACHE_OP_LIBRARY", "OPENBLAS_NUM_THREADS"}


def recorded_command(module: str, argv=None) -> str:
    """``python -m module ARGV`` as a results file records it (``argv`` None: the process's own arguments), behind
    the settings in force that change what runs (:data:`RECORDED_SETTINGS`); every word shell-quoted, so the line
    can be run again."""
    argv = sys.argv[1:] if argv is None else argv
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k in RECORDED_SETTINGS]
    return " ".join(env + [f"python -m {module}"] + [shlex.quote(a) for a in argv])
