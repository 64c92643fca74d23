"""A model converted to ONNX Runtime's own format (.ort) runs in a plain InferenceSession, but the package cannot
read its graph to check it: the package's sessions, the engine and ``kvcache-op serve`` refuse it by name, not with a
parse error; an ONNX file that merely holds the format's identifier where it looks is no .ort model."""

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kvcache_op import spec
from kvcache_op.ort_ops import library_path, make_session, session_options
from kvcache_op.validation.cases import CASES

REFUSAL = r"ONNX Runtime format \(\.ort\) model"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the .ort file, the case it was made from), converted by onnxruntime's own tool."""
    folder = tmp_path_factory.mktemp("ort-format")
    case = CASES["offset_layout0"]()
    onnx.save(spec.make_model(case.inputs, **case.attributes), folder / "kv.onnx")
    done = subprocess.run([sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort", "--custom_op_library",
                           library_path(), "--optimization_style", "Fixed", "--output_dir", str(folder / "out"),
                           str(folder / "kv.onnx")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return folder / "out" / "kv.ort", case


def test_a_plain_session_runs_the_converted_file(converted):
    path, case = converted
    session = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
    feeds = {k: v.copy() for k, v in case.inputs.items() if v is not None}
    key, _ = session.run(None, feeds)
    assert key.shape[0] == case.inputs["kvstarts"][-1] and np.isfinite(key).all()


@pytest.mark.parametrize("given", ["path", "bytes"])
def test_the_package_sessions_refuse_it_by_name(converted, given):
    path = converted[0]
    with pytest.raises(ValueError, match=REFUSAL):
        make_session(path if given == "path" else path.read_bytes())


def test_the_engine_refuses_it_by_name(converted):
    pytest.importorskip("transformers")
    from kvcache_op.serving import Engine

    with pytest.raises(ValueError, match=REFUSAL):
        Engine(converted[0], num_pages=4)


def test_serve_refuses_it_by_name(converted):
    pytest.importorskip("transformers")
    from kvcache_op.serve_command import exported_model

    with pytest.raises(ValueError, match=REFUSAL):
        exported_model(converted[0])


def test_an_onnx_file_produced_by_ortmodule_is_no_ort_model(tmp_path):
    """An ONNX file starts with ir_version's tag; a producer name of "ORTModule" puts "ORTM" at bytes 4-8."""
    from kvcache_op.ort_ops.graph_rules import load_model

    case = CASES["offset_layout0"]()
    model = spec.make_model(case.inputs, **case.attributes)
    model.producer_name = "ORTModule"
    data = model.SerializeToString()
    assert data[4:8] == b"ORTM"
    onnx.save(model, tmp_path / "kv.onnx")
    assert load_model(data) == model == load_model(tmp_path / "kv.onnx")
    make_session(tmp_path / "kv.onnx")
