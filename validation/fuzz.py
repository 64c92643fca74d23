"""Differential fuzzing of a backend against the reference (``kvcache-op fuzz``).

Hypothesis draws calls from the strategies of the project's own tests (kvcache_op.validation.strategies and
kvcache_op.validation.invalid_strategies: valid calls over every allowed attribute value, and invalid ones), runs
each through the backend and the reference, and compares the outcomes as the validator does
(kvcache_op.validation.compare): same outputs and cache/scale, or an error with the in-place inputs
unchanged. The first disagreement is shrunk to a minimal call and written as a reproducer: a conformance
case folder (``test_fuzz_<op>``, the layout of validation/vectors.py) and ``reproduce.py``, which validates the
backend on it.
"""

import dataclasses
import os
import pathlib
import sys

import numpy as np

from .cases import Case
from .outcome import reference_outcome, run_on_copies
from .adapters import OP_FUNCTIONS
from .compare import compare

#: Short names accepted for ops on the command line.
OP_ALIASES = {"kv": "KeyValueCache", "rotary": "KeyCacheRotaryShift", "attention": "MultiHeadAttention",
              "cache-attention": "MultiHeadCacheAttention",
              **{op: op for op in OP_FUNCTIONS}}


def call_strategy(ops, kinds=("valid", "invalid")):
    """Calls (:class:`~kvcache_op.validation.cases.Case`) of ``ops``, valid and/or invalid."""
    from hypothesis import strategies as st

    from . import invalid_strategies, strategies

    # Besides the tests' calls, quantized ones with whole groups of 8 or 16 elements in every sequence: a
    # quantization difference shows in a few codes per thousand, and hypothesis favours small calls.
    dense = strategies.calls(quant_bits=(8, 4), head_dims=(8, 16), min_batch=1, min_len=1)
    valid = {"KeyValueCache": st.one_of(strategies.calls(), dense),
             "KeyCacheRotaryShift": strategies.shift_calls().map(lambda call: Case("fuzz", *call)),
             "MultiHeadAttention": strategies.attention_calls(special_values=True),
             "MultiHeadCacheAttention": strategies.cache_attention_calls()}
    invalid = {"KeyValueCache": invalid_strategies.invalid_kv_calls(),
               "KeyCacheRotaryShift": invalid_strategies.invalid_rotary_calls(),
               "MultiHeadAttention": invalid_strategies.invalid_attention_calls(),
               "MultiHeadCacheAttention": invalid_strategies.invalid_cache_attention_calls()}
    chosen = [table[op] for op in ops for kind, table in (("valid", valid), ("invalid", invalid)) if kind in kinds]
    return st.one_of(chosen)


@dataclasses.dataclass
class FuzzResult:
    """``examples``: calls drawn and run; ``shrink_calls``: calls run while shrinking disagreements; ``by_op``:
    how many drawn calls of each (op, kind); ``failures``: one (the minimal call, the problem lines) per kind of
    call that disagreed (valid calls first), so a backend that both miscomputes and accepts invalid calls gets
    both findings; ``failure``: the first of them, else None; ``reproducer``: the folder written for them."""

    examples: int
    by_op: dict
    failures: list = dataclasses.field(default_factory=list)
    shrink_calls: int = 0
    reproducer: pathlib.Path = None

    @property
    def failure(self):
        """The first finding (valid calls first), or None."""
        return self.failures[0] if self.failures else None


class _Disagreement(Exception):
    pass


def _disagree():
    """Raises :class:`_Disagreement` from one place: hypothesis tells failures apart by where they are raised, and a
    hang's untried smaller calls must read as the same failure as the hang."""
    raise _Disagreement


