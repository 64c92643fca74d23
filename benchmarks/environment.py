"""Settings the kernels read from the environment at each call, put in force for a block of work."""

import contextlib
import os


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
