"""Models whose weights pass protobuf's 2 GiB limit: onnx's checks on them (the weightless stand-in and the checks of
the weights it leaves out), the clear error where one would be serialized whole, the torch front-end's save, and a
transformers decoder of over 2 GiB exported with each exporter and served token for token."""

import os
import shutil
import stat

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvcache_op.ort_ops import large_models

INFERENCE_ERROR = onnx.onnx_cpp2py_export.shape_inference.InferenceError


def _matmul_reshape(weight_shape, out_shape, declared=None, ir_version=None):
    """x [2, 200] @ w -> Reshape to ``out_shape`` through a small int64 constant; the output declared ``declared``
    (``out_shape`` by default)."""
    w = numpy_helper.from_array(np.ones(weight_shape, np.float32), "w")
    shape = numpy_helper.from_array(np.array(out_shape, np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Reshape", ["y", "shape"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 200])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, declared or out_shape)], [w, shape])
    # IR version 3 goes with opsets 6 to 8 (onnx's checker refuses a newer opset for it)
    opset = 8 if ir_version == 3 else 17
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="test")
    if ir_version is not None:
        model.ir_version = ir_version
    if ir_version == 3:  # the small constant declared as a graph input too, as that version asks of initializers
        model.graph.input.append(helper.make_tensor_value_info("shape", TensorProto.INT64, [len(out_shape)]))
    model.metadata_props.add(key="k", value="v")
    return model


def _identity_of_input_weight(declared_type, declared_shape):
    """An initializer ``w`` [200, 300] float32 that is also a graph input, declared as given, read by Identity."""
    w = numpy_helper.from_array(np.ones((200, 300), np.float32), "w")
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g",
                              [helper.make_tensor_value_info("w", declared_type, declared_shape)],
                              [helper.make_tensor_value_info("y", declared_type, declared_shape)], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _short_raw_data(model):
    model.graph.initializer[0].raw_data = model.graph.initializer[0].raw_data[:-4]
    return model


def _two_value_fields(model):
    model.graph.initializer[0].float_data.append(1.0)
    return model


@pytest.fixture
def stand_in_always(monkeypatch):
    """check_model takes the stand-in path for any model (as it does for one of over 1 GiB of weights)."""
    monkeypatch.setattr(large_models, "EXTERNAL_DATA_BYTES", 0)


def test_stand_in_keeps_all_but_the_large_weights_values():
    model = _matmul_reshape([200, 300], [600])
    before = model.SerializeToString()
    light = large_models.without_large_weights(model)
    assert model.SerializeToString() == before
    assert [t.name for t in light.graph.initializer] == ["shape"]  # a shape constant shape inference reads
    w = next(i for i in light.graph.input if i.name == "w")
    assert w.type.tensor_type.elem_type == TensorProto.FLOAT
    assert [d.dim_value for d in w.type.tensor_type.shape.dim] == [200, 300]
    assert (light.producer_name, light.ir_version, light.opset_import, light.metadata_props) == (
        model.producer_name, model.ir_version, model.opset_import, model.metadata_props)
    assert list(light.graph.node) == list(model.graph.node) and list(light.graph.output) == list(model.graph.output)
    onnx.checker.check_model(light, full_check=True)


def test_a_sound_model_passes_on_the_stand_in_path(stand_in_always, monkeypatch):
    checked = []
    real = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, **kw: (checked.append(m), real(m, **kw)))
    large_models.check_model(_matmul_reshape([200, 300], [600]))
    assert [t.name for t in checked[0].graph.initializer] == ["shape"]  # the stand-in was what onnx checked


# Each model onnx's checker refuses; the stand-in path must refuse it too.
REFUSED = {
    "weight of the wrong shape": (lambda: _matmul_reshape([300, 300], [600]), INFERENCE_ERROR),
    # only the small constant (kept in the stand-in) contradicts the declared output
    "output its Reshape constant contradicts": (lambda: _matmul_reshape([200, 300], [300, 2], [200, 3]),
                                                INFERENCE_ERROR),
    "input declared with another type": (lambda: _identity_of_input_weight(TensorProto.FLOAT16, [200, 300]),
                                         onnx.checker.ValidationError),
    "input declared with another shape": (lambda: _identity_of_input_weight(TensorProto.FLOAT, [300, 300]),
                                          onnx.checker.ValidationError),
    "input declared without a shape": (lambda: _identity_of_input_weight(TensorProto.FLOAT, None),
                                       onnx.checker.ValidationError),
    "ir_version 3, initializer not an input": (lambda: _matmul_reshape([200, 300], [600], ir_version=3),
                                               onnx.checker.ValidationError),
    "raw data short of its shape": (lambda: _short_raw_data(_matmul_reshape([200, 300], [600])),
                                    onnx.checker.ValidationError),
    "raw data and a typed field": (lambda: _two_value_fields(_matmul_reshape([200, 300], [600])),
                                   onnx.checker.ValidationError),
}


