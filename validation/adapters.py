"""Backends the conformance kit validates and fuzzes: the reference, ONNX Runtime with a custom-op library,
or a user's Python callables.

A backend runs one call of an op and returns what happened as an :class:`~kvcache_op.validation.outcome.Outcome`;
it never raises for the backend's own failures (they become ``Outcome.error``), so one failing call never
stops a run. This module holds what every adapter shares and the in-process adapters (the reference, Python
callables); :mod:`.ort_adapter` runs ONNX Runtime, :mod:`.isolated` any adapter in a worker process, and
:func:`kvcache_op.validation.backends.load_backend` picks one from a ``--backend`` name. Adapters know
nothing of the runners (validate, fuzz) that use them.

A ``module:function`` backend is a Python callable with the reference's signature
(:func:`kvcache_op.reference.key_value_cache`): numpy arrays in, numpy arrays out, ``cache`` and ``scale``
written in place, an exception for an invalid call; a function named as another op's reference function
(``mymodule:multi_head_attention``) is that op's. ``module:name`` may instead name an object (a module,
a class instance, a namespace) with any of the attributes ``key_value_cache``, ``multi_head_attention``,
``key_cache_rotary_shift`` and ``multi_head_cache_attention``, each with the reference's signature of that op; cases of the other ops are then
skipped. The module is imported from the current directory or ``PYTHONPATH``.
"""

import contextlib
import importlib
import os
import sys

import numpy as np

from .outcome import OUTPUTS, Outcome, in_place_after, shared_memory

#: The reference function name of each op (what a ``module:object`` backend provides).
OP_FUNCTIONS = {"KeyValueCache": "key_value_cache", "MultiHeadAttention": "multi_head_attention",
                "KeyCacheRotaryShift": "key_cache_rotary_shift", "MultiHeadCacheAttention": "multi_head_cache_attention"}
ALL_OPS = frozenset(OP_FUNCTIONS)


class BackendLoadError(Exception):
    """The backend named on the command line cannot be loaded; the message is one line saying why."""


def error_text(error: BaseException) -> str:
    """``Type: message`` of an exception, on one line."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _as_outputs(op: str, result) -> dict:
    """The output name -> numpy array of a callable's return value (a tuple for KeyValueCache)."""
    names = OUTPUTS[op]
    values = tuple(result) if len(names) > 1 else (result,)
    if len(values) != len(names):
        raise TypeError(f"{OP_FUNCTIONS[op]} returned {len(values)} values, expected {len(names)} ({', '.join(names)})")
    for name, value in zip(names, values):
        if value is None:
            raise TypeError(f"{OP_FUNCTIONS[op]} returned None for {name}")
    return {name: np.asarray(value) for name, value in zip(names, values)}


def _summary(value) -> str:
    """A short description of a backend's return value for an error line."""
    if value is None:
        return "None"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def run_reference(model, inputs: dict) -> tuple:
    """Runs ``model`` with onnx's ReferenceEvaluator and the ops' OpRun classes; returns its outputs;
    ``inputs`` (copies) are written in place."""
    from onnx.reference import ReferenceEvaluator

    from ..reference import KeyCacheRotaryShift, KeyValueCache, MultiHeadAttention, MultiHeadCacheAttention

    evaluator = ReferenceEvaluator(model, new_ops=[KeyValueCache, MultiHeadAttention, KeyCacheRotaryShift,
                                                   MultiHeadCacheAttention])
    return tuple(evaluator.run(None, inputs))


def run_ort(model, inputs: dict) -> tuple:
    """Runs ``model`` in ONNX Runtime's CPU EP with the custom-op library; returns its outputs; ``inputs``
    written in place."""
    from ..ort_ops import run_model

    return run_model(model, inputs)


