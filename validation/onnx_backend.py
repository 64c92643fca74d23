"""The conformance vectors through ONNX's own backend-test machinery (``onnx.backend.test``).

:class:`Backend` is an ``onnx.backend.base.Backend`` around any backend of the kit (``reference``, ``ort``,
``module:function``, a callable): ``Backend.using("ort")`` is the class to hand to ONNX's runner. Its
``BackendRep.run`` returns what the vectors' graph outputs list (validation/vectors.py): the node's outputs, then
the cache and scale as the backend left them, so the runner checks the in-place results like any output.
For an invalid call (metadata ``kvcache_op.expect = error``) it returns the cache and scale when the backend
failed, and raises ``AssertionError`` when the backend accepted the call. :class:`ConformanceRunner` is
ONNX's ``Runner`` loaded with one vectors folder only::

    runner = ConformanceRunner(Backend.using("ort"), "vectors/", __name__)
    globals().update(runner.test_cases)          # pytest or unittest collects test_<case>_cpu

The runner compares values with ``np.testing.assert_allclose`` and each case's ``data.json`` (``rtol = atol
= 0``; attention: ``atol`` = the case's largest element bound; bfloat16: a relative 2**-6 the runner always
allows), not bits: ``kvcache-op validate`` compares bits and each attention element with its own bound.
"""

import pathlib
import unittest
from collections import defaultdict

import onnx
import onnx.backend.base
from onnx.backend.test.loader import load_model_tests
from onnx.backend.test.runner import Runner

from .outcome import IN_PLACE, OUTPUTS, run_on_copies
from .vectors import EXPECT_KEY, ERROR_KEY, _signature, runnable_model


class BackendRep(onnx.backend.base.BackendRep):
    """One conformance model prepared for a kit backend."""

    def __init__(self, backend, model: onnx.ModelProto):
        self.backend = backend
        self.model = runnable_model(model)
        node = model.graph.node[0]
        self.op = node.op_type
        self.attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        self.formal = dict(zip(node.input, _signature(node)))
        self.graph_inputs = [info.name for info in model.graph.input]
        self.returned = [info.name for info in model.graph.output]
        props = {p.key: p.value for p in model.metadata_props}
        self.expected_error = props.get(ERROR_KEY) if props.get(EXPECT_KEY) == "error" else None

    def run(self, inputs, **kwargs) -> list:
        """Runs the call on copies of ``inputs`` (a list in graph-input order, or a dict by graph input name);
        returns the graph outputs' values: the node's outputs, then the in-place inputs after the call. A backend
        that changed a read-only input fails the case (``AssertionError`` naming it), as in ``validate``."""
        import numpy as np

        if not isinstance(inputs, dict):
            inputs = dict(zip(self.graph_inputs, inputs))
        feeds = {formal: None for formal in _signature(self.model.graph.node[0])}
        feeds.update({self.formal[name]: np.asarray(value) for name, value in inputs.items()})
        outcome = run_on_copies(self.backend, self.op, feeds, self.attributes, self.model)
        if outcome.crashed:
            raise AssertionError(outcome.error)
        if outcome.changed_inputs:  # the runner compares outputs and the in-place inputs only: checked here
            raise AssertionError("; ".join(outcome.changed_inputs))
        if self.expected_error is not None:
            if outcome.error is None:
                raise AssertionError(f"the backend accepted an invalid call; expected an error "
                                     f"(the reference: {self.expected_error})")
        elif outcome.error is not None:
            raise AssertionError(f"the backend raised {outcome.error}")
        values = {**(outcome.outputs or {}), **outcome.after}
        return [values[self.formal.get(name, name)] for name in self.returned]


class Backend(onnx.backend.base.Backend):
    """An ``onnx.backend.base.Backend`` running the kit's ``backend`` (the reference unless :meth:`using`
    says otherwise); models of ops that backend does not provide are reported as not compatible (skipped)."""

    backend = "reference"
    backend_options: dict = {}
    device = "CPU"
    _loaded = None

    @classmethod
    def using(cls, backend="reference", device: str = "CPU", **options) -> type:
        """A Backend class for ``backend`` (a name with the options of kvcache_op.validation.backends.load_backend,
        a callable with the reference's signature, or a backend object); ``device`` is the ONNX runner device
        its tests run as (``CPU``, or ``CUDA`` for a backend on a GPU)."""
        return type(f"Backend_{getattr(backend, '__name__', backend)}", (cls,),
                    {"backend": backend, "backend_options": dict(options), "device": device.upper(), "_loaded": None})

    @classmethod
    def loaded(cls):
        """The kit backend, loaded once per class."""
        if cls._loaded is None:
            from .validate import as_backend

            cls._loaded = as_backend(cls.backend, **cls.backend_options)
        return cls._loaded

    @classmethod
    def is_compatible(cls, model, device="CPU", **kwargs) -> bool:
        """True for a one-node model of an op the backend provides."""
        nodes = model.graph.node
        return len(nodes) == 1 and nodes[0].op_type in OUTPUTS and nodes[0].op_type in cls.loaded().ops

    @classmethod
    def prepare(cls, model, device="CPU", **kwargs) -> BackendRep:
        """A :class:`BackendRep` of a conformance model; ``unittest.SkipTest`` for other models."""
        if not cls.is_compatible(model, device):
            raise unittest.SkipTest("not a model of an op this backend provides")
        return BackendRep(cls.loaded(), model)

    @classmethod
    def run_model(cls, model, inputs, device="CPU", **kwargs):
        """``prepare(model).run(inputs)``."""
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        """Only the device the backend was declared for, so each case runs once."""
        return device.upper() == cls.device


class ConformanceRunner(Runner):
    """``onnx.backend.test.runner.Runner`` holding the cases of one vectors folder (and not ONNX's own ~4000
    tests, which ``Runner.__init__`` would load): ``test_cases`` / ``test_suite`` / ``include`` / ``exclude``
    work as for ``onnx.backend.test.BackendTest``."""

    CATEGORY = "KVCacheConformance"

    def __init__(self, backend: type, directory, parent_module: str = None, test_kwargs: dict = None):
        # The state Runner.__init__ sets up, without loading ONNX's own test data.
        self.backend = backend
        self._parent_module = parent_module
        self._include_patterns, self._exclude_patterns, self._xfail_patterns = set(), set(), set()
        self._test_kwargs = test_kwargs or {}
        self._test_items = defaultdict(dict)
        folder = pathlib.Path(directory).resolve()
        for case in load_model_tests(data_dir=str(folder.parent), kind=folder.name):
            self._add_model_test(case, self.CATEGORY)