@pytest.mark.parametrize("case", REFUSED)
def test_the_stand_in_path_refuses_what_the_checker_refuses(case, stand_in_always):
    make, error = REFUSED[case]
    with pytest.raises((INFERENCE_ERROR, onnx.checker.ValidationError)):
        onnx.checker.check_model(make(), full_check=True)
    with pytest.raises(error):
        large_models.check_model(make())


# Each model onnx's checker accepts; the stand-in path must accept it too.
ACCEPTED = {
    "input declared with its own type and shape": lambda: _identity_of_input_weight(TensorProto.FLOAT, [200, 300]),
    "input declared with a named dimension": lambda: _identity_of_input_weight(TensorProto.FLOAT, ["rows", 300]),
    "ir_version 4, initializer not an input": lambda: _matmul_reshape([200, 300], [600], ir_version=4),
}


@pytest.mark.parametrize("case", ACCEPTED)
def test_the_stand_in_path_accepts_what_the_checker_accepts(case, stand_in_always):
    onnx.checker.check_model(ACCEPTED[case](), full_check=True)
    large_models.check_model(ACCEPTED[case]())


def test_a_small_model_gets_the_full_check():
    """Below the stand-in path, onnx's checker with shape inference: a weight of the wrong shape is refused."""
    make, error = REFUSED["weight of the wrong shape"]
    with pytest.raises(error):
        large_models.check_model(make())


def test_a_small_model_is_checked_itself(monkeypatch):
    checked = []
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, **kw: checked.append(m))
    model = _matmul_reshape([200, 300], [600])
    large_models.check_model(model)
    assert checked == [model]


def test_weight_bytes_counts_raw_and_typed_data():
    model = _matmul_reshape([200, 300], [600])
    typed = helper.make_tensor("typed", TensorProto.FLOAT, [4], [1.0, 2.0, 3.0, 4.0])
    model.graph.initializer.append(typed)
    assert large_models.weight_bytes(model) == 200 * 300 * 4 + 8 + len(typed.SerializeToString())


def test_a_model_too_large_to_serialize_is_refused_by_name():
    """A ModelProto holding 2 GiB of weights in memory (protobuf cannot serialize it): make_session and run_model say
    to pass a saved file's path (protobuf's "Failed to serialize proto" before)."""
    if _available_bytes() < 6 << 30:
        pytest.skip(f"needs 6 GiB of memory available, {_available_bytes() / 2**30:.1f} GiB are")
    from kvcache_op.ort_ops import session

    model = _matmul_reshape([200, 300], [600])
    big = model.graph.initializer.add()
    big.name, big.data_type = "unused", TensorProto.UINT8
    big.dims.append(1 << 31)
    big.raw_data = bytes(1 << 31)
    for call in (lambda: session.make_session(model), lambda: session.run_model(model, {})):
        with pytest.raises(ValueError, match="more than one protobuf message takes .* pass the file's path"):
            call()


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as stream:
            fields = dict(line.split(":", 1) for line in stream)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


def test_decoder_over_two_gib_exports_and_serves_its_own_tokens(tmp_path):
    """A Llama of 2.2 GB of float32 weights (a 540,000-token vocabulary, untied), with either exporter: onnx's
    checker and ``ByteSize`` serialize a model whose weights pass 2 GiB, and torch's TorchScript exporter refuses to
    write one to memory, so the export failed. One export at a time: each peaks at about 8 to 11 GB."""
    pytest.importorskip("torch")  # kvcache_op.hf imports it
    pytest.importorskip("transformers")
    if _available_bytes() < 14 << 30:
        pytest.skip(f"needs 14 GiB of memory available (read from /proc/meminfo), {_available_bytes() / 2**30:.1f} "
                    "GiB are")
    from kvcache_op.hf import export_model, tiny_model
    from kvcache_op.hf.verify import reference_generate
    from kvcache_op.serving import Engine

    model = tiny_model("llama", vocab_size=540_000, hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                       num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    assert sum(p.numel() for p in model.parameters()) * 4 > 2**31
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    expected = [reference_generate(model, p, 6) for p in prompts]
    for dynamo in (True, False):
        folder = tmp_path / f"dynamo{dynamo}"
        folder.mkdir()
        path = export_model(model, folder / "big.onnx", dynamo=dynamo)
        data = [n for n in os.listdir(folder) if n.endswith(".data")]
        assert len(data) == 1 and (folder / data[0]).stat().st_size > 2**31
        assert stat.S_IMODE((folder / data[0]).stat().st_mode) == stat.S_IMODE(os.stat(path).st_mode)
        with Engine(path, num_pages=16) as engine:
            assert engine.generate(prompts, 6) == expected, dynamo
        shutil.rmtree(folder)
