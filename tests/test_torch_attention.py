"""The torch MultiHeadAttention op: eager on CPU tensors within the spec's bound of the independent float64
oracle, the reference's errors, traced by torch.compile/torch.export, and exported with both exporters to
one opmx node that runs in ONNX Runtime with the eager op's bits — alone and after KeyValueCache."""

import numpy as np
import onnx
import pytest
from hypothesis import given, settings

torch = pytest.importorskip("torch", reason="the torch front-end needs the 'torch' extra: pip install '.[torch]'")

import kvcache_op.torch as kt  # noqa: E402
from attention_strategies import attention_calls, copies  # noqa: E402
from mha_invalid_calls import INVALID, make_invalid  # noqa: E402
from test_mha_reference import assert_within, oracle  # noqa: E402
from torch_convert import to_numpy, torch_inputs  # noqa: E402

from kvcache_op.ort_ops import run_model  # noqa: E402
from kvcache_op.reference import MultiHeadAttentionError  # noqa: E402
from kvcache_op.spec import mha_schema, schema  # noqa: E402
from kvcache_op.validation.cases import Seq, build  # noqa: E402
from kvcache_op.validation.mha_cases import build_attention  # noqa: E402

NAMES = list(mha_schema.INPUTS)


def eager(case):
    tensors = torch_inputs(copies(case.inputs))
    out = kt.multi_head_attention(**tensors, **case.attributes)
    return to_numpy(out, np.asarray(case.inputs["query"]))


@settings(max_examples=2 * settings.default.max_examples)
@given(attention_calls())
def test_eager_op_is_within_the_bound_of_the_exact_result(case):
    exact, bound = oracle(case)
    got = eager(case)
    assert got.dtype == case.inputs["query"].dtype and got.shape == case.inputs["query"].shape
    assert_within(got, exact, bound, "torch op")
    assert np.all(got[bound == 0] == 0), "a row without an effective key must be exactly zero"


@pytest.mark.parametrize("row", INVALID, ids=[r[0] for r in INVALID])
def test_invalid_call_raises_the_reference_message(row):
    inputs, attrs = make_invalid(row)
    with pytest.raises(MultiHeadAttentionError, match=row[2]):
        kt.multi_head_attention(**torch_inputs(inputs), **attrs)


def test_a_cuda_or_odd_argument_is_refused_clearly():
    case = build_attention("args", [(1, 3)], heads=2, head_dim=4)
    tensors = torch_inputs(copies(case.inputs))
    with pytest.raises(TypeError, match="softmax_scale must be a float"):
        kt.multi_head_attention(**tensors, **dict(case.attributes, softmax_scale="0.5"))
    with pytest.raises(MultiHeadAttentionError, match="decoding_batches must be a torch.Tensor or an int"):
        kt.multi_head_attention(**dict(tensors, decoding_batches=0.0), **case.attributes)


class Attention(torch.nn.Module):
    def __init__(self, **attrs):
        super().__init__()
        self.attrs = attrs

    def forward(self, query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen, attn_mask=None):
        return kt.multi_head_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                                       attn_mask, **self.attrs)


#: (dtype, mask rank, attributes) of the export round trips
EXPORTS = [("float16", 3, dict(num_kv_heads=2)),
           ("float32", None, dict(num_kv_heads=1, sliding_window=3, is_alibi=1, softmax_scale=0.25)),
           ("bfloat16", 2, dict(is_causal=0))]


def attention_pair(dtype, mask, attrs):
    kw = dict(heads=4, kv_heads=attrs.get("num_kv_heads", 0), head_dim=8, t=dtype, mask=mask,
              is_causal=attrs.get("is_causal", 1), is_alibi=attrs.get("is_alibi", 0),
              sliding_window=attrs.get("sliding_window", 0), softmax_scale=attrs.get("softmax_scale", 0.0))
    return (build_attention("export", [(1, 5), (3, 4), (2, 6)], decoding=1, **kw),
            build_attention("run", [(1, 2), (0, 3), (4, 7), (1, 9)], decoding=2, seed=5, **kw))


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("dtype,mask,attrs", EXPORTS, ids=["gqa-mask3", "window-alibi-scale", "bf16-noncausal-mask2"])
def test_export_is_one_node_and_runs_with_the_eager_bits(dynamo, dtype, mask, attrs):
    export_case, run_case = attention_pair(dtype, mask, attrs)
    names = NAMES if mask else NAMES[:8]
    tensors = torch_inputs(copies(export_case.inputs))
    args = tuple(tensors[n] for n in names)
    axes = {n: {0: f"{n}_rows"} for n in ("query", "key", "value", "seqstarts", "kvstarts")}
    if mask:
        axes["attn_mask"] = {mask - 2: "mask_rows", mask - 1: "mask_cols"}
    kwargs = (dict(dynamic_shapes={n: ({a: torch.export.Dim.DYNAMIC for a in axes[n]} if n in axes else None)
                                   for n in names})
              if dynamo else dict(input_names=names, dynamic_axes=axes))
    module = Attention(**export_case.attributes)
    model = kt.export_onnx(module, args, dynamo=dynamo, **kwargs)
    (node,) = [n for n in model.graph.node if n.domain == schema.DOMAIN]
    assert node.op_type == mha_schema.OP_TYPE and list(node.input) == names
    written = {a.name: (a.f if a.type == onnx.AttributeProto.FLOAT else a.i) for a in node.attribute}
    assert written == mha_schema.attention_node_attributes(export_case.attributes)
    want = eager(run_case)
    (got,) = run_model(model, {k: v for k, v in copies(run_case.inputs).items() if v is not None})
    assert got.tobytes() == want.tobytes()
    exact, bound = oracle(run_case)
    assert_within(got, exact, bound, "exported")


