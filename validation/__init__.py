"""The backend validation kit: conformance cases, ``validate``, ``fuzz`` and the backend adapters.

Use it to hold a backend of the ops (your own kernels, another runtime, an ONNX Runtime build) to the
reference::

    from kvcache_op import validation

    validation.write_conformance("cases/")                       # every named case, ONNX backend-test layout
    report = validation.validate("cases/", "mypkg.kernels:key_value_cache")
    assert report.passed, report.results
    result = validation.fuzz(validation.load_backend("ort"), examples=200)
    assert result.failure is None

What lives here, in the order data flows: the named cases and the hypothesis strategies that draw calls
(``cases``, ``error_cases``, ``mha_*``, ``rotary_cases``, ``strategies``, ``invalid_strategies``); what the
reference does with a call (``outcome``); the folder layout (``vectors``); the backend adapters
(``adapters``: reference and Python callables; ``ort_adapter``; ``isolated`` with its worker; ``backends``
picks one by name); how a backend's outcome is held to the reference's (``compare``, ``tolerance``,
``slot_map``, ``call_slots``); and the runners that use all of it (``validate``, ``fuzz``, ``onnx_backend``
for ``onnx.backend.test``). Adapters know nothing of the runners.

It may import ``kvcache_op.spec`` (schemas, one-node models), ``kvcache_op.reference`` (the oracle) and
``kvcache_op.ort_ops`` (to run ONNX Runtime); nothing else of the package imports it but the command line.
"""

from .adapters import BackendLoadError
from .backends import load_backend
from .fuzz import fuzz, run_fuzz
from .validate import CaseSelectionError, Report, list_cases, validate, validate_folder
from .vectors import ALL_CASES
from .vectors import write_conformance

__all__ = ["ALL_CASES", "BackendLoadError", "CaseSelectionError", "Report", "fuzz", "list_cases", "load_backend",
           "run_fuzz", "validate", "validate_folder", "write_conformance"]
