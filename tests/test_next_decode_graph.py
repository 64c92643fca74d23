"""The decoder with its next decode step in the graph (serving/next_decode_graph.py): each row's greedy token is
numpy's argmax of the logits (first of equal maxima, float16 logits too), the next step's index inputs are what the
manager's ``next_decode`` builds, and the engine serves a model whose weights lie in an external data file."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvcache_op.serving.next_decode_graph import GREEDY_TOKENS, NEXT_DECODE_INPUTS, with_greedy_tokens, with_next_decode

VOCAB = 64


def logits_graph(element_type: int) -> onnx.ModelProto:
    """A stand-in decoder: the decoder's index inputs, and logits gathered from a table by ``input_ids`` (one row
    per token), of ``element_type``."""
    table = np.random.default_rng(0).integers(0, 6, (VOCAB, VOCAB)).astype(np.float32)  # many equal maxima
    inputs = [helper.make_tensor_value_info(name, TensorProto.INT64, ["n"]) for name in
              ("input_ids", "positions", "kvstarts", "start_pos")]
    inputs.append(helper.make_tensor_value_info("max_kvlen", TensorProto.INT64, []))
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["rows"], axis=0),
             helper.make_node("Cast", ["rows"], ["logits"], to=element_type)]
    graph = helper.make_graph(nodes, "decoder", inputs, [helper.make_tensor_value_info("logits", element_type,
                                                                                       ["n", VOCAB])],
                              [numpy_helper.from_array(table, "table")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


@pytest.mark.parametrize("element_type", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_next_outputs_are_numpys_argmax_and_the_next_decode_steps_inputs(element_type):
    model = with_next_decode(logits_graph(element_type))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, 9)
    feeds = dict(input_ids=ids, positions=rng.integers(0, 100, 9), kvstarts=np.cumsum(rng.integers(1, 9, 9)) - 1,
                 start_pos=rng.integers(0, 50, 9), max_kvlen=np.array(17, np.int64))
    names = ["logits"] + ["next_" + name for name in NEXT_DECODE_INPUTS]
    logits, next_ids, positions, kvstarts, start_pos, max_kvlen = session.run(names, feeds)
    assert np.array_equal(next_ids, np.argmax(logits, axis=1))  # ties: the first, as numpy's
    assert (np.sort(logits, axis=1)[:, -2] == logits.max(axis=1)).any(), "no row had equal maxima"
    assert np.array_equal(positions, feeds["positions"] + 1) and np.array_equal(start_pos, feeds["start_pos"] + 1)
    assert np.array_equal(kvstarts, feeds["kvstarts"] + np.arange(9)) and int(max_kvlen) == 18
    assert next_ids.dtype == np.int64 and max_kvlen.shape == ()


@pytest.mark.parametrize("element_type", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_the_greedy_tokens_alone_are_numpys_argmax_through_nodes_a_gpu_runs(element_type):
    """A device session's graph: the logits unchanged and each row's token, through Cast, Clip and ArgMax only (ONNX
    Runtime's CUDA EP has kernels for them; the next step's index arithmetic would put shape nodes on the CPU)."""
    model = logits_graph(element_type)
    greedy = with_greedy_tokens(model)
    added = [n.op_type for n in greedy.graph.node[len(model.graph.node):] if n.op_type != "Constant"]
    assert added == (["Clip", "ArgMax"] if element_type == TensorProto.FLOAT else ["Cast", "Clip", "ArgMax"])
    assert [o.name for o in greedy.graph.output] == ["logits", GREEDY_TOKENS]
    session = ort.InferenceSession(greedy.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(2).integers(0, VOCAB, 40)
    feeds = dict(input_ids=ids, positions=ids, kvstarts=ids, start_pos=ids, max_kvlen=np.array(1, np.int64))
    logits, tokens = session.run(None, feeds)
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert np.array_equal(logits, plain.run(None, feeds)[0])
    assert np.array_equal(tokens, np.argmax(logits, axis=1)) and tokens.dtype == np.int64
    assert (np.sort(logits, axis=1)[:, -2] == logits.max(axis=1)).any(), "no row had equal maxima"


def test_a_graph_that_is_not_a_decoder_or_already_has_the_names_is_refused():
    model = logits_graph(TensorProto.FLOAT)
    with pytest.raises(ValueError, match="already has values named"):
        with_next_decode(_with_value(model, "next_positions"))
    missing = onnx.ModelProto()
    missing.CopyFrom(model)
    del missing.graph.input[1]  # positions
    with pytest.raises(ValueError, match="not an exported decoder"):
        with_next_decode(missing)
    with pytest.raises(ValueError, match="already has values named"):
        with_greedy_tokens(_with_value(model, GREEDY_TOKENS))
    no_logits = onnx.ModelProto()
    no_logits.CopyFrom(model)
    no_logits.graph.output[0].name = "scores"
    with pytest.raises(ValueError, match="not an exported decoder"):
        with_greedy_tokens(no_logits)
    before = model.SerializeToString()
    with_next_decode(model)
    with_greedy_tokens(model)
    assert model.SerializeToString() == before  # a copy: the caller's model is unchanged


def _with_value(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """A copy of ``model`` with one more node, whose output is named ``name``."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.graph.node.append(helper.make_node("Identity", ["positions"], [name]))
    return copy


