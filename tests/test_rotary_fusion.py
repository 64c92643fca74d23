"""The rotary rewrite: ``x * cos + rotate_half(x) * sin`` with cos/sin computed from ``positions`` becomes ONNX
Runtime's RotaryEmbedding over constant tables, with the same outputs (checked in ONNX Runtime against the graph
before, at positions out of order); chains whose cos/sin are not per-position functions of the positions, or do not
rotate by halves, are left as they are; and every exported decoder's rotary is fused."""

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

from kvcache_op.hf.rotary_fusion import fuse_rotary_embeddings  # noqa: E402

HEADS, WIDTH, MAX_POSITIONS = 3, 8, 64
INV_FREQ = (1.0 / 10000 ** (np.arange(0, WIDTH, 2) / WIDTH)).astype(np.float32)


def _graph(angles="duplicated", transposed=False, source="positions", positions_type=TensorProto.INT64,
           feedable_freq=False, unnamed=False, transpose_output=False):
    """A graph rotating ``x`` by halves as traced models do. ``angles``: "duplicated" (concat(f, f), as RoPE),
    "distinct" (concat(f, 2f): not a rotation by halves), "cumulative" (angles from a running sum of the positions:
    not one row per position), "relative" (positions less the batch's smallest: rows that depend on the batch).
    ``source``: the input the angles come from. ``transposed``: ``x`` arrives as ``[1, T, H, D]`` and is moved to
    ``[1, H, T, D]`` and back around the rotation (``transpose_output``: the moved ``x`` is a graph output too).
    ``feedable_freq``: the frequencies are an initializer a caller may feed. ``unnamed``: no node has a name."""
    nodes = [helper.make_node("Unsqueeze", [source, "axis0"], ["pos2"])]
    if angles == "cumulative":
        nodes.append(helper.make_node("CumSum", ["pos2", "axis1"], ["pos3"]))
    elif angles == "relative":
        nodes += [helper.make_node("ReduceMin", ["pos2"], ["first"]),  # invisible when position 0 is in the batch
                  helper.make_node("Sub", ["pos2", "first"], ["pos3"])]
    else:
        nodes.append(helper.make_node("Identity", ["pos2"], ["pos3"]))
    nodes += [helper.make_node("Cast", ["pos3"], ["posf"], to=TensorProto.FLOAT),
              helper.make_node("Unsqueeze", ["posf", "axis_last"], ["posc"]),
              helper.make_node("Mul", ["posc", "inv_freq"], ["freqs"])]
    if angles == "distinct":
        nodes += [helper.make_node("Mul", ["freqs", "two"], ["freqs2"]),
                  helper.make_node("Concat", ["freqs", "freqs2"], ["emb"], axis=-1)]
    else:
        nodes.append(helper.make_node("Concat", ["freqs", "freqs"], ["emb"], axis=-1))
    nodes += [helper.make_node("Cos", ["emb"], ["cos3"]), helper.make_node("Sin", ["emb"], ["sin3"]),
              helper.make_node("Unsqueeze", ["cos3", "axis1"], ["cos"]),  # [1, 1, T, D]
              helper.make_node("Unsqueeze", ["sin3", "axis1"], ["sin"])]
    x = "x"
    if transposed:
        nodes.append(helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1, 3]))
        x = "xt"
    half = WIDTH // 2
    nodes += [helper.make_node("Slice", [x, "zero", "half", "axis_last"], ["x1"]),
              helper.make_node("Slice", [x, "half", "big", "axis_last"], ["x2"]),
              helper.make_node("Neg", ["x2"], ["nx2"]),
              helper.make_node("Concat", ["nx2", "x1"], ["rot"], axis=-1),
              helper.make_node("Mul", [x, "cos"], ["xc"]),
              helper.make_node("Mul", ["sin", "rot"], ["rs"]),  # operands in either order
              helper.make_node("Add", ["rs", "xc"], ["yt" if transposed else "yr"])]
    if transposed:
        nodes.append(helper.make_node("Transpose", ["yt"], ["yr"], perm=[0, 2, 1, 3]))
    nodes.append(helper.make_node("Identity", ["yr"], ["y"]))  # a graph output keeps its name: it is not rewritten
    consts = {"axis0": [0], "axis1": [1], "axis_last": [-1], "zero": [0], "half": [half], "big": [2 ** 62]}
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items()]
    inits += [numpy_helper.from_array(INV_FREQ, "inv_freq"), numpy_helper.from_array(np.float32(2), "two")]
    x_shape = [1, "T", HEADS, WIDTH] if transposed else [1, HEADS, "T", WIDTH]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
              helper.make_tensor_value_info("positions", TensorProto.INT64, ["T"])]
    inputs[1] = helper.make_tensor_value_info("positions", positions_type, ["T"])
    if source != "positions":
        inputs.append(helper.make_tensor_value_info(source, TensorProto.INT64, ["T"]))
    if feedable_freq:
        inputs.append(helper.make_tensor_value_info("inv_freq", TensorProto.FLOAT, [WIDTH // 2]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if transpose_output:
        outputs.append(helper.make_tensor_value_info("xt", TensorProto.FLOAT, None))
    for node in nodes if unnamed else ():
        node.name = ""
    for i, node in enumerate(nodes if not unnamed else ()):
        node.name = f"n{i}"
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(proto)


def _run(proto, positions, transposed=False):
    rng = np.random.default_rng(len(positions))
    shape = (1, len(positions), HEADS, WIDTH) if transposed else (1, HEADS, len(positions), WIDTH)
    feeds = {"x": rng.standard_normal(shape).astype(np.float32), "positions": np.asarray(positions, np.int64)}
    names = {i.name for i in proto.graph.input}
    feeds.update({n: feeds["positions"] for n in names - set(feeds)})
    if "inv_freq" in names:
        feeds["inv_freq"] = INV_FREQ
    feeds["positions"] = feeds["positions"].astype(_INTEGER[proto.graph.input[1].type.tensor_type.elem_type])
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], {k: v for k, v in feeds.items() if k in names})[0]


_INTEGER = {TensorProto.INT64: np.int64, TensorProto.INT32: np.int32}


def _fused(proto, max_positions=MAX_POSITIONS):
    model = ir.from_proto(proto)
    count = fuse_rotary_embeddings(model, max_positions)
    return count, ir.to_proto(model)


def _ops(proto):
    return collections.Counter(n.op_type for n in proto.graph.node)


POSITIONS = [[5, 0, 63, 17, 1], [40], list(range(64))]


@pytest.mark.parametrize("transposed", [False, True])
def test_a_rotation_by_halves_becomes_one_node_with_the_same_outputs(transposed):
    proto = _graph(transposed=transposed)
    count, fused = _fused(proto)
    assert count == 1
    ops = _ops(fused)
    assert ops["RotaryEmbedding"] == 1 and not ops["Neg"] and not ops["Cos"] and not ops["Sin"]
    # Moved to [1, H, T, D] only for the rotation: the fused graph rotates [1, T, H * D] between Reshapes.
    assert ops["Transpose"] == 0
    for positions in POSITIONS:
        np.testing.assert_allclose(_run(fused, positions, transposed), _run(proto, positions, transposed),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("transposed, unnamed, transpose_output", [(True, True, False), (True, False, True)])
def test_unnamed_nodes_and_a_rotated_input_read_outside_fuse_with_the_same_outputs(transposed, unnamed,
                                                                                  transpose_output):
    proto = _graph(transposed=transposed, unnamed=unnamed, transpose_output=transpose_output)
    count, fused = _fused(proto)
    assert count == 1
    for positions in POSITIONS:
        np.testing.assert_allclose(_run(fused, positions, transposed), _run(proto, positions, transposed),
                                   rtol=1e-6, atol=1e-6)


def test_a_table_of_one_position():
    count, fused = _fused(_graph(), max_positions=1)
    assert count == 1
    np.testing.assert_allclose(_run(fused, [0]), _run(_graph(), [0]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("why", ["distinct", "cumulative", "relative", "other input", "feedable frequencies",
                                 "int32 positions"])
def test_chains_that_are_not_a_per_position_rotation_by_halves_stay(why):
    proto = {"other input": lambda: _graph(source="other"),
             "feedable frequencies": lambda: _graph(feedable_freq=True),
             "int32 positions": lambda: _graph(positions_type=TensorProto.INT32)}.get(why, lambda: _graph(angles=why))()
    count, fused = _fused(proto)
    assert count == 0
    assert _ops(fused) == _ops(proto)
    for positions in [*POSITIONS[:2], [10, 11, 12]]:
        np.testing.assert_array_equal(_run(fused, positions), _run(proto, positions))


def test_positions_past_the_tables_are_refused_by_onnx_runtime():
    _, fused = _fused(_graph())
    with pytest.raises(Exception, match="out of range"):
        _run(fused, [0, MAX_POSITIONS])


def test_every_exported_decoder_rotates_with_the_fused_node():
    pytest.importorskip("transformers")
    import hf_models

    model = hf_models.model("llama")
    ops = _ops(onnx.load(hf_models.exported("llama"), load_external_data=False))
    assert ops["RotaryEmbedding"] == 2 * model.config.num_hidden_layers  # queries and keys of every layer
    assert not ops["Neg"] and not ops["Cos"] and not ops["Sin"]


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_scaled_rotaries_fuse_and_give_the_models_own_tokens(rope, tmp_path):
    """YaRN scales cos/sin by its attention factor (a constant folded into the traced subgraph) and Llama 3 bends
    the frequencies: the tables come from the graph's own subgraph, so both fuse and stay exact."""
    pytest.importorskip("transformers")
    from kvcache_op.hf import export_model, tiny_model
    from kvcache_op.hf.verify import reference_generate
    from kvcache_op.serving import Engine

    base = tiny_model("llama")
    model = tiny_model("llama", rope_parameters={**base.config.rope_parameters, **rope})
    path = export_model(model, tmp_path / "scaled.onnx", page_size=8)
    assert _ops(onnx.load(path, load_external_data=False))["RotaryEmbedding"] == 2 * model.config.num_hidden_layers
    prompts = [list(range(5, 45)), [200, 201, 202]]
    assert Engine(path, num_pages=32).generate(prompts, 10) == [reference_generate(model, p, 10) for p in prompts]
