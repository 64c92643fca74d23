"""The torch front-end's checks of an exported model in onnx_ir without a copy of its weights
(``kvcache_op.torch.weightless``): the proto they run on, what they refuse (what onnx's checker refuses of the model
itself), the in-place rule on a large cache constant, and the input list's hold on removed inputs released."""

import gc
import weakref

import numpy as np
import onnx
import pytest

pytest.importorskip("torch", reason="the torch front-end needs the 'torch' extra: pip install '.[torch]'")

import onnx_ir as ir  # noqa: E402
from onnx import numpy_helper  # noqa: E402
from test_large_models import REFUSED, _matmul_reshape  # noqa: E402

from kvcache_op.torch import weightless  # noqa: E402
from kvcache_op.torch.model_files import forget_removed_inputs  # noqa: E402

# The refusals of the graph; the rest are of a proto's tensor fields, which an onnx_ir tensor does not have.
GRAPH_CASES = [case for case in REFUSED if not case.startswith("raw data")]


def _check(model: ir.Model) -> None:
    weightless.check_model(model, weightless.weightless_proto(model))


def test_the_proto_leaves_out_only_the_large_weights_and_the_model_is_unchanged():
    model = ir.from_proto(_matmul_reshape([200, 300], [600]))
    tensor = model.graph.initializers["w"].const_value
    proto = weightless.weightless_proto(model)
    assert model.graph.initializers["w"].const_value is tensor
    by_name = {t.name: t for t in proto.graph.initializer}
    assert weightless.left_out(by_name["w"]) and not by_name["w"].raw_data
    assert (by_name["w"].data_type, list(by_name["w"].dims)) == (onnx.TensorProto.FLOAT, [200, 300])
    assert not weightless.left_out(by_name["shape"])  # a constant shape inference reads stays whole
    assert numpy_helper.to_array(by_name["shape"]).tolist() == [600]
    assert [n.op_type for n in proto.graph.node] == ["MatMul", "Reshape"]


def test_a_sound_model_passes_and_the_checker_sees_no_large_weight(monkeypatch):
    checked = []
    real = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, **kw: (checked.append(m), real(m, **kw)))
    _check(ir.from_proto(_matmul_reshape([200, 300], [600])))
    assert [t.name for t in checked[0].graph.initializer] == ["shape"]
    assert "w" in [value.name for value in checked[0].graph.input]


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_what_the_checker_refuses_is_refused(case):
    make, error = REFUSED[case]
    with pytest.raises((onnx.onnx_cpp2py_export.shape_inference.InferenceError, onnx.checker.ValidationError)):
        onnx.checker.check_model(make(), full_check=True)
    with pytest.raises(error):
        _check(ir.from_proto(make()))


def test_input_types_are_copied_from_a_retyped_proto():
    model = ir.from_proto(_matmul_reshape([200, 300], [600]))
    proto = weightless.weightless_proto(model)
    proto.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    proto.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 400
    weightless.copy_input_types(proto, model)
    x = model.graph.inputs[0]
    assert (x.dtype, list(x.shape)) == (ir.DataType.FLOAT16, [2, 400])


def test_a_large_cache_constant_is_refused_as_an_initializer():
    """The in-place rule reads which names are initializers from the weightless proto: a cache kept as a constant of
    more than 64 KiB (a module buffer) is still one there."""
    import torch

    import kvcache_op.torch as kt

    class BufferCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(64, 1, 2, 2, 256))  # 256 KiB, layout 0

        def forward(self, k, v, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen):
            return kt.key_value_cache(k, v, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                                      self.cache, None, page_size=16)

    k = torch.ones(2, 2, 256)
    args = (k, k.clone(), torch.tensor([0, 2]), torch.tensor([0, 2]), torch.tensor([0]), torch.tensor([0]),
            torch.tensor(2), torch.tensor(2))
    with pytest.raises(ValueError, match="is an initializer, but the op writes it in place"):
        kt.export_onnx(BufferCache(), args, dynamo=True)


def test_a_removed_input_is_released():
    """onnx_ir's input list keeps a removed input counted at zero, holding it (and the weight it holds) as long as
    the graph: the exporter's lifted weights, and every initializer its shape inference made an input for a while."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([4]),
                 const_value=ir.tensor(np.ones(4, np.float32)))
    y = ir.Value(name="y", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([4]))
    node = ir.Node("", "Identity", inputs=[y])
    model = ir.Model(ir.Graph([x, y], node.outputs, nodes=[node]), ir_version=10)
    model.graph.inputs.remove(x)
    removed = weakref.ref(x)
    del x
    forget_removed_inputs(model)
    gc.collect()
    assert removed() is None
    assert [value.name for value in model.graph.inputs] == ["y"]
    model.graph.inputs.append(ir.Value(name="z"))  # the list still counts what it holds
    model.graph.inputs.remove(model.graph.inputs[-1])
    assert [value.name for value in model.graph.inputs] == ["y"]
