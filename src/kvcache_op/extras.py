"""Which optional extra of the package brings a module that failed to import, so that a command missing one says
what to install in one line instead of a traceback."""

from __future__ import annotations

# The extra (pyproject.toml's optional-dependencies) that brings each optional top-level module.
EXTRA_OF_MODULE = {
    "torch": "hf", "onnxscript": "hf", "onnx_ir": "hf", "transformers": "hf",
    "fastapi": "serve", "uvicorn": "serve", "prometheus_client": "serve",
    "ray": "ray",
    "hypothesis": "test", "openai": "test", "httpx": "test", "onnxruntime_genai": "test",
    "matplotlib": "bench",
}
# A command whose own extra is the one to name, whatever it misses (the demo's brings all it needs); else the
# module's. transformers is in both 'hf' and 'serve': a server that misses it needs 'serve'.
_EXTRA_OF_COMMAND = {"demo": "demo"}
_EXTRA_OF_MODULE_IN_COMMAND = {("serve", "transformers"): "serve", ("bench", "torch"): "torch"}


def missing_optional_module(error: BaseException) -> str | None:
    """The top-level name of the optional module (a key of :data:`EXTRA_OF_MODULE`) whose import failed, found on
    ``error`` or the errors it was raised from; None when the failure is not a missing optional module (a broken
    install of one, or anything else, stays the caller's to report in full)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        # Only the package itself missing: "No module named 'torch._C'" is an install of torch that is broken.
        if isinstance(error, ModuleNotFoundError) and error.name in EXTRA_OF_MODULE:
            return error.name
        # The error it was raised from, else the one being handled unless hidden (``raise ... from None``).
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return None


def install_hint(module: str, command: str | None = None) -> str:
    """``"<module> is not installed: pip install 'kvcache-op[<extra>]'"``, the extra being the one ``command``
    (a ``kvcache-op`` subcommand) needs for it."""
    extra = _EXTRA_OF_COMMAND.get(command) or _EXTRA_OF_MODULE_IN_COMMAND.get((command, module)) \
        or EXTRA_OF_MODULE[module]
    return f"{module} is not installed: pip install 'kvcache-op[{extra}]'"
