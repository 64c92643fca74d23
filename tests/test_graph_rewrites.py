"""The exporter's generic graph rewrites: sibling MatMuls over one input become one MatMul and a Split with the
same outputs (checked in ONNX Runtime against the graph before), only where the weights concatenate; an exported
decoder gets its norms fused and its q/k/v and gate/up MatMuls merged, and serves the same tokens."""

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("onnxscript")
pytest.importorskip("torch")  # kvcache_op.hf's package imports torch and transformers
pytest.importorskip("transformers")
import onnx_ir as ir  # noqa: E402 - onnxscript brings it

from kvcache_op.hf.graph_rewrites import fuse_sibling_matmuls  # noqa: E402


def _graph(weights: dict, dynamic_input=True):
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in weights.items()]
    nodes = [helper.make_node("MatMul", ["x", name], [f"y_{name}"], name=f"mm_{name}") for name in weights]
    # a MatMul by a non-constant second input stays as it is
    nodes.append(helper.make_node("MatMul", ["x", "w_in"], ["y_in"], name="mm_input"))
    # Each product goes through an Identity: the graph's outputs keep their names whatever the rewrite does.
    nodes += [helper.make_node("Identity", [f"y_{n}"], [f"out_{n}"]) for n in [*weights, "in"]]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", 8]),
                                           helper.make_tensor_value_info("w_in", TensorProto.FLOAT, [8, 3])],
                              [helper.make_tensor_value_info(f"out_{n}", TensorProto.FLOAT, None)
                               for n in [*weights, "in"]], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(proto, feeds):
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def test_sibling_matmuls_merge_into_one_with_the_same_outputs():
    proto = _graph({"q": (8, 16), "k": (8, 4), "v": (8, 4)})
    feeds = {"x": np.random.default_rng(1).standard_normal((6, 8)).astype(np.float32),
             "w_in": np.random.default_rng(2).standard_normal((8, 3)).astype(np.float32)}
    before = _run(proto, feeds)
    model = ir.from_proto(proto)
    assert fuse_sibling_matmuls(model) == 1
    fused = ir.to_proto(model)
    ops = collections.Counter(n.op_type for n in fused.graph.node)
    assert ops == {"MatMul": 2, "Split": 1, "Identity": 4}  # q/k/v merged; the MatMul by a graph input stays
    after = _run(fused, feeds)
    for name in ("out_q", "out_k", "out_v", "out_in"):
        np.testing.assert_allclose(after[name], before[name], rtol=1e-6, atol=1e-6)


