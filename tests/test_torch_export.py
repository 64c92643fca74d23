"""Modules calling the torch ops export with both exporters (dynamo and TorchScript) to one opmx node per
call — schema input order, every attribute, the cache and scale fed straight from graph inputs, the
launch bounds as graph inputs — pass the full ONNX checker, and run in ONNX Runtime with the library,
bit-identical to the eager op on a batch other than the one exported with."""

import io

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch", reason="the torch front-end needs the 'torch' extra: pip install '.[torch]'")

import kvcache_op.torch as kt  # noqa: E402
from ort_helpers import assert_same_bits, copies, reference_result  # noqa: E402
from torch_convert import to_numpy, torch_inputs  # noqa: E402

from kvcache_op.ort_ops import run_model  # noqa: E402
from kvcache_op.ort_ops.graph_rules import in_place_inputs  # noqa: E402
from kvcache_op.reference import key_cache_rotary_shift, rotary_shift_tables  # noqa: E402
from kvcache_op.spec import rotary_schema, schema  # noqa: E402
from kvcache_op.validation.cases import Seq, build  # noqa: E402

NAMES = list(schema.INPUTS)
DYNAMIC_AXES = {"current_key": (0,), "current_value": (0,), "seqstarts": (0,), "kvstarts": (0,),
                "cachestarts": (0,), "start_pos": (0,)}  # paged cachestarts (B, MaxP): both axes
EXPORT_BATCH = [Seq(0, 3), Seq(5, 1), Seq(2, 2)]
RUN_BATCH = [Seq(1, 2), Seq(0, 0), Seq(7, 1, 4), Seq(3, 4)]  # another B and token count, a partial load
#: (quant_bit, cache_mode, cache_layout, T1, T3, num_repeat)
COMBOS = [(0, 0, 0, "float16", "float32", 1), (8, 1, 3, "bfloat16", "float16", 2), (4, 1, 1, "float32", "float32", 1),
          (0, 1, 2, "float32", "float32", 3), (8, 0, 1, "float16", "float32", 1), (4, 0, 3, "float16", "float16", 2)]


class KeyValueCacheModule(torch.nn.Module):
    def __init__(self, **attrs):
        super().__init__()
        self.attrs = attrs

    def forward(self, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                cache, scale=None):
        return kt.key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                                  max_kvlen, cache, scale, **self.attrs)


class TwoLayers(torch.nn.Module):
    """Two layers sharing one cache through layer_idx."""

    def __init__(self, **attrs):
        super().__init__()
        self.attrs = attrs

    def forward(self, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                cache, scale=None):
        index = (seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen)
        k0, v0 = kt.key_value_cache(current_key, current_value, *index, cache, scale, layer_idx=0, **self.attrs)
        k1, v1 = kt.key_value_cache(current_value, current_key, *index, cache, scale, layer_idx=1, **self.attrs)
        return k0 - k1, v0 + v1


def case_pair(quant_bit, mode, layout, t1, t3, repeat, num_layer=1):
    """(export case, run case): different batches over the same cache shape."""
    kw = dict(num_layer=num_layer, heads=2, head_dim=8, quant_bit=quant_bit, quant_group=4, num_repeat=repeat,
              cache_mode=mode, cache_layout=layout, page_size=4, t1=t1, t3=t3, max_t=64, max_pages=4)
    return build("export", EXPORT_BATCH, **kw), build("run", RUN_BATCH, seed=7, **kw)


def arguments(case):
    tensors = torch_inputs(copies(case.inputs))
    return tuple(tensors[name] for name in NAMES if tensors[name] is not None)


def export_kwargs(dynamo, names, cache_mode):
    """Token and batch axes dynamic, in each exporter's terms."""
    axes = dict(DYNAMIC_AXES, cachestarts=(0, 1) if cache_mode else (0,))
    if dynamo:
        return dict(dynamic_shapes={n: ({a: torch.export.Dim.DYNAMIC for a in axes[n]} if n in axes else None)
                                    for n in names})
    return dict(input_names=names, dynamic_axes={n: {a: f"{n}_{a}" for a in axes[n]} for n in names if n in axes})