def _export_args(attrs=None):
    export_case, _ = attention_pair("float32", None, attrs or {})
    tensors = torch_inputs(copies(export_case.inputs))
    return export_case.attributes, tuple(tensors[n] for n in NAMES[:8])


@pytest.mark.parametrize("change, message", [(dict(is_causal=2), "is_causal must be 0 or 1"),
                                             (dict(num_kv_heads=3), "num_kv_heads")])
def test_the_dynamo_path_checks_the_attributes_without_data(change, message):
    """Nothing runs while the dynamo exporter traces: the attribute values are checked there, with the reference's
    message, not left to the session the model is loaded in."""
    attributes, args = _export_args()
    with pytest.raises(MultiHeadAttentionError, match=message):
        kt.export_onnx(Attention(**dict(attributes, **change)), args, dynamo=True)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_an_attention_call_whose_output_nothing_uses_is_reported(dynamo):
    class Unused(Attention):
        def forward(self, *args):
            super().forward(*args)
            return args[0] + 1

    attributes, args = _export_args()
    with pytest.raises(ValueError, match=r"1 MultiHeadAttention call\(s\) exported as 0 node\(s\)"):
        kt.export_onnx(Unused(**attributes), args, dynamo=dynamo)


class Layer(torch.nn.Module):
    """KeyValueCache then MultiHeadAttention over its packed outputs, as ppl.pmx's non-fused export."""

    def forward(self, query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                decoding_batches, max_seqlen, max_kvlen, cache):
        key, value = kt.key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                                        max_seqlen, max_kvlen, cache, cache_mode=1, page_size=4)
        return kt.multi_head_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen,
                                       max_kvlen, num_heads=4, head_dim=8, num_kv_heads=2)


LAYER_INPUTS = ["query", "current_key", "current_value", "seqstarts", "kvstarts", "cachestarts", "start_pos",
                "decoding_batches", "max_seqlen", "max_kvlen", "cache"]


def layer_inputs(seqs, decoding, seed):
    kv = build("layer", seqs, heads=2, head_dim=8, cache_mode=1, page_size=4, t1="float32", max_t=64, max_pages=4,
               seed=seed)
    query = np.random.default_rng(seed).standard_normal((kv.inputs["current_key"].shape[0], 4, 8)).astype(np.float32)
    return dict(kv.inputs, query=query, decoding_batches=np.array(decoding, np.int64))


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_a_cache_then_attention_layer_exports_and_runs_like_eager(dynamo):
    export_inputs = layer_inputs([Seq(4, 1), Seq(0, 3), Seq(2, 2)], 1, 1)
    run_inputs = layer_inputs([Seq(6, 1), Seq(3, 1), Seq(0, 4), Seq(1, 2)], 2, 2)
    tensors = torch_inputs(copies(export_inputs))
    axes = {"query": (0,), "current_key": (0,), "current_value": (0,), "seqstarts": (0,), "kvstarts": (0,),
            "cachestarts": (0, 1), "start_pos": (0,)}
    kwargs = (dict(dynamic_shapes={n: ({a: torch.export.Dim.DYNAMIC for a in axes[n]} if n in axes else None)
                                   for n in LAYER_INPUTS})
              if dynamo else dict(input_names=LAYER_INPUTS, dynamic_axes={n: {a: f"{n}{a}" for a in v}
                                                                         for n, v in axes.items()}))
    model = kt.export_onnx(Layer(), tuple(tensors[n] for n in LAYER_INPUTS), dynamo=dynamo, **kwargs)
    assert [n.op_type for n in model.graph.node if n.domain == schema.DOMAIN] == ["KeyValueCache",
                                                                                  "MultiHeadAttention"]
    fresh = torch_inputs(copies(run_inputs))
    want = Layer()(**{n: fresh[n] for n in LAYER_INPUTS})
    feeds = {n: v for n, v in copies(run_inputs).items() if n in LAYER_INPUTS}
    (got,) = run_model(model, feeds)
    assert got.tobytes() == want.numpy().tobytes()
    assert feeds["cache"].tobytes() == fresh["cache"].numpy().tobytes()


def test_torch_compile_and_export_trace_the_attention_op():
    case = build_attention("trace", [(1, 5), (3, 4)], heads=4, kv_heads=2, head_dim=8, decoding=1, t="float32")
    module = Attention(**case.attributes)
    tensors = torch_inputs(copies(case.inputs))
    del tensors["attn_mask"]
    want = module(**tensors)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(module, backend="aot_eager", fullgraph=True)(**tensors), want)
    program = torch.export.export(module, (), kwargs=tensors)
    assert torch.equal(program.module()(**tensors), want)
