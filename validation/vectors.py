"""Conformance vectors in ONNX's backend-test layout, loadable by ``onnx.backend.test`` as they are.

One folder per case, named ``test_<case>`` (ONNX's runner requires the prefix)::

    test_<case>/model.onnx                  the call as a one-node model
    test_<case>/data.json                   {"rtol": 0, "atol": 0}; attention: atol = its largest element bound
    test_<case>/test_data_set_0/input_<i>.pb   the graph inputs, in order
    test_<case>/test_data_set_0/output_<i>.pb  the expected graph outputs, in order
    test_<case>/test_data_set_0/tolerance_0.pb attention only: the bound of every output element (float64)

The graph outputs are the node's outputs followed by its in-place inputs (``cache``, ``scale``), which a
graph may list as outputs by their input names: their expected values are the cache and scale *after* the
call, so a runner that returns what the backend left in them checks them like any output
(kvcache_op.validation.onnx_backend does). An invalid call (``error_*``, ``mha_error_*``, ``rotary_error_*``) has
the metadata ``kvcache_op.expect = error`` and ``kvcache_op.error`` (the reference's message, a hint only);
its graph outputs are only the in-place inputs, expected byte-for-byte unchanged.

A backend passes a case when its outputs equal the expected ones bit for bit (or within the tolerance table
of spec/KeyValueCache.md when asked), its cache/scale after the call equal the expected ones, and it
fails exactly the invalid calls; attention outputs pass within their recorded bound (twice the bound of
spec/MultiHeadAttention.md "Tolerance").
"""

import dataclasses
import json
import pathlib

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..spec.mha_schema import make_attention_model
from ..spec.mhca_schema import make_cache_attention_model
from ..spec.model import make_model
from ..spec.rotary_schema import make_rotary_shift_model
from .case_fingerprint import case_fingerprint
from .compare import ATTENTION_OUTPUTS
from .cases import CASES, Case, op_of
from .error_cases import INVALID, MORE_INVALID, make_invalid
from .mha_cases import ATTENTION_CASES
from .mha_error_cases import INVALID as ATTENTION_INVALID
from .mha_error_cases import make_invalid as make_attention_invalid
from .mhca_cases import CASES as CACHE_ATTENTION_CASES
from .mhca_cases import error_cases as cache_attention_error_cases
from .outcome import IN_PLACE, OUTPUTS, Outcome, reference_outcome
from .rotary_cases import CASES as ROTARY_CASES
from .rotary_cases import ERROR_CASES as ROTARY_ERROR_CASES


def _error_cases() -> dict:
    cases = {}
    for row in INVALID + MORE_INVALID:
        cases[f"error_{row[0]}"] = lambda row=row: Case(f"error_{row[0]}", *make_invalid(row), expect_error=True)
    for row in ATTENTION_INVALID:
        name = f"mha_error_{row[0]}"
        cases[name] = lambda row=row, name=name: Case(name, *make_attention_invalid(row), expect_error=True)
    for key, make in ROTARY_ERROR_CASES.items():
        name = f"rotary_error_{key}"
        cases[name] = lambda make=make, name=name: Case(name, *make(), expect_error=True)
    cases.update(cache_attention_error_cases())
    return cases


#: Every named case: KeyValueCache's, MultiHeadAttention's (``mha_*``), KeyCacheRotaryShift's (``rotary_*``),
#: MultiHeadCacheAttention's (``mhca_*``), then the invalid calls of the four.
ALL_CASES = {**CASES, **ATTENTION_CASES, **ROTARY_CASES, **CACHE_ATTENTION_CASES, **_error_cases()}

PREFIX = "test_"
DATA_SET = "test_data_set_0"
EXPECT_KEY, ERROR_KEY = "kvcache_op.expect", "kvcache_op.error"
#: The metadata key holding the fingerprint of the case's definition the folder was written from
#: (kvcache_op.validation.fingerprints): a folder from another version of the kit is told apart by it.
FINGERPRINT_KEY = "kvcache_op.case_fingerprint"
#: The small set committed under spec/conformance/ (a test regenerates it and checks it is unchanged).
COMMITTED = ["offset_layout0", "paged_layout3", "int8_layout1", "int4_layout2", "t1_bfloat16_int8_scale_float16",
             "gqa_repeat2", "prefix_shared_pages_int8", "chunked_prefill_paged_int4", "empty_sequence_between",
             "batch0", "mha_mixed_decode_chunk_prefill", "mha_gqa_group4_bfloat16", "mha_mask_rank3_float32",
             "mha_sliding_window3", "mha_alibi_heads6_gqa", "mha_fully_masked_rows", "rotary_int8_layout1",
             "rotary_bfloat16_interleaved_layout2", "error_paged_sentinel_minus_one", "error_offset_beyond_max_t",
             "error_int4_paged_sentinel_minus_one", "error_slot_stored_twice", "mha_error_kvstarts_total",
             "rotary_error_slot_past_max_t"]