def eager(module, case):
    """Outputs, cache and scale of the eager module on copies of the case, as numpy."""
    tensors = torch_inputs(copies(case.inputs))
    outputs = module(**{k: v for k, v in tensors.items() if v is not None})
    like = np.asarray(case.inputs["current_key"])
    return ([to_numpy(o, np.empty(tuple(o.shape), like.dtype)) for o in outputs],
            to_numpy(tensors["cache"], case.inputs["cache"]), to_numpy(tensors["scale"], case.inputs["scale"]))


def on_ort(model, case):
    feeds = copies(case.inputs)
    outputs = run_model(model, {k: v for k, v in feeds.items() if v is not None})
    return list(outputs), feeds["cache"], feeds["scale"]


def ops_of(model, op_type):
    return [n for n in model.graph.node if n.domain == schema.DOMAIN and n.op_type == op_type]


def assert_in_place_graph(model, names):
    """The cache/scale are graph inputs (no initializer) read only by the ops, never copied or output."""
    in_place = in_place_inputs(model)
    assert in_place == {n for n in ("cache", "scale") if n in names}
    assert not {i.name for i in model.graph.initializer} & in_place
    assert not {o.name for o in model.graph.output} & in_place
    for node in model.graph.node:
        if node.domain != schema.DOMAIN:
            assert not set(node.input) & in_place, f"{node.op_type} reads the cache"


def assert_one_kv_node(model, attrs, names):
    nodes = ops_of(model, schema.OP_TYPE)
    assert len(nodes) == 1, [n.op_type for n in model.graph.node]
    node = nodes[0]
    graph_inputs = {i.name for i in model.graph.input}
    assert list(node.input) == names and set(names) <= graph_inputs  # schema order, fed by graph inputs
    assert {a.name: a.i for a in node.attribute} == {**schema.ATTRIBUTE_DEFAULTS, **attrs}
    assert_in_place_graph(model, names)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "q{}-mode{}-layout{}-{}-{}-repeat{}".format(*c))
def test_export_round_trip_is_one_node_and_bit_identical_on_ort(dynamo, combo, tmp_path):
    quant_bit, mode, layout, _, _, repeat = combo
    export_case, run_case = case_pair(*combo)
    attrs = dict(quant_bit=quant_bit, quant_group=4, num_repeat=repeat, cache_mode=mode, cache_layout=layout,
                 page_size=4)
    module = KeyValueCacheModule(**attrs)
    names = NAMES if quant_bit else NAMES[:9]
    path = tmp_path / "kv.onnx"
    kt.export_onnx(module, arguments(export_case), path, dynamo=dynamo, **export_kwargs(dynamo, names, mode))
    model = onnx.load(str(path))
    assert_one_kv_node(model, attrs, names)
    want = eager(module, run_case)
    got = on_ort(model, run_case)
    assert_same_bits((*got[0], got[1], got[2]), (*want[0], want[1], want[2]))
    assert_same_bits((*want[0], want[1], want[2]), reference_result(run_case.inputs, run_case.attributes))


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_plain_torch_onnx_export_works_without_the_wrapper(dynamo):
    """What a user types: torch.onnx.export itself (int8 here; int4 caches need int4_cache_inputs)."""
    export_case, run_case = case_pair(8, 1, 0, "float16", "float32", 1)
    module = KeyValueCacheModule(quant_bit=8, quant_group=4, cache_mode=1, page_size=4)
    kwargs = export_kwargs(dynamo, NAMES, 1)
    if dynamo:
        model = torch.onnx.export(module, arguments(export_case), dynamo=True, **kwargs).model_proto
    else:
        buffer = io.BytesIO()
        torch.onnx.export(module, arguments(export_case), buffer, dynamo=False, **kwargs)
        model = onnx.load_from_string(buffer.getvalue())
    schema.register()
    onnx.checker.check_model(model, full_check=True)
    assert_one_kv_node(model, dict(quant_bit=8, quant_group=4, cache_mode=1, page_size=4), NAMES)
    want = eager(module, run_case)
    got = on_ort(model, run_case)
    assert_same_bits((*got[0], got[1], got[2]), (*want[0], want[1], want[2]))


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("quant_bit", [0, 8])
def test_two_layers_share_one_cache_through_layer_idx(dynamo, quant_bit):
    export_case, run_case = case_pair(quant_bit, 1, 3, "float32", "float32", 1, num_layer=2)
    attrs = dict(num_layer=2, quant_bit=quant_bit, quant_group=4, cache_mode=1, cache_layout=3, page_size=4)
    module = TwoLayers(**attrs)
    names = NAMES if quant_bit else NAMES[:9]
    model = kt.export_onnx(module, arguments(export_case), dynamo=dynamo, **export_kwargs(dynamo, names, 1))
    nodes = ops_of(model, schema.OP_TYPE)
    assert sorted(next(a.i for a in n.attribute if a.name == "layer_idx") for n in nodes) == [0, 1]
    assert all(n.input[8] == "cache" for n in nodes)
    assert_in_place_graph(model, names)
    want = eager(module, run_case)
    got = on_ort(model, run_case)
    assert_same_bits((*got[0], got[1], got[2]), (*want[0], want[1], want[2]))
    layer1 = reference_result(run_case.inputs, dict(run_case.attributes, layer_idx=1))
    assert not np.array_equal(want[1], layer1[2])  # both layers wrote: the cache is not layer 1's alone


