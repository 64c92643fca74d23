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
