"""The torch MultiHeadCacheAttention op and the C entry point under it: eager on CPU tensors (the cache bit for
bit the naive KeyValueCache's, the output within the spec's bound of the naive float64 attention), the
reference's errors with the cache unchanged, traced by torch.compile/torch.export, and exported with both
exporters to one ppl.pmx-style node that runs in ONNX Runtime with the eager op's bits."""

import numpy as np
import onnx
import pytest
from hypothesis import given, settings

torch = pytest.importorskip("torch", reason="the torch front-end needs the 'torch' extra: pip install '.[torch]'")

import kvcache_op.torch as kt  # noqa: E402
from ort_helpers import copies  # noqa: E402
from test_mha_reference import assert_within  # noqa: E402
from test_mhca_ort_cpu import naive_oracle  # noqa: E402
from test_mhca_reference import cache_attention_calls  # noqa: E402
from torch_convert import to_numpy, torch_inputs  # noqa: E402

from kvcache_op.capi import c_api  # noqa: E402
from kvcache_op.ort_ops import run_model  # noqa: E402
from kvcache_op.reference import KeyValueCacheError  # noqa: E402
from kvcache_op.spec import mhca_schema, schema  # noqa: E402
from kvcache_op.validation.cases import Seq  # noqa: E402
from kvcache_op.validation.mhca_cases import build_cache_attention  # noqa: E402

NAMES = list(mhca_schema.INPUTS)


@settings(deadline=None)
@given(cache_attention_calls())
def test_eager_op_and_c_entry_write_the_naive_cache_and_are_within_the_bound(call):
    inputs, attributes = call
    exact, bound, cache_after, scale_after = naive_oracle(inputs, attributes)
    tensors = torch_inputs(copies(inputs))
    got = to_numpy(kt.multi_head_cache_attention(**tensors, **attributes), np.asarray(inputs["query"]))
    assert to_numpy(tensors["cache"], inputs["cache"]).tobytes() == cache_after.tobytes()
    if scale_after is not None:
        assert to_numpy(tensors["scale"], scale_after).tobytes() == scale_after.tobytes()
    assert_within(got, exact, bound, "torch op")
    c_inputs = copies(inputs)
    assert_within(c_api.multi_head_cache_attention(**c_inputs, **attributes, num_threads=2), exact, bound, "C entry")
    assert c_inputs["cache"].tobytes() == cache_after.tobytes()


@pytest.mark.parametrize("change, message", [
    (lambda t, a: t.update(start_pos=t["start_pos"] + 1000), "cachestarts"),
    (lambda t, a: t.update(decoding_batches=torch.tensor(7)), "decoding_batches = 7 must be in"),
    (lambda t, a: a.update(num_heads=3), "num_kv_heads must be 0"),
    (lambda t, a: a.update(softcap=-50.0), "softcap must be finite and >= 0"),
])
def test_an_invalid_call_raises_the_references_message_and_writes_nothing(change, message):
    case = build_cache_attention("torch-invalid", [Seq(3, 1), Seq(0, 4)], cache_mode=1, page_size=4, decoding=1)
    tensors, attributes = torch_inputs(copies(case.inputs)), dict(case.attributes)
    change(tensors, attributes)
    before = tensors["cache"].clone()
    with pytest.raises(KeyValueCacheError, match=message):
        kt.multi_head_cache_attention(**tensors, **attributes)
    assert torch.equal(tensors["cache"], before)


class CacheAttention(torch.nn.Module):
    def __init__(self, **attributes):
        super().__init__()
        self.attributes = attributes

    def forward(self, query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                decoding_batches, max_seqlen, max_kvlen, cache, scale=None):
        return kt.multi_head_cache_attention(query, current_key, current_value, seqstarts, kvstarts, cachestarts,
                                             start_pos, decoding_batches, max_seqlen, max_kvlen, cache, scale,
                                             **self.attributes)


def call(name, seqs, **kw):
    return build_cache_attention(name, seqs, heads=2, head_dim=8, group=2, cache_mode=1, page_size=4, t1="float32",
                                 max_t=64, max_pages=5, **kw)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("quant_bit", [0, 8])
