"""Runs conformance vectors through a backend and reports, case by case, what differs.

Python API: :func:`validate` (a :class:`Report`), :func:`validate_folder` (the exit status, as the command
line prints it), :func:`list_cases`. The backend is ``reference``, ``ort`` or ``module:function`` (see
kvcache_op.validation.backends), a Python callable with the reference's signature, or a backend object. Each
case runs on its own copies of the inputs; a backend's exception fails that case only, and backends that
can crash run in a worker process (a crash fails the case that caused it, and the run goes on).
"""

import dataclasses
import fnmatch
import pathlib

from .outcome import run_on_copies
from .vectors import EXPECT_KEY, case_name, read_case
from .vectors import list_cases as case_folders
from .adapters import ALL_OPS, CallableBackend, OP_FUNCTIONS, error_text, run_ort, run_reference
from .backends import load_backend
from .compare import compare
from .fingerprints import committed


class CaseSelectionError(ValueError):
    """The folder or the ``--case`` names select nothing; the message is one line."""


@dataclasses.dataclass
class CaseResult:
    """One case: ``status`` is ``ok``, ``FAIL`` or ``skip``; ``lines`` say why."""

    name: str
    op: str
    kind: str  # "valid" or "invalid"
    status: str
    lines: list
    stale: bool = False  # the folder was not written from this kit's definition of the case


@dataclasses.dataclass
class Report:
    """Every case's result, in the order run."""

    backend: str
    tolerance: str
    results: list

    def count(self, status: str) -> int:
        """How many cases ended with ``status``."""
        return sum(r.status == status for r in self.results)

    @property
    def passed(self) -> bool:
        """True when no case failed and at least one ran."""
        return self.count("FAIL") == 0 and self.count("ok") > 0


def case_info(folder) -> tuple:
    """(name, op, kind) of a case folder, from its model alone."""
    import onnx

    model = onnx.load_model(pathlib.Path(folder) / "model.onnx", load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props}
    return case_name(folder), model.graph.node[0].op_type, "invalid" if props.get(EXPECT_KEY) == "error" else "valid"


