"""Multi-step serving, concurrency and several layers sharing one cache, through the ORT CPU op."""

import threading

import numpy as np
import onnx
import pytest
from onnx import helper

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, run_model
from kvcache_op.reference import key_value_cache
from kvcache_op.validation.cases import CASES
from kvcache_op.validation.validate import compare_case
from scenario import initial_cache, steps


@pytest.mark.parametrize("quant_bit,t1,layout", [(0, "float16", 0), (8, "bfloat16", 3), (4, "float32", 1),
                                                 (0, "bfloat16", 2)])
def test_multi_step_serving_matches_reference_every_step(quant_bit, t1, layout):
    attrs = dict(quant_bit=quant_bit, quant_group=4, cache_mode=1, cache_layout=layout, page_size=4)
    ref_cache, ref_scale = initial_cache(quant_bit, t1, layout, 64, 4, 2, 8, 4)
    ort_cache, ort_scale = ref_cache.copy(), None if ref_scale is None else ref_scale.copy()
    session = None
    checked = 0
    for inputs in steps(seed=quant_bit + layout, t1=t1):
        ref_in = {**inputs, "cache": ref_cache, "scale": ref_scale}
        want = key_value_cache(**ref_in, **attrs)
        feeds = {**inputs, "cache": ort_cache}
        if ort_scale is not None:
            feeds["scale"] = ort_scale
        if session is None:
            model = spec.make_model({**feeds, "scale": ort_scale}, **attrs)
            session = make_session(model, intra_op_num_threads=2)
        got = run_model(model, feeds, session=session)
        assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()
        assert ort_cache.tobytes() == ref_cache.tobytes()
        if ref_scale is not None:
            assert ort_scale.tobytes() == ref_scale.tobytes()
        checked += want[0].shape[0]
    assert checked > 200


def test_conformance_vectors_run_through_ort(tmp_path):
    from kvcache_op.validation import vectors

    vectors.write_conformance(tmp_path, progress=None)
    failures = {name: compare_case(tmp_path / vectors.folder_name(name), "ort") for name in CASES}
    assert {k: v for k, v in failures.items() if v} == {}


def test_threads_sharing_one_session_with_disjoint_caches():
    case = CASES["decode_batch_int8_gqa"]()
    model = spec.make_model(case.inputs, **case.attributes)
    session = make_session(model, intra_op_num_threads=2)
    want_in = {k: (None if v is None else v.copy()) for k, v in case.inputs.items()}
    want = key_value_cache(**want_in, **case.attributes)
    errors = []

    def worker():
        try:
            for _ in range(20):
                feeds = {k: v.copy() for k, v in case.inputs.items() if v is not None}
                key, value = run_model(model, feeds, session=session)
                assert key.tobytes() == want[0].tobytes() and value.tobytes() == want[1].tobytes()
                assert feeds["cache"].tobytes() == want_in["cache"].tobytes()
                assert feeds["scale"].tobytes() == want_in["scale"].tobytes()
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_layers_share_one_cache_tensor_through_layer_idx():
    """A 3-layer graph: each node writes its own layer of the one cache input, in place."""
    layers = 3
    base = CASES["layers3_layer_idx2"]()
    attrs = dict(base.attributes)
    inputs = dict(base.inputs)
    rng = np.random.default_rng(7)
    names = ["seqstarts", "kvstarts", "cachestarts", "start_pos", "max_seqlen", "max_kvlen", "cache"]
    nodes, graph_inputs, feeds = [], [], {}
    template = spec.make_model(inputs, **attrs).graph.input
    by_name = {i.name: i for i in template}
    for layer in range(layers):
        for kind in ("current_key", "current_value"):
            feeds[f"{kind}_{layer}"] = (rng.standard_normal(inputs[kind].shape) * 2).astype(inputs[kind].dtype)
            info = onnx.ValueInfoProto()
            info.CopyFrom(by_name[kind])
            info.name = f"{kind}_{layer}"
            graph_inputs.append(info)
        node_attrs = {**attrs, "layer_idx": layer}
        nodes.append(spec.make_node(inputs=[f"current_key_{layer}", f"current_value_{layer}", *names],
                                    outputs=[f"key_{layer}", f"value_{layer}"], name=f"kv_{layer}", **node_attrs))
    graph_inputs += [by_name[n] for n in names]
    outputs = [helper.make_tensor_value_info(f"{k}_{layer}", onnx.TensorProto.FLOAT16, None)
               for layer in range(layers) for k in ("key", "value")]
    graph = helper.make_graph(nodes, "layers", graph_inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(spec.DOMAIN, 1)],
                              ir_version=spec.IR_VERSION)
    for n in names:
        feeds[n] = inputs[n].copy()
    ref_cache = inputs["cache"].copy()
    want = []
    for layer in range(layers):
        ref = {**{n: inputs[n] for n in names}, "cache": ref_cache, "current_key": feeds[f"current_key_{layer}"],
               "current_value": feeds[f"current_value_{layer}"]}
        want += list(key_value_cache(**ref, **{**attrs, "layer_idx": layer}))
    got = make_session(model).run(None, feeds)
    for g, w in zip(got, want):
        assert g.tobytes() == w.tobytes()
    assert feeds["cache"].tobytes() == ref_cache.tobytes()