COMMITTED_DIR = pathlib.Path(__file__).resolve().parent.parent / "spec" / "conformance"  # kvcache_op/spec/conformance


def folder_name(name: str) -> str:
    """The folder of case ``name``: ``test_<name>``."""
    return name if name.startswith(PREFIX) else PREFIX + name


def case_name(folder) -> str:
    """The case name of a folder (its name without the ``test_`` prefix)."""
    name = pathlib.Path(folder).name
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def node_model(op: str, inputs: dict, attributes: dict) -> onnx.ModelProto:
    """The one-node model of a call, with the node's outputs as graph outputs (what a runtime runs)."""
    if op == "KeyValueCache":
        return make_model(inputs, **attributes)
    if op == "MultiHeadAttention":
        return make_attention_model(inputs, **attributes)
    if op == "MultiHeadCacheAttention":
        return make_cache_attention_model(inputs, **attributes)
    return make_rotary_shift_model(inputs, **attributes)


def case_model(op: str, inputs: dict, attributes: dict, error: str = None) -> onnx.ModelProto:
    """The model written for a case: :func:`node_model` plus the in-place inputs as graph outputs; for an
    invalid call (``error`` set: the reference's message) the node's outputs move to ``value_info`` and the
    metadata says an error is expected."""
    model = node_model(op, inputs, attributes)
    graph = model.graph
    in_place = [vi for vi in graph.input if vi.name in IN_PLACE[op] and inputs.get(vi.name) is not None]
    if error is not None:
        graph.value_info.extend(graph.output)
        del graph.output[:]
        helper.set_model_props(model, {EXPECT_KEY: "error", ERROR_KEY: error})
    graph.output.extend(in_place)
    return model


def runnable_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a case's model whose graph outputs are exactly the node's outputs (what a runtime that
    writes the in-place inputs may run)."""
    runnable = onnx.ModelProto()
    runnable.CopyFrom(model)
    graph = runnable.graph
    known = {vi.name: vi for vi in list(graph.output) + list(graph.value_info)}
    outputs = [known[name] for name in graph.node[0].output if name]
    del graph.output[:]
    graph.output.extend(outputs)
    kept = [vi for vi in graph.value_info if vi.name not in graph.node[0].output]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    del runnable.metadata_props[:]
    return runnable


def _save(array, name, path: pathlib.Path):
    path.write_bytes(numpy_helper.from_array(np.asarray(array), name).SerializeToString())


def expected(case: Case) -> Outcome:
    """The reference's outcome of ``case``; ``ValueError`` when it disagrees with ``case.expect_error``."""
    outcome = reference_outcome(case.op, case.inputs, case.attributes)
    if (outcome.error is not None) != case.expect_error:
        raise ValueError(f"case {case.name}: the reference " + (f"rejects it ({outcome.error})" if outcome.error
                                                                 else "accepts it, but it is an invalid call"))
    return outcome


def write_case(case: Case, out_dir) -> pathlib.Path:
    """Writes one case under ``out_dir/test_<case.name>`` and returns that folder."""
    folder = pathlib.Path(out_dir) / folder_name(case.name)
    data = folder / DATA_SET
    data.mkdir(parents=True, exist_ok=True)
    fingerprint = case_fingerprint(case)
    result = expected(case)
    model = case_model(case.op, case.inputs, case.attributes, result.error)
    entry = model.metadata_props.add()
    entry.key, entry.value = FINGERPRINT_KEY, fingerprint
    onnx.save_model(model, folder / "model.onnx")
    for i, info in enumerate(model.graph.input):
        _save(case.inputs[info.name], info.name, data / f"input_{i}.pb")
    values = {**(result.outputs or {}), **result.after}
    for i, info in enumerate(model.graph.output):
        _save(values[info.name], info.name, data / f"output_{i}.pb")
    atol = 0.0
    if result.tolerance is not None:
        _save(result.tolerance, "tolerance", data / "tolerance_0.pb")
        atol = float(result.tolerance.max(initial=0.0))
    (folder / "data.json").write_text(json.dumps({"rtol": 0.0, "atol": atol}) + "\n")
    return folder