class RotaryShiftModule(torch.nn.Module):
    def __init__(self, **attrs):
        super().__init__()
        self.attrs = attrs

    def forward(self, cache, scale, slots, cos, sin):
        return kt.key_cache_rotary_shift(cache, scale, slots, cos, sin, **self.attrs)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("quant_bit", [0, 8, 4])
def test_rotary_shift_exports_to_one_node_and_runs_bit_identical(dynamo, quant_bit):
    rng = np.random.default_rng(quant_bit)
    case = build("rotary", [Seq(0, 6)], num_layer=2, heads=2, head_dim=8, quant_bit=quant_bit, quant_group=4,
                 cache_layout=2, t1="float32", max_t=16)
    attrs = dict(num_layer=2, layer_idx=1, cache_layout=2, quant_bit=quant_bit, quant_group=4, rotary_dim=4)

    def inputs(count):
        slots = rng.permutation(16)[:count].astype(np.int64)
        cos, sin = rotary_shift_tables(rng.integers(-9, 9, count), 4)
        return dict(cache=case.inputs["cache"], scale=case.inputs["scale"], slots=slots, cos=cos, sin=sin)

    export_inputs, run_inputs = inputs(3), inputs(5)
    tensors = torch_inputs(copies(export_inputs))
    kwargs = (dict(dynamic_shapes={"cache": None, "scale": None, "slots": {0: torch.export.Dim.DYNAMIC},
                                   "cos": {0: torch.export.Dim.DYNAMIC}, "sin": {0: torch.export.Dim.DYNAMIC}})
              if dynamo else dict(input_names=[n for n in rotary_schema.INPUTS if quant_bit or n != "scale"],
                                  dynamic_axes={n: {0: "n"} for n in ("slots", "cos", "sin")}))
    module = RotaryShiftModule(**attrs)
    args = tuple(tensors[n] for n in rotary_schema.INPUTS) if quant_bit else (tensors["cache"], None,
                                                                             *(tensors[n] for n in rotary_schema.INPUTS[2:]))
    model = kt.export_onnx(module, args, dynamo=dynamo, **kwargs)
    nodes = ops_of(model, rotary_schema.OP_TYPE)
    assert len(nodes) == 1
    assert list(nodes[0].input) == ["cache", "scale" if quant_bit else "", "slots", "cos", "sin"]
    assert {a.name: a.i for a in nodes[0].attribute} == {**rotary_schema.ATTRIBUTE_DEFAULTS, **attrs}
    assert_in_place_graph(model, ["cache", "scale"] if quant_bit else ["cache"])
    want = copies(run_inputs)
    want_slots = key_cache_rotary_shift(**want, **attrs)
    tensors = torch_inputs(copies(run_inputs))
    eager_slots = module(**tensors)
    assert np.array_equal(eager_slots.numpy(), want_slots)
    assert to_numpy(tensors["cache"], want["cache"]).tobytes() == want["cache"].tobytes()
    feeds = copies(run_inputs)
    (slots_out,) = run_model(model, {k: v for k, v in feeds.items() if v is not None})
    assert np.array_equal(slots_out, want_slots)
    assert_same_bits((feeds["cache"], feeds["scale"]), (want["cache"], want["scale"]), names=("cache", "scale"))


