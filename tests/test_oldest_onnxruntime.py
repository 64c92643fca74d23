"""An onnxruntime older than the package runs on is refused by name where the package makes sessions: pip holds the
``onnxruntime`` distribution to the floor in pyproject.toml, but ``onnxruntime-gpu`` (the same module) is not held."""

import pathlib
import re
import tomllib

import onnxruntime as ort
import pytest

from kvcache_op.ort_ops import session
from kvcache_op.validation import BackendLoadError
from kvcache_op.validation.ort_adapter import OrtBackend

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_floor_is_the_one_pyproject_asks_for():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    claim = next(d for d in dependencies if d.startswith("onnxruntime"))
    assert re.fullmatch(r"onnxruntime>=(\d+)\.(\d+)", claim).groups() == tuple(map(str, session.OLDEST_ONNXRUNTIME))


@pytest.mark.parametrize("version", ["1.26.0", "1.31.1", "1.27.0.dev20260101", "2.0.0", "1.26"])
def test_the_floor_and_newer_pass(version):
    session.check_onnxruntime(version)


@pytest.mark.parametrize("version", ["1.25.2", "1.23.2", "1.22.0", "1.9.0", "0.30.0"])
def test_an_older_release_is_refused_by_name(version):
    with pytest.raises(RuntimeError, match=rf"onnxruntime {re.escape(version)} is older than 1\.26.*"
                                           r"pip install 'onnxruntime>=1\.26', or 'onnxruntime-gpu>=1\.26'"):
        session.check_onnxruntime(version)


def test_sessions_and_the_conformance_backend_refuse_an_older_onnxruntime(monkeypatch):
    from onnx import TensorProto, helper

    monkeypatch.setattr(ort, "__version__", "1.23.2")
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    with pytest.raises(RuntimeError, match=r"onnxruntime 1\.23\.2 is older than 1\.26"):
        session.make_session(model)
    with pytest.raises(BackendLoadError, match=r"onnxruntime 1\.23\.2 is older than 1\.26"):
        OrtBackend()
    monkeypatch.setattr(ort, "__version__", "1.26.0")
    session.make_session(model)
    OrtBackend()
