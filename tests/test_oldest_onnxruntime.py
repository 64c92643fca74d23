"""What onnxruntime releases older than the package's floor lack is refused by name, not met as a crash or as ONNX
Runtime's argument error: pip holds the ``onnxruntime`` distribution to the floor, but ``onnxruntime-gpu`` (the same
module) is not held. 1.22 and 1.23 crash creating a session of a MultiHeadCacheAttention node given an ``attn_mask``
but no ``scale``; before 1.26 ``OrtValue.update_inplace`` takes no OrtValue (the conformance kit's device path). The
library itself runs on 1.22 (``test_ort_api_version.py``), so nothing else is refused."""

import pathlib
import re
import tomllib

import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from kvcache_op.ort_ops import graph_rules, session
from kvcache_op.spec import mhca_schema, schema
from kvcache_op.validation import BackendLoadError
from kvcache_op.validation.ort_adapter import OrtBackend

ROOT = pathlib.Path(__file__).resolve().parents[1]
CRASH = r"onnxruntime 1\.23 crashes creating a session of this node \(an attn_mask given, no scale\)"


def _cache_attention(scale: bool, mask: bool):
    """A MultiHeadCacheAttention node model (not meant to run): ``scale`` and ``attn_mask`` given or not."""
    names = list(mhca_schema.INPUTS[:11]) + ["scale" if scale else "", "attn_mask" if mask else ""]
    while not names[-1]:
        names.pop()
    node = helper.make_node(mhca_schema.OP_TYPE, names, ["out"], name="attn0", domain=schema.DOMAIN, num_heads=2,
                            head_dim=4)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names if n]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(schema.DOMAIN, 1)])


def test_the_python_floor_is_what_pyproject_asks_for_and_above_the_releases_refused():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    claim = next(d for d in dependencies if d.startswith("onnxruntime"))
    floor = tuple(map(int, re.fullmatch(r"onnxruntime>=(\d+)\.(\d+)", claim).groups()))
    assert floor == (1, 26) and graph_rules._EMPTY_SCALE_BEFORE_MASK_LOADS <= floor


@pytest.mark.parametrize("version, release", [("1.31.1", (1, 31)), ("1.27.0.dev20260101", (1, 27)),
                                              ("2.0", (2, 0)), ("nightly", None)])
def test_releases_are_read_from_the_version(version, release):
    assert graph_rules.onnxruntime_release(version) == release


@pytest.mark.parametrize("version", ["1.22.0", "1.23.2"])
def test_a_crashing_node_is_refused_on_the_releases_that_crash(version):
    with pytest.raises(RuntimeError, match=r"MultiHeadCacheAttention node attn0: onnxruntime 1\.2[23] crashes .*"
                                           r"needs onnxruntime >= 1\.24"):
        graph_rules.refuse_crashing_nodes(_cache_attention(scale=False, mask=True), version)


def test_a_crashing_node_inside_a_model_local_function_is_refused():
    model = _cache_attention(scale=False, mask=True)
    node = model.graph.node[0]
    function = helper.make_function("local", "attend", list(filter(None, node.input)), ["out"], [node],
                                    [helper.make_opsetid(schema.DOMAIN, 1)])
    model.graph.ClearField("node")
    model.graph.node.append(helper.make_node("attend", list(filter(None, node.input)), ["out"], domain="local"))
    model.functions.append(function)
    model.opset_import.append(helper.make_opsetid("local", 1))
    with pytest.raises(RuntimeError, match=r"MultiHeadCacheAttention node attn0: onnxruntime 1\.23 crashes"):
        graph_rules.refuse_crashing_nodes(model, "1.23.2")


@pytest.mark.parametrize("version, scale, mask", [("1.24.0", False, True), ("1.31.1", False, True),
                                                  ("1.23.2", True, True), ("1.23.2", False, False),
                                                  ("1.23.2", True, False)])
def test_other_releases_and_node_forms_pass(version, scale, mask):
    graph_rules.refuse_crashing_nodes(_cache_attention(scale, mask), version)


def test_an_empty_scale_named_last_without_a_mask_passes():
    """Twelve inputs, the last an empty scale: no mask is given, so the node does not crash the old releases."""
    model = _cache_attention(scale=False, mask=False)
    model.graph.node[0].input.append("")
    graph_rules.refuse_crashing_nodes(model, "1.23.2")


def test_make_session_and_the_conformance_backend_refuse_it(monkeypatch):
    monkeypatch.setattr(ort, "__version__", "1.23.2")
    model = _cache_attention(scale=False, mask=True)
    with pytest.raises(RuntimeError, match=CRASH):
        session.make_session(model)
    with pytest.raises(RuntimeError, match=CRASH):
        OrtBackend()._session(model)


def test_the_kit_on_a_device_refuses_an_onnxruntime_without_device_copies(monkeypatch):
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(ort, "__version__", "1.25.1")
    with pytest.raises(BackendLoadError, match=r"onnxruntime 1\.25\.1: its OrtValue\.update_inplace takes no "
                                               r"OrtValue.*pip install 'onnxruntime-gpu>=1\.26'"):
        OrtBackend(provider="CUDAExecutionProvider")
    OrtBackend()  # the host path copies nothing: 1.25 runs it