def _search(backend, ops, kind: str, examples: int, seed: int, tolerance: str, counts: dict) -> tuple:
    """One hypothesis search over the strategies of ``kind`` calls: (the minimal disagreeing call of that kind
    and its lines, or None; the first disagreeing call of the other kind, unshrunk, or None; the calls run while
    shrinking). The invalid-call strategies also draw valid calls (an index pushed out of range may still be in
    range): a disagreement on one of those does not end the search for invalid calls the backend accepts. A call the
    backend did not return from within the timeout is reported as drawn, not shrunk (each try would cost the whole
    timeout). ``counts`` gains the drawn calls per (op, kind)."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed

    failures, other, shrinking, hung = [], [], [0], []

    @settings(max_examples=examples, database=None, deadline=None, derandomize=False, verbosity=Verbosity.quiet,
              phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @hypothesis_seed(seed)
    @given(call_strategy(ops, (kind,)))
    def check(case):
        expected = reference_outcome(case.op, case.inputs, case.attributes)
        call_kind = "invalid" if expected.error is not None else "valid"
        if failures:  # past the first disagreement, hypothesis only shrinks
            if hung:  # each try would wait the whole timeout: the hanging call is reported as drawn
                _disagree()
            shrinking[0] += 1
        else:
            counts[(case.op, call_kind)] = counts.get((case.op, call_kind), 0) + 1
        got = run_on_copies(backend, case.op, case.inputs, case.attributes)
        lines = compare(case.op, case.inputs, case.attributes, expected, got, tolerance)
        if lines:
            finding = (Case(f"fuzz_{case.op}_{call_kind}", case.inputs, case.attributes, call_kind == "invalid"), lines)
            if call_kind != kind:
                other[:] = other or [finding]
                return
            if got.timed_out:
                hung.append(True)
                finding = (finding[0], lines + ["(not shrunk: each smaller call tried would wait the whole timeout)"])
            failures.append(finding)
            _disagree()

    from hypothesis.errors import Flaky

    try:
        check()
    except _Disagreement:
        pass
    except Flaky:  # the disagreement did not come back on replay: a nondeterministic backend, still a finding
        if not failures:
            raise
        case, lines = failures[-1]
        failures[-1] = (case, lines + ["(did not reproduce when hypothesis replayed it: the backend is "
                                       "nondeterministic, or its outcome depends on earlier calls)"])
    # hypothesis replays the minimal example last
    return (failures[-1] if failures else None), (other[0] if other else None), shrinking[0]


def fuzz(backend, *, examples: int = 200, seed: int = 0, ops=None, kinds=("valid", "invalid"),
         tolerance: str = "exact", out=None, backend_spec=None, backend_options=None) -> FuzzResult:
    """Draws ``examples`` calls of ``ops`` (default: every op ``backend`` provides; ``ValueError`` for an op asked for
    that it does not provide), shared between the kinds of call in ``kinds``, runs each through ``backend`` and the
    reference from hypothesis seed ``seed``, and shrinks the first disagreement of each kind; when ``out`` is
    given, writes their reproducer there (``backend_spec`` and ``backend_options`` say how ``reproduce.py``
    loads the backend again; a backend given by name is loaded again by that name). ``backend`` takes every form
    :func:`~kvcache_op.validation.validate` takes: a name (``reference``, ``ort``, ``module:function``), a callable
    with the reference's KeyValueCache signature, an object with the reference's function names, or a backend
    object (kvcache_op.validation.backends); a name is loaded with ``backend_options`` (``ort_library``,
    ``provider``, ``provider_options``). A reproducer (``out``) needs a backend reproduce.py can load: a name, or
    ``backend_spec`` for one given otherwise (``ValueError`` before any fuzzing)."""
    from .validate import as_backend

    if isinstance(backend, str):
        backend_spec = backend_spec or backend
    runner = as_backend(backend, **(backend_options or {}))  # the options load a name; other forms take none
    if out is not None and backend_spec is None and runner is not backend:  # a function or object wrapped here
        raise ValueError("a reproducer loads the backend by name: give backend_spec ('module:function') with out, "
                         "or pass the backend by that name")
    try:
        return _fuzz(runner, examples, seed, ops, kinds, tolerance, out, backend_spec, backend_options)
    finally:
        if runner is not backend:
            runner.close()


def _fuzz(backend, examples, seed, ops, kinds, tolerance, out, backend_spec, backend_options) -> FuzzResult:
    if examples < 1:
        raise ValueError(f"examples must be >= 1, got {examples}")
    missing = [op for op in (ops or ()) if op not in backend.ops]
    if missing:  # asked for by name: never fuzzed silently as if it passed
        raise ValueError(f"the backend does not provide {', '.join(missing)} (it has: {', '.join(sorted(backend.ops))})")
    ops = list(ops or sorted(backend.ops))
    if not ops:
        raise ValueError("the backend provides none of the ops")
    kinds = [k for k in ("valid", "invalid") if k in kinds]
    result, found = FuzzResult(0, {}), {}
    for i, kind in enumerate(kinds):
        share = examples // len(kinds) + (1 if i < examples % len(kinds) else 0)
        if not share:
            continue
        shrunk, aside, shrink_calls = _search(backend, ops, kind, share, seed, tolerance, result.by_op)
        result.shrink_calls += shrink_calls
        if shrunk is not None:
            found[kind] = shrunk
        if aside is not None:  # kept only where that kind's own search found nothing
            found.setdefault("valid" if kind == "invalid" else "invalid", aside)
    result.failures = [found[k] for k in ("valid", "invalid") if k in found]
    result.examples = sum(result.by_op.values())
    if result.failures and out is not None:
        result.reproducer = write_reproducer(out, result.failures, backend_spec or getattr(backend, "name", "?"),
                                             backend_options or {}, tolerance)
    return result


_SCRIPT = '''"""Reproduces a disagreement that 'kvcache-op fuzz' found between a backend and the reference.