def test_int4_cache_inputs_refuses_a_cache_that_is_not_a_graph_input():
    export_case, _ = case_pair(4, 0, 0, "float32", "float32", 1)
    model = kt.export_onnx(KeyValueCacheModule(quant_bit=4, quant_group=4), arguments(export_case), dynamo=False,
                           **export_kwargs(False, NAMES, 0))
    cache = next(i for i in model.graph.input if i.name == "cache")
    assert cache.type.tensor_type.elem_type == onnx.TensorProto.INT4
    assert [d.dim_value for d in cache.type.tensor_type.shape.dim][-1] == 8  # Dh, not the packed Dh/2
    model.graph.node[0].input[8] = "elsewhere"
    with pytest.raises(ValueError, match="is not a graph input"):
        kt.int4_cache_inputs(model)


class StoreOnly(torch.nn.Module):
    """A fill-only step: the outputs are not used, so an exporter drops the node."""

    def forward(self, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                cache):
        kt.key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                           max_kvlen, cache)
        return current_key * 2


class ShiftThenStore(torch.nn.Module):
    """A rotation and a store of the same layer with no data path between them."""

    def forward(self, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                cache, slots, cos, sin):
        shifted = kt.key_cache_rotary_shift(cache, None, slots, cos, sin)
        key, _ = kt.key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                                    max_kvlen, cache)
        return shifted, key


class ReadCacheAfter(torch.nn.Module):
    def forward(self, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                cache):
        key, _ = kt.key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                                    max_kvlen, cache)
        return key, cache.sum()


def _plain_args(extra=()):
    export_case, _ = case_pair(0, 0, 0, "float32", "float32", 1)
    return arguments(export_case) + tuple(extra)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_a_call_whose_outputs_nothing_uses_is_reported_not_silently_dropped(dynamo):
    with pytest.raises(ValueError, match=r"1 KeyValueCache call\(s\) exported as 0 node\(s\)"):
        kt.export_onnx(StoreOnly(), _plain_args(), dynamo=dynamo)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_unordered_writes_of_one_layer_are_refused_at_export(dynamo):
    slots = torch.tensor([0, 1, 2])
    cos, sin = (torch.from_numpy(t) for t in rotary_shift_tables(np.array([1, 1, 1]), 8))
    with pytest.raises(ValueError, match="both write layer 0 of .* and no data path orders them"):
        kt.export_onnx(ShiftThenStore(), _plain_args((slots, cos, sin)), dynamo=dynamo)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_reading_the_cache_next_to_the_op_is_refused_at_export(dynamo):
    with pytest.raises(ValueError, match="reads .*, which KeyValueCache node .* writes in place"):
        kt.export_onnx(ReadCacheAfter(), _plain_args(), dynamo=dynamo)


def test_the_dynamo_optimizer_merging_identical_calls_is_reported():
    class ShiftTwice(torch.nn.Module):
        def forward(self, cache, slots, cos, sin):
            return kt.key_cache_rotary_shift(cache, None, slots, cos, sin) + kt.key_cache_rotary_shift(
                cache, None, slots, cos, sin)

    cache = torch.zeros(8, 1, 2, 2, 8)
    cos, sin = (torch.from_numpy(t) for t in rotary_shift_tables(np.array([1, 2]), 8))
    with pytest.raises(ValueError, match=r"2 KeyCacheRotaryShift call\(s\) exported as 1 node\(s\)"):
        kt.export_onnx(ShiftTwice(), (cache, torch.tensor([0, 3]), cos, sin), dynamo=True, optimize=True)


@pytest.mark.parametrize("attrs,message", [(dict(layer_idx=5), "layer_idx must be in"),
                                           (dict(quant_bit=8), "scale is required when quant_bit is 8"),
                                           (dict(cache_layout=9), "cache_layout must be 0, 1, 2 or 3")])
