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

from .cases import Case
from .outcome import reference_outcome, run_on_copies
from .adapters import OP_FUNCTIONS
from .compare import compare

#: Short names accepted for ops on the command line.
OP_ALIASES = {"kv": "KeyValueCache", "rotary": "KeyCacheRotaryShift", "attention": "MultiHeadAttention",
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
             "MultiHeadAttention": strategies.attention_calls()}
    invalid = {"KeyValueCache": invalid_strategies.invalid_kv_calls(),
               "KeyCacheRotaryShift": invalid_strategies.invalid_rotary_calls(),
               "MultiHeadAttention": invalid_strategies.invalid_attention_calls()}
    chosen = [table[op] for op in ops for kind, table in (("valid", valid), ("invalid", invalid)) if kind in kinds]
    return st.one_of(chosen)


@dataclasses.dataclass
class FuzzResult:
    """``examples``: calls run; ``by_op``: how many of each op and kind; ``failure``: (the minimal call, the
    problem lines) of a disagreement, else None; ``reproducer``: the folder written for it."""

    examples: int
    by_op: dict
    failure: tuple = None
    reproducer: pathlib.Path = None


class _Disagreement(Exception):
    pass


def fuzz(backend, *, examples: int = 200, seed: int = 0, ops=None, kinds=("valid", "invalid"),
         tolerance: str = "exact", out=None, backend_spec=None, backend_options=None) -> FuzzResult:
    """Runs ``examples`` calls of ``ops`` (default: every op ``backend`` provides) through ``backend`` (a
    backend object, kvcache_op.validation.backends) and the reference, from hypothesis seed ``seed``; shrinks the
    first disagreement and, when ``out`` is given, writes its reproducer there (``backend_spec`` and
    ``backend_options`` say how ``reproduce.py`` loads the backend again)."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed

    ops = [op for op in (ops or sorted(backend.ops)) if op in backend.ops]
    if not ops:
        raise ValueError(f"the backend provides none of the ops asked for (it has: {', '.join(sorted(backend.ops))})")
    counts, failures = {}, []

    @settings(max_examples=examples, database=None, deadline=None, derandomize=False, verbosity=Verbosity.quiet,
              phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @hypothesis_seed(seed)
    @given(call_strategy(ops, kinds))
    def check(case):
        expected = reference_outcome(case.op, case.inputs, case.attributes)
        kind = "invalid" if expected.error is not None else "valid"
        counts[(case.op, kind)] = counts.get((case.op, kind), 0) + 1
        got = run_on_copies(backend, case.op, case.inputs, case.attributes)
        lines = compare(case.op, case.inputs, case.attributes, expected, got, tolerance)
        if lines:
            failures.append((Case(f"fuzz_{case.op}", case.inputs, case.attributes, expected.error is not None), lines))
            raise _Disagreement

    try:
        check()
    except _Disagreement:
        pass
    result = FuzzResult(sum(counts.values()), counts)
    if failures:
        result.failure = failures[-1]  # hypothesis replays the minimal example last
        if out is not None:
            result.reproducer = write_reproducer(out, *result.failure, backend_spec or getattr(backend, "name", "?"),
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


def write_reproducer(out, case: Case, lines: list, backend_spec: str, backend_options: dict, tolerance: str) -> pathlib.Path:
    """Writes ``out/test_<case>/`` (the call as a conformance case) and ``out/reproduce.py``; returns ``out``."""
    from .vectors import write_case

    import shutil

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("test_fuzz_*"):  # an earlier reproducer in the same folder
        shutil.rmtree(old)
    write_case(case, out)
    options = {k: v for k, v in backend_options.items() if v}
    text = _SCRIPT.format(lines="\n".join(lines), script=out / "reproduce.py", cwd=os.getcwd(), backend=backend_spec,
                          tolerance=tolerance, options=options)
    (out / "reproduce.py").write_text(text)
    return out


def describe(case: Case) -> list:
    """Lines describing a call: its op, attributes and the shape and dtype of each input."""
    shapes = ", ".join(f"{k}={'absent' if v is None else f'{v.dtype.name}{list(v.shape)}'}"
                       for k, v in case.inputs.items())
    return [f"{case.op}({shapes})", "attributes: " + ", ".join(f"{k}={v}" for k, v in case.attributes.items())]


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
    progress(f"{result.examples} calls run against the reference (seed {seed}): {ran}")
    if result.failure is None:
        progress("no disagreement found")
        return 0
    case, lines = result.failure
    progress("DISAGREEMENT (shrunk to a minimal call):")
    for line in describe(case) + lines:
        progress("    " + line)
    progress(f"reproducer: {result.reproducer}/ (run: {sys.executable} {result.reproducer}/reproduce.py)")
    return 1
