"""Models whose weights pass protobuf's 2 GiB limit: the weightless stand-in onnx's checks run on, saving with
external data, and a transformers decoder of over 2 GiB exported and served token for token."""

import os
import shutil
import stat

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

pytest.importorskip("torch")

from kvcache_op.torch import large_models  # noqa: E402


def _matmul_reshape(weight_shape, out_shape, declared=None):
    """x [2, 200] @ w -> Reshape to ``out_shape`` through a small int64 constant; the output declared ``declared``
    (``out_shape`` by default)."""
    w = numpy_helper.from_array(np.ones(weight_shape, np.float32), "w")
    shape = numpy_helper.from_array(np.array(out_shape, np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Reshape", ["y", "shape"], ["z"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 200])],
        [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, declared or out_shape)], [w, shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="test")
    model.metadata_props.add(key="k", value="v")
    return model


def test_stand_in_keeps_all_but_the_large_weights_values():
    model = _matmul_reshape([200, 300], [600])
    before = model.SerializeToString()
    light = large_models.without_large_weights(model)
    assert model.SerializeToString() == before
    assert [t.name for t in light.graph.initializer] == ["shape"]  # a shape constant shape inference reads
    w = next(i for i in light.graph.input if i.name == "w")
    assert w.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_value for d in w.type.tensor_type.shape.dim] == [200, 300]
    assert (light.producer_name, light.ir_version, light.opset_import, light.metadata_props) == (
        model.producer_name, model.ir_version, model.opset_import, model.metadata_props)
    assert list(light.graph.node) == list(model.graph.node) and list(light.graph.output) == list(model.graph.output)
    onnx.checker.check_model(light, full_check=True)


@pytest.mark.parametrize("weight_shape, out_shape, declared",
                         [([300, 300], [600], None), ([200, 300], [300, 2], [200, 3])])
def test_stand_in_fails_the_checks_the_model_fails(weight_shape, out_shape, declared):
    """A large weight of the wrong shape, or an output its Reshape's small constant contradicts: the checks read
    both on the stand-in too."""
    model = _matmul_reshape(weight_shape, out_shape, declared)
    with pytest.raises(onnx.onnx_cpp2py_export.shape_inference.InferenceError):
        onnx.checker.check_model(model, full_check=True)
    with pytest.raises(onnx.onnx_cpp2py_export.shape_inference.InferenceError):
        onnx.checker.check_model(large_models.without_large_weights(model), full_check=True)


def test_weight_bytes_counts_raw_and_typed_data():
    model = _matmul_reshape([200, 300], [600])
    model.graph.initializer.append(helper.make_tensor("typed", onnx.TensorProto.FLOAT, [4], [1.0, 2.0, 3.0, 4.0]))
    assert large_models.weight_bytes(model) == 200 * 300 * 4 + 8 + model.graph.initializer[2].ByteSize()


def test_saved_data_file_is_as_readable_as_the_model_and_replaced(tmp_path):
    model = _matmul_reshape([200, 300], [600])
    path = tmp_path / "m.onnx"
    (tmp_path / "m.onnx.data").write_bytes(b"stale" * 1000)
    large_models.save(model, str(path), "m.onnx.data")
    data = tmp_path / "m.onnx.data"
    assert stat.S_IMODE(data.stat().st_mode) == stat.S_IMODE(path.stat().st_mode)
    assert data.stat().st_size == 200 * 300 * 4  # the stale bytes are gone, not appended to
    loaded = onnx.load(str(path))
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]), np.ones((200, 300), np.float32))


def _available_bytes() -> int:
    with open("/proc/meminfo") as stream:
        fields = dict(line.split(":", 1) for line in stream)
    return int(fields["MemAvailable"].split()[0]) * 1024


def test_decoder_over_two_gib_exports_and_serves_its_own_tokens(tmp_path):
    """A Llama of 2.2 GB of float32 weights (a 540,000-token vocabulary, untied), with either exporter: onnx's
    checker and ``ByteSize`` serialize a model whose weights pass 2 GiB, and torch's TorchScript exporter refuses to
    write one to memory, so the export failed."""
    pytest.importorskip("transformers")
    if _available_bytes() < 14 << 30:
        pytest.skip(f"needs 14 GiB of memory available, {_available_bytes() / 2**30:.1f} GiB are")
    from kvcache_op.hf import export_model, tiny_model
    from kvcache_op.hf.verify import reference_generate
    from kvcache_op.serving import Engine

    model = tiny_model("llama", vocab_size=540_000, hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                       num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    assert sum(p.numel() for p in model.parameters()) * 4 > 2**31
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    expected = [reference_generate(model, p, 6) for p in prompts]
    # Both exporters in one test, one after the other: each export's peak is about 8 GB.
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