def test_the_dynamo_path_checks_what_it_can_without_data(attrs, message):
    from kvcache_op.reference import KeyValueCacheError

    with pytest.raises(KeyValueCacheError, match=message):
        kt.export_onnx(KeyValueCacheModule(**attrs), _plain_args(), dynamo=True)


def test_one_tensor_passed_twice_is_refused_by_the_dynamo_path():
    """torch.export makes k passed as current_key and current_value one graph input, which then feeds both: a
    graph that ignores the value fed at run time. The TorchScript exporter keeps two inputs."""
    args = list(_plain_args())
    args[1] = args[0]
    with pytest.raises(ValueError, match=r"args\[0\] and args\[1\] are the same tensor"):
        kt.export_onnx(KeyValueCacheModule(), tuple(args), dynamo=True)
    model = kt.export_onnx(KeyValueCacheModule(), tuple(args), dynamo=False)
    node = next(n for n in model.graph.node if n.op_type == "KeyValueCache")
    assert node.input[0] != node.input[1]


def test_one_tensor_passed_twice_inside_nested_arguments_is_refused_by_the_dynamo_path():
    """Inside a tuple (k as both halves of a pair), a dict (seqstarts as kvstarts in a batch dict: a prefill from
    position 0 has them equal) or once in args and once in the export's kwargs: each exported one graph input feeding
    both places, and ONNX Runtime then read the value as the key, or seqstarts from kvstarts."""
    args = _plain_args()

    class Pair(torch.nn.Module):
        def forward(self, kv, *rest):
            return kt.key_value_cache(kv[0], kv[1], *rest)

    class Batch(torch.nn.Module):
        def forward(self, batch):
            return kt.key_value_cache(**batch)

    class Keyword(torch.nn.Module):
        def forward(self, k, *rest, v=None):
            return kt.key_value_cache(k, v, *rest)

    names = ("current_key", "current_value", "seqstarts", "kvstarts", "cachestarts", "start_pos", "max_seqlen",
             "max_kvlen", "cache")
    with pytest.raises(ValueError, match=r"args\[0\]\[0\] and args\[0\]\[1\] are the same tensor"):
        kt.export_onnx(Pair(), ((args[0], args[0]), *args[2:9]), dynamo=True)
    batch = dict(zip(names, args[:9]))
    batch["kvstarts"] = batch["seqstarts"]
    with pytest.raises(ValueError, match=r"args\[0\]\['seqstarts'\] and args\[0\]\['kvstarts'\] are the same"):
        kt.export_onnx(Batch(), (batch,), dynamo=True)
    with pytest.raises(ValueError, match=r"args\[0\] and kwargs\['v'\] are the same tensor"):
        kt.export_onnx(Keyword(), (args[0], *args[2:9]), dynamo=True, kwargs=dict(v=args[0]))
    model = kt.export_onnx(Pair(), ((args[0], args[1]), *args[2:9]), dynamo=True)  # distinct tensors: two inputs
    node = next(n for n in model.graph.node if n.op_type == "KeyValueCache")
    assert node.input[0] != node.input[1]


@pytest.mark.parametrize("rotary_dim, message", [(3, r"rotary_dim must be 0 or even in \[2, Dh=8\], got 3"),
                                                 (-2, r"rotary_dim must be 0 or even in \[2, Dh=8\], got -2"),
                                                 (10, r"rotary_dim must be 0 or even in \[2, Dh=8\], got 10")])
def test_the_dynamo_path_checks_rotary_dim_against_the_traced_head_size(rotary_dim, message):
    """Known without data (the cache's static last dim): it exported and failed only when ONNX Runtime ran the
    node."""
    from kvcache_op.reference import KeyValueCacheError

    cache, pairs = torch.zeros(16, 1, 2, 2, 8), max(rotary_dim // 2, 1)
    cos, sin = torch.ones(2, pairs), torch.zeros(2, pairs)
    with pytest.raises(KeyValueCacheError, match=message):
        kt.export_onnx(RotaryShiftModule(rotary_dim=rotary_dim), (cache, None, torch.tensor([1, 3]), cos, sin),
                       dynamo=True)


def test_the_dynamo_export_prints_nothing(capfd):
    kt.export_onnx(KeyValueCacheModule(), _plain_args(), dynamo=True)
    assert capfd.readouterr().out == ""