{lines}

Run it from anywhere: python {script}
(the backend module must be importable: from {cwd} or PYTHONPATH).
"""

import pathlib
import sys

from kvcache_op.validation.validate import validate_folder

sys.path.insert(0, {cwd!r})
here = pathlib.Path(__file__).resolve().parent
sys.exit(validate_folder(here, {backend!r}, tolerance={tolerance!r}, **{options!r}))
'''


def write_reproducer(out, findings: list, backend_spec: str, backend_options: dict, tolerance: str) -> pathlib.Path:
    """Writes ``out/test_<case>/`` for each (call, lines) of ``findings`` (as conformance cases) and
    ``out/reproduce.py``, which validates the backend on them; returns ``out``."""
    from .vectors import write_case

    import shutil

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("test_fuzz_*"):  # an earlier reproducer in the same folder
        shutil.rmtree(old)
    lines = []
    for case, problems in findings:
        write_case(case, out)
        lines += [case.name + ":"] + ["    " + line for line in problems]
    options = {k: v for k, v in backend_options.items() if v}
    text = _SCRIPT.format(lines="\n".join(lines), script=out / "reproduce.py", cwd=os.getcwd(), backend=backend_spec,
                          tolerance=tolerance, options=options)
    (out / "reproduce.py").write_text(text)
    return out


def describe(case: Case) -> list:
    """Lines describing a call: its op and attributes, the shape and dtype of each input, and the values of the
    small integer inputs (the indices) that decide what it stores and loads."""
    def one(name, value):
        if value is None:
            return f"{name}=absent"
        text = f"{name}={value.dtype.name}{list(value.shape)}"
        if value.dtype.kind in "iu" and value.size <= 64 and name not in ("cache",):
            text += " " + np.array2string(value, separator=", ", threshold=64).replace("\n", "")
        return text

    return [f"{case.op}({', '.join(one(k, v) for k, v in case.inputs.items())})",
            "attributes: " + ", ".join(f"{k}={v}" for k, v in case.attributes.items())]


def run_fuzz(backend_spec: str, *, examples=200, seed=0, ops=None, kinds=("valid", "invalid"), tolerance="exact",
             out="fuzz-reproducer", progress=print, **backend_options) -> int:
    """The ``kvcache-op fuzz`` command: loads the backend, fuzzes, prints the outcome; returns the exit status
    (0: no disagreement, 1: one found and its reproducer written)."""
    from .backends import load_backend

    try:
        import hypothesis  # noqa: F401 - a test dependency, needed here only
    except ImportError:
        raise ValueError("fuzzing needs hypothesis: pip install 'kvcache-op[test]' (or pip install hypothesis)") from None
    load_options = {k: backend_options[k] for k in ("ort_library", "provider", "provider_options", "isolate", "timeout")
                    if k in backend_options}
    backend = load_backend(backend_spec, **load_options)
    try:
        result = fuzz(backend, examples=examples, seed=seed, ops=[OP_ALIASES[o] for o in ops] if ops else None,
                      kinds=kinds, tolerance=tolerance, out=out, backend_spec=backend_spec,
                      backend_options={k: v for k, v in load_options.items() if k != "timeout"})
    finally:
        backend.close()
    ran = ", ".join(f"{n} {kind} {op}" for (op, kind), n in sorted(result.by_op.items()))
    shrunk = f"; {result.shrink_calls} more while shrinking" if result.shrink_calls else ""
    progress(f"{result.examples} calls drawn and run against the reference (seed {seed}): {ran}{shrunk}")
    if result.failure is None:
        progress("no disagreement found")
        return 0
    for case, lines in result.failures:
        kind = "an invalid call" if case.expect_error else "a valid call"
        progress(f"DISAGREEMENT on {kind} (shrunk to a minimal call):")
        for line in describe(case) + lines:
            progress("    " + line)
    progress(f"reproducer: {result.reproducer}/ (run: {sys.executable} {result.reproducer}/reproduce.py)")
    return 1