def test_the_engine_serves_a_model_whose_weights_lie_in_an_external_file(tmp_path):
    """The runner reads the graph without its weights and makes the session from memory: ONNX Runtime is told where
    the weights file lies."""
    pytest.importorskip("torch")  # kvcache_op.hf imports it
    pytest.importorskip("transformers")
    import hf_models
    from kvcache_op.serving import Engine

    source = hf_models.exported("llama")
    model = onnx.load(source)
    outside = tmp_path / "weights" / "decoder.onnx"
    outside.parent.mkdir()
    # as the exporter saves a large model (ONNX's default threshold: small constants stay in the graph, which ONNX
    # Runtime's shape inference must read however the model is loaded)
    onnx.save(model, str(outside), save_as_external_data=True, location="decoder.onnx.data")
    assert (outside.parent / "decoder.onnx.data").stat().st_size > outside.stat().st_size
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    expected = Engine(source, num_pages=16).generate(prompts, 12)
    assert Engine(str(outside), num_pages=16).generate(prompts, 12) == expected


def test_inputs_with_anonymous_dynamic_dims_give_outputs_of_the_same_shapes(tmp_path):
    """A decoder whose inputs' dynamic dims carry no name (valid ONNX): the next step's outputs keep them dynamic, so
    the graph's own greedy runs give the tokens of one step at a time."""
    pytest.importorskip("torch")  # kvcache_op.hf imports it
    pytest.importorskip("transformers")
    import hf_models
    from kvcache_op.serving import Engine, SamplingParams

    model = onnx.load(hf_models.exported("llama"))
    for value in model.graph.input:
        for dim in value.type.tensor_type.shape.dim:
            dim.ClearField("dim_param")
    path = tmp_path / "anonymous.onnx"
    onnx.save(model, str(path))
    outputs = {value.name: value for value in with_next_decode(model).graph.output}
    assert all(not d.HasField("dim_value") for d in outputs["next_kvstarts"].type.tensor_type.shape.dim)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    one = Engine(str(path), num_pages=16, decode_steps=1).generate([[1, 2, 3]], 30, params=params)
    assert Engine(str(path), num_pages=16).generate([[1, 2, 3]], 30, params=params) == one


@pytest.mark.parametrize("element_type", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_the_device_graphs_argmax_reads_clipped_logits(element_type):
    """ONNX Runtime's CUDA ArgMax gives INT32_MAX for a row of -inf: the device graph's ArgMax reads the logits within
    +-FLOAT32_MAX, so such a row's token is numpy's 0, and an infinite logit still wins its row."""
    dtype = np.float32 if element_type == TensorProto.FLOAT else np.float16
    graph = helper.make_graph([helper.make_node("Identity", ["scores"], ["logits"])], "decoder",
                              [helper.make_tensor_value_info("scores", element_type, ["n", 4])],
                              [helper.make_tensor_value_info("logits", element_type, ["n", 4])])
    model = with_greedy_tokens(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    scores = np.array([[-np.inf] * 4, [1.0, np.inf, 3.0, np.inf], [-np.inf, -2.0, -np.inf, -1.0],
                       [2.0, 5.0, 5.0, -np.inf]], dtype)
    tokens = session.run([GREEDY_TOKENS], {"scores": scores})[0]
    assert tokens.tolist() == np.argmax(scores, axis=1).tolist() == [0, 1, 3, 1]
