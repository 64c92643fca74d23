"""Small transformers decoders and their exports, built once per test session (export takes seconds)."""

import atexit
import functools
import pathlib
import shutil
import tempfile

_FOLDER = pathlib.Path(tempfile.mkdtemp(prefix="kvcache-op-hf-"))
# The exports take tens of megabytes a session; they go when the session's process ends.
atexit.register(shutil.rmtree, _FOLDER, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def model(family: str, seed: int = 0):
    """The seeded tiny model of ``family`` (shared: tests must not change it)."""
    from kvcache_op.hf import tiny_model

    return tiny_model(family, seed=seed)


@functools.lru_cache(maxsize=None)
def exported(family: str, **settings) -> str:
    """Path of ``model(family)`` exported with ``settings`` (``export_model`` keywords)."""
    from kvcache_op.hf import export_model

    name = "-".join([family] + [f"{k}{v}" for k, v in sorted(settings.items())])
    return export_model(model(family), _FOLDER / f"{name}.onnx", **settings)