def select_cases(directory, patterns=None) -> list:
    """The case folders under ``directory`` matching ``patterns`` (names with or without ``test_``, or
    shell-style patterns such as ``mha_*``; all when None). :class:`CaseSelectionError` when the folder has
    no case or a pattern matches none."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise CaseSelectionError(f"{directory}: no such folder (write the vectors with 'kvcache-op conformance --out DIR')")
    folders = case_folders(directory)
    if not folders:
        raise CaseSelectionError(f"{directory}: no conformance cases in it (expected test_<case>/model.onnx)")
    if not patterns:
        return folders
    chosen, names = [], {case_name(f): f for f in folders}
    for pattern in patterns:
        bare = pattern[len("test_"):] if pattern.startswith("test_") else pattern
        matched = [f for name, f in names.items() if fnmatch.fnmatchcase(name, bare)]
        if not matched:
            raise CaseSelectionError(f"no case named {pattern!r} in {directory} "
                                     f"('kvcache-op validate {directory} --list' lists them)")
        chosen += [f for f in matched if f not in chosen]
    return chosen


def list_cases(directory, patterns=None) -> list:
    """(name, op, kind) of every selected case; a case whose model cannot be read is listed with op ``?`` and
    why (validating it fails that case)."""
    listed = []
    for folder in select_cases(directory, patterns):
        try:
            listed.append(case_info(folder))
        except Exception as error:  # noqa: BLE001 - a broken folder is listed as such, not a crash of the listing
            listed.append((case_name(folder), "?", f"unreadable: {error_text(error)}"))
    return listed


def as_backend(backend, **options):
    """A backend object from a name (see kvcache_op.validation.backends.load_backend), a callable with the
    reference's KeyValueCache signature, an object with any of the reference's function names, or a backend
    object (with ``run`` and ``ops``) as it is."""
    if isinstance(backend, str):
        return load_backend(backend, **options)
    if hasattr(backend, "run") and hasattr(backend, "ops"):
        return backend
    functions = {op: getattr(backend, name) for op, name in OP_FUNCTIONS.items() if callable(getattr(backend, name, None))}
    if not functions and callable(backend):
        functions = {"KeyValueCache": backend}
    if not functions:
        raise TypeError(f"not a backend: {backend!r}")
    return CallableBackend(functions, getattr(backend, "__name__", type(backend).__name__))


def run_case(folder, backend, tolerance: str = "exact", fingerprints: dict = None) -> CaseResult:
    """Runs one case folder through ``backend`` (a backend object) and compares; ``fingerprints``: the kit's
    (:func:`~.fingerprints.committed`, read here when None), which tell a stale folder."""
    try:
        case = read_case(folder)
    except Exception as error:  # noqa: BLE001 - a broken folder fails its case, not the run
        return CaseResult(case_name(folder), "?", "?", "FAIL", [f"cannot read the case: {error_text(error)}"])
    kind = "invalid" if case.expected.error is not None else "valid"
    known = committed() if fingerprints is None else fingerprints
    stale = case.fingerprint is None or known.get(case.name) != case.fingerprint
    if case.op not in backend.ops:
        return CaseResult(case.name, case.op, kind, "skip", [f"the backend has no {OP_FUNCTIONS[case.op]}"], stale)
    got = run_on_copies(backend, case.op, case.inputs, case.attributes, case.model)
    lines = compare(case.op, case.inputs, case.attributes, case.expected, got, tolerance)
    return CaseResult(case.name, case.op, kind, "FAIL" if lines else "ok", lines, stale)


def summary_table(results: list) -> list:
    """Lines of a table: passed/failed/skipped per op and kind of call, then the total and the failed cases."""
    rows = {}
    for r in results:
        counts = rows.setdefault((r.op, r.kind), {"ok": 0, "FAIL": 0, "skip": 0})
        counts[r.status] += 1
    width = max([len("op")] + [len(op) for op, _ in rows]) + 2  # MultiHeadCacheAttention is 23 characters
    lines = [f"{'op':<{width}}{'calls':<10}{'passed':>8}{'failed':>8}{'skipped':>9}"]
    for (op, kind), c in sorted(rows.items()):
        lines.append(f"{op:<{width}}{kind:<10}{c['ok']:>8}{c['FAIL']:>8}{c['skip']:>9}")
    total = {s: sum(r.status == s for r in results) for s in ("ok", "FAIL", "skip")}
    lines.append(f"{'total':<{width + 10}}{total['ok']:>8}{total['FAIL']:>8}{total['skip']:>9}")
    failed = [r.name for r in results if r.status == "FAIL"]
    if failed:
        lines.append("failed: " + ", ".join(failed))
    return lines


def validate(directory, backend="reference", *, tolerance: str = "exact", cases=None, progress=None,
             **backend_options) -> Report:
    """Validates the selected cases under ``directory`` with ``backend``; ``progress(line)`` is called per
    case. ``backend_options`` go to kvcache_op.validation.backends.load_backend (``ort_library``, ``provider``,
    ``provider_options``, ``isolate``, ``timeout``) when ``backend`` is a name."""
    folders = select_cases(directory, cases)
    runner = as_backend(backend, **backend_options)
    results, known = [], committed()  # read once a run
    try:
        for folder in folders:
            result = run_case(folder, runner, tolerance, known)
            results.append(result)
            if progress:
                progress(_case_line(result))
    finally:
        if runner is not backend:
            runner.close()
    return Report(getattr(runner, "name", str(backend)), tolerance, results)


def _case_line(result: CaseResult) -> str:
    head = {"ok": "ok  ", "FAIL": "FAIL", "skip": "skip"}[result.status] + " " + result.name
    if result.status == "skip":
        return f"{head} ({result.lines[0]})"
    return "\n".join([head] + ["    " + line for line in result.lines])


def validate_folder(directory, backend="reference", progress=print, tolerance: str = "exact", cases=None,
                    **backend_options) -> int:
    """:func:`validate`, printed: one line per case (details under a failing one), the summary table, and
    the exit status: 0 when every case run passed, 1 when one failed, 2 when nothing could be run."""
    report = validate(directory, backend, tolerance=tolerance, cases=cases, progress=progress, **backend_options)
    for line in [""] + summary_table(report.results):
        progress(line)
    skipped = sorted({OP_FUNCTIONS[r.op] for r in report.results if r.status == "skip"})
    if skipped:
        progress(f"skipped: the backend provides no {', '.join(skipped)}")
    stale = [r.name for r in report.results if r.stale]
    if stale:
        progress(f"note: {len(stale)} case folder(s) were not written from this kit's definitions (another version "
                 f"of it, or not its cases): {', '.join(stale[:8])}{', ...' if len(stale) > 8 else ''}; "
                 f"'kvcache-op conformance --out DIR' writes them anew")
    ran = [r for r in report.results if r.status != "skip"]
    if ran and all(r.kind == "invalid" for r in ran):
        progress("note: only invalid calls ran, and any exception refuses one: a backend that raises on every call "
                 "passes them; run the valid cases too")
    if report.count("ok") + report.count("FAIL") == 0:
        return 2
    return 0 if report.passed else 1


def compare_case(folder, backend="reference", tolerance: str = "exact") -> list:
    """The problems of one case folder with ``backend`` (a name or backend object); empty when it passes."""
    runner = as_backend(backend, isolate=False) if isinstance(backend, str) else as_backend(backend)
    try:
        return run_case(folder, runner, tolerance).lines
    finally:
        if runner is not backend:
            runner.close()


__all__ = ["ALL_OPS", "CaseResult", "CaseSelectionError", "Report", "compare_case", "list_cases", "run_case", "run_ort",
           "run_reference", "select_cases", "summary_table", "validate", "validate_folder"]