def test_export_is_one_node_and_runs_with_the_eager_bits(dynamo, quant_bit):
    export_case = call("export", [Seq(4, 1), Seq(0, 3)], decoding=1, quant_bit=quant_bit)
    run_case = call("run", [Seq(6, 1), Seq(3, 1), Seq(0, 4), Seq(1, 2)], decoding=2, quant_bit=quant_bit)
    names = NAMES[:12] if quant_bit else NAMES[:11]
    tensors = torch_inputs(copies(export_case.inputs))
    axes = {"query": (0,), "current_key": (0,), "current_value": (0,), "seqstarts": (0,), "kvstarts": (0,),
            "cachestarts": (0, 1), "start_pos": (0,)}
    kwargs = (dict(dynamic_shapes={n: ({a: torch.export.Dim.DYNAMIC for a in axes[n]} if n in axes else None)
                                   for n in names})
              if dynamo else dict(input_names=names, dynamic_axes={n: {a: f"{n}{a}" for a in v} for n, v in axes.items()}))
    model = kt.export_onnx(CacheAttention(**export_case.attributes), tuple(tensors[n] for n in names), dynamo=dynamo,
                           **kwargs)
    (node,) = [n for n in model.graph.node if n.domain == schema.DOMAIN]
    assert node.op_type == mhca_schema.OP_TYPE and len(node.input) == len(names)
    written = {a.name: (a.f if a.type == onnx.AttributeProto.FLOAT else a.i) for a in node.attribute}
    assert written == mhca_schema.cache_attention_node_attributes(export_case.attributes)
    fresh = torch_inputs(copies(run_case.inputs))
    want = CacheAttention(**run_case.attributes)(*(fresh[n] for n in names))
    feeds = {n: v for n, v in copies(run_case.inputs).items() if n in names}
    (got,) = run_model(model, feeds)
    assert got.tobytes() == want.numpy().tobytes()
    assert feeds["cache"].tobytes() == fresh["cache"].numpy().tobytes()


def _export_args(**kw):
    export_case = call("export", [Seq(4, 1), Seq(0, 3)], decoding=1, **kw)
    tensors = torch_inputs(copies(export_case.inputs))
    names = NAMES[:12] if kw.get("quant_bit") else NAMES[:11]
    return export_case.attributes, tuple(tensors[n] for n in names)


@pytest.mark.parametrize("change, message", [(dict(layer_idx=3), "layer_idx must be in"),
                                             (dict(is_alibi=2), "is_alibi must be 0 or 1")])
def test_the_dynamo_path_checks_the_cache_and_attention_attributes_without_data(change, message):
    attributes, args = _export_args()
    with pytest.raises(KeyValueCacheError, match=message):
        kt.export_onnx(CacheAttention(**dict(attributes, **change)), args, dynamo=True)


def test_the_dynamo_path_checks_that_a_quantized_cache_has_a_scale():
    attributes, args = _export_args(quant_bit=8)
    with pytest.raises(KeyValueCacheError, match="scale is required when quant_bit is 8"):
        kt.export_onnx(CacheAttention(**attributes), args[:11], dynamo=True)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_a_cache_attention_call_whose_output_nothing_uses_is_reported(dynamo):
    class Unused(CacheAttention):
        def forward(self, *args):
            super().forward(*args)
            return args[0] + 1

    attributes, args = _export_args()
    with pytest.raises(ValueError, match=r"1 MultiHeadCacheAttention call\(s\) exported as 0 node\(s\)"):
        kt.export_onnx(Unused(**attributes), args, dynamo=dynamo)


def test_torch_compile_and_export_trace_the_op():
    case = call("trace", [Seq(4, 1), Seq(0, 3)], decoding=1)
    names = NAMES[:11]
    module = CacheAttention(**case.attributes)
    first, second = torch_inputs(copies(case.inputs)), torch_inputs(copies(case.inputs))
    want = module(*(first[n] for n in names))
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(*(second[n] for n in names)), want)
    assert torch.equal(second["cache"], first["cache"])  # the compiled call wrote the cache as eager did
    program = torch.export.export(module, tuple(torch_inputs(copies(case.inputs))[n] for n in names))
    assert torch.equal(program.module()(*(torch_inputs(copies(case.inputs))[n] for n in names)), want)