def resolve_names(names) -> list:
    """Case names (``test_`` prefix optional) checked against :data:`ALL_CASES`; ``ValueError`` names the
    unknown ones."""
    names = [n[len(PREFIX):] if n.startswith(PREFIX) else n for n in names]
    unknown = [n for n in names if n not in ALL_CASES]
    if unknown:
        raise ValueError(f"unknown conformance case(s) {unknown} ('kvcache-op conformance --list' lists them)")
    return names


def write_conformance(out_dir, names=None, progress=print) -> list:
    """Writes the named cases (all by default); returns the folders written."""
    names = list(ALL_CASES) if names is None else resolve_names(names)
    folders = []
    for i, name in enumerate(names, 1):
        folders.append(write_case(ALL_CASES[name](), out_dir))
        if progress:
            progress(f"[{i}/{len(names)}] {name}")
    return folders


def load_tensor(path: pathlib.Path):
    """The array of a serialized TensorProto file."""
    tensor = onnx.TensorProto()
    tensor.ParseFromString(pathlib.Path(path).read_bytes())
    return numpy_helper.to_array(tensor)


@dataclasses.dataclass
class VectorCase:
    """A case read back from its folder: the call (``op``, ``inputs`` by node input name with None for an
    absent optional input, ``attributes``), the ``model`` to run (:func:`runnable_model`) and the
    ``expected`` :class:`Outcome` (``error`` holds the reference's message for an invalid call), and the
    ``fingerprint`` of the definition it was written from (None: written by a kit that did not record it)."""

    name: str
    folder: pathlib.Path
    op: str
    inputs: dict
    attributes: dict
    model: onnx.ModelProto
    expected: Outcome
    fingerprint: str = None


def read_case(folder) -> VectorCase:
    """Reads a case folder written by :func:`write_case`."""
    folder = pathlib.Path(folder)
    data = folder / DATA_SET
    model = onnx.load_model(folder / "model.onnx")
    node = model.graph.node[0]
    given = {info.name: load_tensor(data / f"input_{i}.pb") for i, info in enumerate(model.graph.input)}
    inputs = {formal: (given[node.input[i]] if i < len(node.input) and node.input[i] else None)
              for i, formal in enumerate(_signature(node))}
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    op = op_of(inputs)
    values = {info.name: load_tensor(data / f"output_{i}.pb") for i, info in enumerate(model.graph.output)}
    props = {p.key: p.value for p in model.metadata_props}
    after = {name: values[name] for name in IN_PLACE[op] if name in values}
    if props.get(EXPECT_KEY) == "error":
        outcome = Outcome(None, after, error=props.get(ERROR_KEY, "an error"))
    else:
        outputs = {name: values[name] for name in OUTPUTS[op]}
        tolerance = load_tensor(data / "tolerance_0.pb") if (data / "tolerance_0.pb").exists() else None
        bounded = ATTENTION_OUTPUTS.get(op)
        if bounded and (tolerance is None or tolerance.shape != outputs[bounded].shape):
            found = "none" if tolerance is None else f"one of shape {list(tolerance.shape)}"
            raise ValueError(f"{DATA_SET}/tolerance_0.pb: an attention case needs the bound of every element of its "
                             f"{bounded} {list(outputs[bounded].shape)}, found {found}")
        outcome = Outcome(outputs, after, tolerance=tolerance)
    return VectorCase(case_name(folder), folder, op, inputs, attributes, runnable_model(model), outcome,
                      props.get(FINGERPRINT_KEY))


def _signature(node) -> list:
    """The formal input names of the node's op (the reference's parameter names), in order."""
    from ..spec.mha_schema import INPUTS as ATTENTION_INPUTS
    from ..spec.mhca_schema import INPUTS as CACHE_ATTENTION_INPUTS
    from ..spec.rotary_schema import INPUTS as ROTARY_INPUTS
    from ..spec.schema import INPUTS as KV_INPUTS

    names = {"KeyValueCache": KV_INPUTS, "MultiHeadAttention": ATTENTION_INPUTS,
             "KeyCacheRotaryShift": ROTARY_INPUTS, "MultiHeadCacheAttention": CACHE_ATTENTION_INPUTS}[node.op_type]
    return list(names)


def list_cases(directory) -> list:
    """The case folders under ``directory`` (sorted by name)."""
    return sorted(p.parent for p in pathlib.Path(directory).glob("*/model.onnx"))
