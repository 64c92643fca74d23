"""Conformance vectors in the ONNX backend-test layout.

``<out>/<case>/model.onnx`` and ``<out>/<case>/test_data_set_0/``: ``input_<i>.pb`` (graph input order).
KeyValueCache cases: ``output_0.pb`` (key), ``output_1.pb`` (value), and the in-place results
``cache_after.pb`` and, with quantization, ``scale_after.pb``. A backend passes such a case when its
outputs equal ``output_*.pb`` and its cache/scale after the call equal ``*_after.pb`` (exactly, or within
the tolerance table of spec/KeyValueCache.md for backends with other quantization arithmetic).
MultiHeadAttention cases (``mha_*``): ``output_0.pb`` (the reference's output) and
``output_0_tolerance.pb`` (float64, same shape): a backend passes when ``|got - expected| <= tolerance``
element by element (twice the bound of spec/MultiHeadAttention.md "Tolerance").
"""

import pathlib

import numpy as np
import onnx
from onnx import numpy_helper

from ..reference import attention_tolerance, key_value_cache, multi_head_attention
from .cases import CASES, Case
from .mha_cases import ATTENTION_CASES
from .mha_schema import make_attention_model
from .model import make_model

#: Every named case: KeyValueCache's, then MultiHeadAttention's (``mha_*``).
ALL_CASES = {**CASES, **ATTENTION_CASES}

DATA_SET = "test_data_set_0"
#: The small set committed under spec/conformance/ (a test regenerates it and checks it is unchanged).
COMMITTED = ["offset_layout0", "paged_layout3", "int8_layout1", "int4_layout2", "t1_bfloat16_int8_scale_float16",
             "gqa_repeat2", "prefix_shared_pages_int8", "chunked_prefill_paged_int4", "empty_sequence_between",
             "batch0", "mha_mixed_decode_chunk_prefill", "mha_gqa_group4_bfloat16", "mha_mask_rank3_float32",
             "mha_sliding_window3", "mha_alibi_heads6_gqa", "mha_fully_masked_rows"]
COMMITTED_DIR = pathlib.Path(__file__).parent / "conformance"


def is_attention(case: Case) -> bool:
    """True for a MultiHeadAttention case (its inputs start with ``query``)."""
    return "query" in case.inputs


def expected_attention(case: Case) -> dict:
    """The reference's output of an attention case and the tolerance a backend is held to: twice the spec's
    bound (the reference is itself within the bound of the exact result)."""
    output = multi_head_attention(**case.inputs, **case.attributes)
    return {"output": output, "tolerance": 2 * attention_tolerance(**case.inputs, **case.attributes)}


def expected(case: Case) -> dict:
    """Runs the reference on copies of the case's inputs: key, value, cache and scale after the call."""
    inputs = {k: (None if v is None else v.copy()) for k, v in case.inputs.items()}
    key, value = key_value_cache(**inputs, **case.attributes)
    return {"key": key, "value": value, "cache": inputs["cache"], "scale": inputs["scale"]}


def _save(array, name, path: pathlib.Path):
    path.write_bytes(numpy_helper.from_array(np.asarray(array), name).SerializeToString())


def write_case(case: Case, out_dir) -> pathlib.Path:
    """Writes one case under ``out_dir/case.name`` and returns that folder."""
    folder = pathlib.Path(out_dir) / case.name
    data = folder / DATA_SET
    data.mkdir(parents=True, exist_ok=True)
    model = (make_attention_model if is_attention(case) else make_model)(case.inputs, **case.attributes)
    onnx.save_model(model, folder / "model.onnx")
    for i, name in enumerate(model.graph.input):
        _save(case.inputs[name.name], name.name, data / f"input_{i}.pb")
    if is_attention(case):
        result = expected_attention(case)
        _save(result["output"], "attention_output", data / "output_0.pb")
        _save(result["tolerance"], "tolerance", data / "output_0_tolerance.pb")
        return folder
    result = expected(case)
    _save(result["key"], "key", data / "output_0.pb")
    _save(result["value"], "value", data / "output_1.pb")
    _save(result["cache"], "cache", data / "cache_after.pb")
    if result["scale"] is not None:
        _save(result["scale"], "scale", data / "scale_after.pb")
    return folder


def write_all(out_dir, names=None, progress=print) -> list:
    """Writes the named cases (all by default); returns the folders written."""
    names = list(ALL_CASES) if names is None else list(names)
    unknown = [n for n in names if n not in ALL_CASES]
    if unknown:
        raise ValueError(f"unknown conformance case(s) {unknown}; known: {list(ALL_CASES)}")
    folders = []
    for i, name in enumerate(names, 1):
        folders.append(write_case(ALL_CASES[name](), out_dir))
        if progress:
            progress(f"[{i}/{len(names)}] {name}")
    return folders


def _load(path: pathlib.Path):
    tensor = onnx.TensorProto()
    tensor.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(tensor)


def read_case(folder) -> dict:
    """Reads a case folder: ``model``, ``inputs`` (name -> array, in node order), and for KeyValueCache
    ``key``, ``value``, ``cache`` and ``scale`` (after the call; ``scale`` None without quantization), for
    MultiHeadAttention ``output`` and ``tolerance``."""
    folder = pathlib.Path(folder)
    data = folder / DATA_SET
    model = onnx.load_model(folder / "model.onnx")
    inputs = {}
    for i, info in enumerate(model.graph.input):
        inputs[info.name] = _load(data / f"input_{i}.pb")
    if model.graph.node[0].op_type == "MultiHeadAttention":
        return {"model": model, "inputs": inputs, "output": _load(data / "output_0.pb"),
                "tolerance": _load(data / "output_0_tolerance.pb")}
    scale_path = data / "scale_after.pb"
    return {
        "model": model,
        "inputs": inputs,
        "key": _load(data / "output_0.pb"),
        "value": _load(data / "output_1.pb"),
        "cache": _load(data / "cache_after.pb"),
        "scale": _load(scale_path) if scale_path.exists() else None,
    }
