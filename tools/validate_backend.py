"""Runs conformance-vector folders through a backend and compares every result: KeyValueCache's bit for bit,
MultiHeadAttention's within the tolerance recorded in the case."""

import pathlib

import numpy as np


def run_reference(model, inputs: dict) -> tuple:
    """Runs ``model`` with onnx's ReferenceEvaluator; returns its outputs; ``inputs`` (copies) are written in
    place."""
    from onnx.reference import ReferenceEvaluator

    from ..reference import KeyValueCache, MultiHeadAttention

    return tuple(ReferenceEvaluator(model, new_ops=[KeyValueCache, MultiHeadAttention]).run(None, inputs))


def run_ort(model, inputs: dict) -> tuple:
    """Runs ``model`` in ONNX Runtime's CPU EP with the custom-op library; returns its outputs; ``inputs``
    written in place."""
    from ..ort_ops import run_model

    return run_model(model, inputs)


BACKENDS = {"reference": run_reference, "ort": run_ort}


def compare_case(folder, backend: str) -> list:
    """Runs one case folder; returns the names of the results that differ (empty: the case passes)."""
    from ..spec.vectors import read_case

    case = read_case(folder)
    inputs = {k: v.copy() for k, v in case["inputs"].items()}
    if "tolerance" in case:
        return _compare_attention(BACKENDS[backend](case["model"], inputs)[0], case)
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


def _compare_attention(got, case) -> list:
    """["attention_output"] unless ``got`` has the expected dtype and shape and is within the case's tolerance
    element by element (zeros where the tolerance is 0: rows that see no key)."""
    want, tolerance = case["output"], case["tolerance"]
    got = np.asarray(got)
    if got.dtype != want.dtype or got.shape != want.shape:
        return ["attention_output"]
    error = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return [] if bool(np.all(error <= tolerance)) else ["attention_output"]


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
