"""A graph exported the way ppl.pmx exports KeyValueCache loads and runs in ONNX Runtime with the library.

The module below mirrors ppl.pmx's export (an autograd.Function whose ``symbolic`` emits the node,
TorchScript exporter): ir_version 6 / default opset 11, ``max_seqlen``/``max_kvlen`` of shape ``(1,)``,
attributes in alphabetical order (the TorchScript exporter sorts them), and for an unquantized cache an
empty ``kv_scale`` tensor as the tenth input — which the spec treats as absent."""

import io

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch", reason="the torch front-end needs the 'torch' extra: pip install '.[torch]'")

from ort_helpers import assert_same_bits, copies, reference_result  # noqa: E402
from torch_convert import torch_inputs  # noqa: E402

from kvcache_op.ort_ops import make_session, run_model  # noqa: E402
from kvcache_op.spec import schema  # noqa: E402
from kvcache_op.validation.cases import Seq, build  # noqa: E402

INPUT_NAMES = ["current_key", "current_value", "seqstarts", "kvstarts", "cachestarts", "start_pos", "max_seqlen",
               "max_kvlen", "cache", "kv_scale"]
ATTRIBUTES = dict(num_layer=2, layer_idx=1, quant_bit=0, quant_group=8, num_repeat=2, cache_mode=1, cache_layout=3,
                  page_size=4)


class PplStyleKeyValueCache(torch.autograd.Function):
    """ppl.pmx's export pattern, written here: the node comes from ``symbolic``; under export ``forward``
    only has to return tensors of the outputs' dtype."""

    @staticmethod
    def symbolic(g, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                 cache, kv_scale, num_layer, layer_idx, quant_bit, quant_group, num_repeat, cache_mode, cache_layout,
                 page_size):
        return g.op("opmx.dynamic_batching::KeyValueCache", current_key, current_value, seqstarts, kvstarts,
                    cachestarts, start_pos, max_seqlen, max_kvlen, cache, kv_scale, num_layer_i=num_layer,
                    layer_idx_i=layer_idx, quant_bit_i=quant_bit, quant_group_i=quant_group, num_repeat_i=num_repeat,
                    cache_mode_i=cache_mode, cache_layout_i=cache_layout, page_size_i=page_size, outputs=2)

    @staticmethod
    def forward(ctx, current_key, current_value, *rest):
        return current_key.clone(), current_value.clone()


class PplStyleModule(torch.nn.Module):
    def forward(self, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                cache, kv_scale):
        return PplStyleKeyValueCache.apply(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                                           max_seqlen, max_kvlen, cache, kv_scale, *ATTRIBUTES.values())


class PplStyleConstantScale(torch.nn.Module):
    """ppl.pmx's model code makes the placeholder inside forward, in the model's dtype: a Constant node."""

    def forward(self, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                cache):
        kv_scale = torch.empty(0, dtype=current_key.dtype)
        return PplStyleKeyValueCache.apply(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                                           max_seqlen, max_kvlen, cache, kv_scale, *ATTRIBUTES.values())


def _case(seqs, seed, t1="float16"):
    case = build("ppl-style", seqs, num_layer=2, layer_idx=1, heads=2, head_dim=8, num_repeat=2, cache_mode=1,
                 cache_layout=3, page_size=4, t1=t1, max_t=64, max_pages=4, scalar_max=False, seed=seed)
    assert case.inputs["max_seqlen"].shape == (1,) and case.inputs["scale"] is None
    return case


def _ppl_style_model(constant_scale=False, t1="float16") -> onnx.ModelProto:
    case = _case([Seq(0, 3), Seq(4, 1)], 1, t1)
    tensors = torch_inputs(copies(case.inputs))
    args = [tensors[n] for n in INPUT_NAMES[:-1]]
    names = INPUT_NAMES[:-1] if constant_scale else INPUT_NAMES
    if not constant_scale:
        args.append(torch.empty(0, dtype=tensors["current_key"].dtype))
    dynamic = {n: {0: f"{n}_0"} for n in INPUT_NAMES[:6]}
    dynamic["cachestarts"][1] = "max_pages"
    buffer = io.BytesIO()
    module = PplStyleConstantScale() if constant_scale else PplStyleModule()
    torch.onnx.export(module, tuple(args), buffer, dynamo=False, opset_version=11, input_names=names,
                      output_names=["key", "value"], dynamic_axes=dynamic)
    return onnx.load_from_string(buffer.getvalue())


def test_the_ppl_style_graph_has_ppls_shape():
    model = _ppl_style_model()
    assert model.ir_version == 6
    assert {o.domain: o.version for o in model.opset_import}[""] == 11
    (node,) = model.graph.node
    assert (node.domain, node.op_type) == (schema.DOMAIN, schema.OP_TYPE)
    assert [a.name for a in node.attribute] == sorted(ATTRIBUTES)
    assert list(node.input) == INPUT_NAMES
    shapes = {i.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in i.type.tensor_type.shape.dim]
              for i in model.graph.input}
    assert shapes["max_seqlen"] == [1] and shapes["max_kvlen"] == [1] and shapes["kv_scale"] == [0]


# No bfloat16 constant: opset 11's Constant has no bfloat16 (from opset 13), so that graph is invalid ONNX.
@pytest.mark.parametrize("constant_scale,t1", [(False, "float16"), (True, "float16"), (False, "bfloat16")],
                         ids=["scale-input", "scale-constant", "scale-input-bfloat16"])
def test_the_ppl_style_graph_runs_in_ort_like_the_reference_without_a_scale(constant_scale, t1):
    model = _ppl_style_model(constant_scale, t1)
    schema.register()
    onnx.checker.check_model(model, full_check=True)  # T3 admits the bfloat16 placeholder
    make_session(model)  # loads: the graph rules and the library accept it
    run_case = _case([Seq(1, 2), Seq(0, 0), Seq(6, 1), Seq(2, 3)], 2, t1)  # another batch than the exported one
    want = reference_result(run_case.inputs, run_case.attributes)
    feeds = copies(run_case.inputs)
    if not constant_scale:
        feeds["kv_scale"] = np.zeros(0, np.asarray(run_case.inputs["current_key"]).dtype)
    del feeds["scale"]
    key, value = run_model(model, feeds)
    assert_same_bits((key, value, feeds["cache"]), want[:3])
