"""Turns a ``--backend`` name (``reference``, ``ort`` or ``module:function``) into a backend adapter, in a
worker process when a crash of the backend is possible."""

from .adapters import BackendLoadError, ReferenceBackend, import_callables
from .isolated import IsolatedBackend


def load_backend(spec: str = "reference", *, ort_library=None, provider=None, provider_options=None,
                 isolate=None, timeout=300.0):
    """The backend ``spec`` names: ``reference``, ``ort`` (ONNX Runtime; ``ort_library`` another custom-op
    library, ``provider``/``provider_options`` another execution provider) or ``module:function``.

    ``isolate``: run it in a worker process (a crash or a hang then fails only the call that caused it);
    None chooses: yes for ``ort`` and ``module:function``, no for the reference. :class:`BackendLoadError`
    (one line) when it cannot be loaded."""
    options = dict(ort_library=ort_library, provider=provider, provider_options=dict(provider_options or {}))
    if spec != "ort" and (ort_library or provider or provider_options):
        raise BackendLoadError("--ort-library, --provider and --provider-option apply to --backend ort only")
    if isolate is None:
        isolate = spec != "reference"
    if isolate:
        return IsolatedBackend(spec, options, timeout=timeout)
    return make_backend(spec, options)


def make_backend(spec: str, options: dict):
    """The backend ``spec`` names, in this process (see :func:`load_backend`)."""
    if spec == "reference":
        return ReferenceBackend()
    if spec == "ort":
        from .ort_adapter import OrtBackend

        return OrtBackend(**options)
    return import_callables(spec)