def test_a_lone_matmul_and_graph_outputs_are_left_alone():
    assert fuse_sibling_matmuls(ir.from_proto(_graph({"q": (8, 16)}))) == 0
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), n) for n in "ab"]
    graph = helper.make_graph([helper.make_node("MatMul", ["x", n], [f"y_{n}"]) for n in "ab"], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", 8])],
                              [helper.make_tensor_value_info(f"y_{n}", TensorProto.FLOAT, None) for n in "ab"], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    assert fuse_sibling_matmuls(ir.from_proto(proto)) == 0  # their outputs are the graph's: names must stay


def test_an_exported_decoder_has_fused_norms_and_merged_projections(tmp_path):
    pytest.importorskip("transformers")
    import hf_models
    from kvcache_op.hf import export_model

    model = hf_models.model("llama")
    plain = onnx.load(export_model(model, tmp_path / "plain.onnx", optimize=False), load_external_data=False)
    rewritten = onnx.load(hf_models.exported("llama"), load_external_data=False)
    count = lambda proto, op: sum(n.op_type == op for n in proto.graph.node)  # noqa: E731
    layers = model.config.num_hidden_layers
    assert count(plain, "MatMul") == 7 * layers + 1  # q, k, v, o, gate, up, down; the head
    assert count(rewritten, "MatMul") == 4 * layers + 1  # qkv, o, gate+up, down; the head
    assert count(plain, "SimplifiedLayerNormalization") == 0 < count(rewritten, "SkipSimplifiedLayerNormalization")
    assert count(rewritten, "Pow") == 0


def _unused_initializers(proto: onnx.ModelProto) -> list:
    """Names of the initializers no node (nor subgraph) reads and no graph output names."""
    read = {name for node in proto.graph.node for name in node.input}
    read |= {name for node in proto.graph.node for attr in node.attribute if attr.g.node
             for inner in attr.g.node for name in inner.input}
    read |= {output.name for output in proto.graph.output}
    return [init.name for init in proto.graph.initializer if init.name not in read]


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_an_exported_decoder_keeps_no_weight_that_its_rewrites_replaced(family):
    """The merged projections' and the fused rotary's sources leave the file with the nodes that read them: every
    initializer is read (so ONNX Runtime removes none at load, nor warns of it)."""
    pytest.importorskip("transformers")
    import hf_models

    rewritten = onnx.load(hf_models.exported(family), load_external_data=False)
    assert rewritten.graph.initializer and _unused_initializers(rewritten) == []


def test_an_onnxscript_without_the_fusions_still_exports_with_a_warning(tmp_path, monkeypatch):
    """The fusions are onnxscript's private names: where a version lacks one, the graph keeps its norms unfused,
    the sibling MatMuls still merge, and a warning names what is missing."""
    pytest.importorskip("transformers")
    import hf_models
    from onnxscript.rewriter.ort_fusions import _core

    from kvcache_op.hf import export_model

    monkeypatch.delattr(_core, "fuse_skip_rms_normalization")
    with pytest.warns(UserWarning, match="no fuse_skip_rms_normalization"):
        path = export_model(hf_models.model("llama"), tmp_path / "fallback.onnx")
    proto = onnx.load(path, load_external_data=False)
    ops = [n.op_type for n in proto.graph.node]
    assert "SkipSimplifiedLayerNormalization" not in ops and "Pow" in ops
    assert ops.count("MatMul") == 4 * hf_models.model("llama").config.num_hidden_layers + 1


def test_taking_the_one_row_of_a_batch_squeezes_instead_of_gathering():
    from kvcache_op.hf.graph_rewrites import squeeze_unit_gathers

    consts = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("zero", 0), ("row", [0]))]
    nodes = [helper.make_node("Gather", ["x", "zero"], ["a"], axis=0),  # one row of a batch of one: squeezed
             helper.make_node("Gather", ["w", "zero"], ["b"], axis=0),  # a batch of two: a real gather
             helper.make_node("Gather", ["x", "zero"], ["c"], axis=1),  # another axis (x's first dim is 1 too)
             helper.make_node("Gather", ["x", "row"], ["d"], axis=0)]  # indices of rank 1 keep the axis
    nodes += [helper.make_node("Identity", [n], [f"out_{n}"]) for n in "abcd"]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "t", 4]),
                                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [2, "t", 4])],
                              [helper.make_tensor_value_info(f"out_{n}", TensorProto.FLOAT, None) for n in "abcd"],
                              consts)
    proto = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((1, 3, 4)).astype(np.float32), "w": rng.standard_normal((2, 3, 4)).astype(np.float32)}
    before = _run(proto, feeds)
    model = ir.from_proto(proto)
    assert squeeze_unit_gathers(model) == 1
    after_proto = ir.to_proto(model)
    assert collections.Counter(n.op_type for n in after_proto.graph.node)["Gather"] == 3
    after = _run(after_proto, feeds)
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value)
        assert after[name].shape == value.shape


def test_a_merged_groups_weights_are_let_go_before_the_next_groups_copy(monkeypatch):
    """Three layers' sibling pairs whose weights only the graph holds: when each pair's merged copy is made, the pairs
    merged before are freed (a decoder's export then holds its weights once, not the originals beside the copies)."""
    import weakref

    from kvcache_op.hf import graph_rewrites

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 8]))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 18})
    alive, layer_input = [], x
    for layer in range(3):
        pair = []
        for j in range(2):
            weight = np.full((8, 8), layer * 10 + j, np.float32)
            alive.append((layer, weakref.ref(weight)))
            value = ir.Value(name=f"w{layer}_{j}", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([8, 8]),
                             const_value=ir.Tensor(weight))
            del weight
            graph.register_initializer(value)
            pair.append(ir.Node("", "MatMul", inputs=[layer_input, value], name=f"mm{layer}_{j}"))
            graph.append(pair[-1])
        add = ir.Node("", "Add", inputs=[pair[0].outputs[0], pair[1].outputs[0]], name=f"add{layer}")
        graph.append(add)
        layer_input = add.outputs[0]
    graph.outputs.append(layer_input)
    model = ir.Model(graph, ir_version=10)

    concatenate, held = np.concatenate, []

    def noting_what_is_held(arrays, axis):
        held.append(sorted({layer for layer, weight in alive if weight() is not None}))
        return concatenate(arrays, axis=axis)
    monkeypatch.setattr(graph_rewrites.np, "concatenate", noting_what_is_held)
    assert fuse_sibling_matmuls(model) == 3
    assert held == [[0, 1, 2], [1, 2], [2]]
    assert sorted(model.graph.initializers) == [f"mm{layer}_0_fused_{kind}" for layer in range(3)
                                                for kind in ("split", "weight")]