class _ProcessExit(BaseException):
    """Raised instead of ending the process when an in-process backend calls ``os._exit``."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def _no_process_exit():
    """While a backend runs in this process, ``os._exit`` (the same function as ``posix._exit``) raises instead
    of ending the process: an in-process run must never end early with status 0."""
    saved = os._exit

    def refuse(code):
        raise _ProcessExit(code)

    os._exit = refuse
    posix = sys.modules.get("posix")
    if posix is not None:
        posix._exit = refuse
    try:
        yield
    finally:
        os._exit = saved
        if posix is not None:
            posix._exit = saved


class CallableBackend:
    """Python callables with the reference's signatures (op -> callable); runs them in this process."""

    def __init__(self, functions: dict, name: str):
        self.functions = dict(functions)
        self.ops = frozenset(functions)
        self.name = name
        self._earlier = {}  # the last call's in-place arrays -> their bytes once it returned
        self._outputs = {}  # the last call's outputs

    def _earlier_writes(self, op: str, inputs: dict) -> tuple:
        """Lines for the last call's in-place arrays this call changed (a backend replaying a kept pointer writes
        memory the caller owns and no longer passes); notes this call's for the next."""
        lines = tuple(f"{name}: the backend changed the {name} of an earlier call, which this call was not given"
                      for name, (array, before) in self._earlier.items() if array.tobytes() != before)
        self._earlier = {name: (array, array.tobytes()) for name, array in in_place_after(op, inputs).items()
                         if isinstance(array, np.ndarray)}
        return lines

    def _reused_outputs(self, outputs: dict) -> tuple:
        """Lines for this call's outputs in memory the last call's outputs still hold (a scratch buffer reused: the
        caller's earlier outputs change under it); keeps this call's outputs for the next (alive, so their memory is
        never another's)."""
        lines = tuple(f"{name}: the backend returned memory that an earlier call's output {earlier} still holds"
                      for name, output in outputs.items() for earlier, kept in self._outputs.items()
                      if isinstance(output, np.ndarray) and output.size and kept.size and np.shares_memory(output, kept))
        self._outputs = {name: output for name, output in outputs.items() if isinstance(output, np.ndarray)}
        return lines

    def run(self, op: str, inputs: dict, attributes: dict, model=None) -> Outcome:
        """Calls the op's function on ``inputs`` (which it may write); an exception it raises becomes the outcome's
        error. Ending the process (``sys.exit``, ``os._exit``) or raising any other ``BaseException`` but
        ``KeyboardInterrupt`` fails the call (crashed): it would otherwise end or break the run as if it passed. So
        does returning something that is not the op's outputs (``None`` for an invalid call, say): that is the
        backend's failure, never an error it raised, so it cannot pass an invalid call. Changing the previous call's
        cache or scale, returning memory the previous call's outputs hold, or an output that shares memory with an
        input it may not (or with another output), is noted in the outcome's ``changed_inputs``."""
        try:
            with _no_process_exit():
                result = self.functions[op](**inputs, **attributes)
        except SystemExit as error:
            return Outcome(None, {}, crashed=True, error=f"the backend called sys.exit({error.code!r}): a backend "
                                                          "must return or raise, never end the process")
        except _ProcessExit as error:
            return Outcome(None, {}, crashed=True, error=f"the backend called os._exit({error.code!r}): a backend "
                                                          "must return or raise, never end the process")
        except Exception as error:  # noqa: BLE001 - any failure of the backend is its outcome
            return Outcome(None, in_place_after(op, inputs), error=error_text(error),
                           changed_inputs=self._earlier_writes(op, inputs))
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # noqa: BLE001 - GeneratorExit, a test framework's outcome exceptions ...
            return Outcome(None, {}, crashed=True, error=f"the backend raised {error_text(error)}, which is not an "
                                                          "Exception: a backend must return or raise an Exception")
        earlier = self._earlier_writes(op, inputs)
        try:
            outputs = _as_outputs(op, result)
        except Exception as error:  # noqa: BLE001 - whatever the return value is, it is not the op's outputs
            return Outcome(None, {}, crashed=True,
                           error=f"the backend returned {_summary(result)}, not {OP_FUNCTIONS[op]}'s outputs "
                                 f"({error_text(error)}): a backend must return its outputs or raise")
        return Outcome(outputs, in_place_after(op, inputs),
                       changed_inputs=earlier + self._reused_outputs(outputs) + shared_memory(op, inputs, outputs))

    def close(self):
        """Nothing to release."""


class ReferenceBackend:
    """The reference through ``onnx.reference.ReferenceEvaluator`` on the call's one-node model (so the
    OpRun classes are what is checked)."""

    name = "reference"
    ops = ALL_OPS

    def run(self, op: str, inputs: dict, attributes: dict, model=None) -> Outcome:
        """Runs ``model`` (built from the call when None) with the reference ops; inputs written in place."""
        from .vectors import node_model

        try:
            model = model if model is not None else node_model(op, inputs, attributes)
            results = run_reference(model, graph_feeds(model, inputs))
            return Outcome(dict(zip(OUTPUTS[op], results)), in_place_after(op, inputs))
        except Exception as error:  # noqa: BLE001
            return Outcome(None, in_place_after(op, inputs), error=error_text(error))

    def close(self):
        """Nothing to release."""


def graph_feeds(model, inputs: dict) -> dict:
    """Graph input name -> array for a one-node ``model``, from ``inputs`` keyed by the op's formal input
    names (the graph may name them otherwise, e.g. ppl.pmx's ``kv_scale``)."""
    from .vectors import _signature

    node = model.graph.node[0]
    formal = dict(zip(node.input, _signature(node)))
    return {info.name: inputs[formal[info.name]] for info in model.graph.input}


def import_callables(spec: str) -> CallableBackend:
    """The :class:`CallableBackend` of ``module:name`` (see the module docstring); :class:`BackendLoadError`
    with one line when it cannot be imported or names nothing usable."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise BackendLoadError(f"--backend {spec!r}: expected reference, ort or module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # importable from the current directory, as the command line promises
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        raise BackendLoadError(f"--backend {spec}: give the module's name (mybackend:function), not a file path; "
                               "run from its folder or put that folder on PYTHONPATH")
    try:
        with _no_process_exit():
            target = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except (SystemExit, _ProcessExit) as error:  # a script without a main guard: the run would end "passed"
        raise BackendLoadError(f"--backend {spec}: importing {module_name!r} ended the process (exit status "
                               f"{error.code!r}); a backend module must only define its functions when imported "
                               "(put a script's work under if __name__ == '__main__')") from None
    except BaseException as error:  # noqa: BLE001 - whatever the import raises, one line says it
        raise BackendLoadError(f"--backend {spec}: cannot import module {module_name!r} ({error_text(error)})") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise BackendLoadError(f"--backend {spec}: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    functions = {op: getattr(target, name) for op, name in OP_FUNCTIONS.items() if callable(getattr(target, name, None))}
    if not functions:
        if not callable(target):
            raise BackendLoadError(f"--backend {spec}: {attribute!r} is neither callable nor has any of "
                                   f"{', '.join(OP_FUNCTIONS.values())}")
        # A function named as one op's reference function is that op's (multi_head_attention is not a cache).
        named = [op for op, name in OP_FUNCTIONS.items() if attribute.split(".")[-1] == name]
        functions = {named[0] if named else "KeyValueCache": target}
    return CallableBackend(functions, spec)
