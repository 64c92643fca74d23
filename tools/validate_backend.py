"""Runs conformance-vector folders through a backend and compares every result bit for bit."""

import pathlib

import numpy as np


def run_reference(model, inputs: dict) -> tuple:
    """Runs ``model`` with onnx's ReferenceEvaluator; ``inputs`` (copies) are written in place."""
    from onnx.reference import ReferenceEvaluator

    from ..reference import KeyValueCache

    key, value = ReferenceEvaluator(model, new_ops=[KeyValueCache]).run(None, inputs)
    return key, value


def run_ort(model, inputs: dict) -> tuple:
    """Runs ``model`` in ONNX Runtime's CPU EP with the custom-op library; ``inputs`` written in place."""
    from ..ort_ops import run_model

    return run_model(model, inputs)


BACKENDS = {"reference": run_reference, "ort": run_ort}


def compare_case(folder, backend: str) -> list:
    """Runs one case folder; returns the names of the results that differ (empty: the case passes)."""
    from ..spec.vectors import read_case

    case = read_case(folder)
    inputs = {k: v.copy() for k, v in case["inputs"].items()}
    key, value = BACKENDS[backend](case["model"], inputs)
    got = {"key": key, "value": value, "cache": inputs["cache"], "scale": inputs.get("scale")}
    bad = []
    for name in ("key", "value", "cache", "scale"):
        want = case[name]
        if want is None:
            continue
        g = np.asarray(got[name])
        if g.dtype != want.dtype or g.shape != want.shape or g.tobytes() != want.tobytes():
            bad.append(name)
    return bad


def validate_folder(directory, backend: str, progress=print) -> int:
    """Validates every case under ``directory``; prints one line per case; returns 0 iff all pass."""
    folders = sorted(p.parent for p in pathlib.Path(directory).glob("*/model.onnx"))
    if not folders:
        progress(f"no conformance cases under {directory} (expected <case>/model.onnx)")
        return 2
    failed = 0
    for folder in folders:
        bad = compare_case(folder, backend)
        failed += bool(bad)
        progress(f"{'FAIL' if bad else 'ok  '} {folder.name}" + (f": {', '.join(bad)} differ" if bad else ""))
    progress(f"{len(folders) - failed} passed, {failed} failed")
    return 1 if failed else 0