def _two_caches_graph(first: dict, second: dict, second_repeat: int, symbolic_heads: bool) -> onnx.ModelProto:
    """Two KeyValueCache nodes over two caches (a draft and a target model, say), the second's current_key made to
    depend on the first's outputs (their sum times 0), so that the first's outputs are freed before the second's are
    allocated: ONNX Runtime's planner then hands the second the first's buffers where it takes their dims for the
    same. The second's outputs reach the graph's through Identity nodes, so they too are values it may plan.
    ``symbolic_heads``: the current keys' and values' heads given as the dim "H"."""
    from onnx import TensorProto, numpy_helper

    def value(name, array):
        dims = list(array.shape)
        if symbolic_heads and name.endswith(("current_key", "current_value")):
            dims[1] = "H"
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), dims)

    names = [n for n in spec.INPUTS if first.get(n) is not None]
    inputs = [value(f"a_{n}", first[n]) for n in names] + [value(f"b_{n}", second[n]) for n in names]
    nodes = [
        helper.make_node("KeyValueCache", [f"a_{n}" for n in names], ["a_key", "a_value"], domain=spec.DOMAIN),
        helper.make_node("ReduceSum", ["a_key"], ["a_sum"], keepdims=0),
        helper.make_node("ReduceSum", ["a_value"], ["a_value_sum"], keepdims=0),
        helper.make_node("Add", ["a_sum", "a_value_sum"], ["a_sums"]),
        helper.make_node("Mul", ["a_sums", "zero"], ["a_zero"]),
        helper.make_node("Add", ["b_current_key", "a_zero"], ["b_key_after_a"]),
        helper.make_node("KeyValueCache", ["b_key_after_a"] + [f"b_{n}" for n in names[1:]], ["b_key", "b_value"],
                         domain=spec.DOMAIN, num_repeat=second_repeat),
        helper.make_node("Identity", ["b_key"], ["second_key"]),
        helper.make_node("Identity", ["b_value"], ["second_value"]),
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
               for n in ("second_key", "second_value", "a_sums")]
    zero = numpy_helper.from_array(np.zeros((), np.float32), "zero")
    graph = helper.make_graph(nodes, "two_caches", inputs, outputs, initializer=[zero])
    return onnx.helper.make_model(graph, ir_version=spec.IR_VERSION, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid(spec.DOMAIN, spec.VERSION)])


@pytest.mark.parametrize("second_seq,second_repeat,symbolic_heads", [((1, 4), 1, False), ((0, 2), 2, True)],
                         ids=["more-keys", "repeated-heads"])
@pytest.mark.parametrize("optimized", [True, False], ids=["optimized", "not-optimized"])
def test_two_cache_nodes_of_different_sizes_in_one_graph(second_seq, second_repeat, symbolic_heads, optimized):
    """Each node's outputs get dims of their own: a graph whose two KeyValueCache nodes gather different numbers of
    keys (and heads) runs, the second node giving the reference's bits (where every node's outputs shared the dim
    names "kv_tokens" and "kv_heads", ONNX Runtime refused the second's: "Shape mismatch attempting to re-use
    buffer")."""
    import onnxruntime as ort

    from kvcache_op.ort_ops import session_options
    from kvcache_op.validation.cases import Seq, build

    first = build("a", [Seq(0, 2)], head_dim=4, t1="float32").inputs
    second = build("b", [Seq(*second_seq)], head_dim=4, t1="float32", num_repeat=second_repeat).inputs
    model = _two_caches_graph(first, second, second_repeat, symbolic_heads)
    options = session_options()
    if not optimized:  # the Identity nodes kept as they are
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {f"{prefix}_{n}": v.copy() for prefix, case in (("a", first), ("b", second))
             for n, v in case.items() if v is not None}
    got_key, got_value, sums = session.run(None, feeds)
    want_first = key_value_cache(**{n: None if v is None else v.copy() for n, v in first.items()})
    want_key, want_value = key_value_cache(**{n: None if v is None else v.copy() for n, v in second.items()},
                                           num_repeat=second_repeat)
    assert got_key.shape == want_key.shape and got_key.tobytes() == want_key.tobytes()
    assert got_value.tobytes() == want_value.tobytes()
    # the first node's outputs, as their sums (summed in another order than numpy's)
    assert np.isclose(sums, want_first[0].sum(dtype=np.float64) + want_first[1].sum(dtype=np.float64), rtol=1e-5)
