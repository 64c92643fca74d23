"""Settings the kernels read from the environment at each call, put in force for a block of work."""

import contextlib
import os
import shlex


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


def recorded_command(module: str, argv: list) -> str:
    """``python -m module ARGV`` as a results file records it, behind the settings in force that change what runs:
    the library and the kernels' switches (``KVCACHE_OP_*``) and BLAS threads; every word shell-quoted."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if k.startswith("KVCACHE_OP_") or k == "OPENBLAS_NUM_THREADS"]
    return " ".join(env + [f"python -m {module}"] + [shlex.quote(a) for a in argv])
