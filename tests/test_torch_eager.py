"""The torch front-end's eager ops on CPU tensors agree bit for bit with the reference (outputs, cache,
scale), raise the reference's errors with the cache untouched, and are traced by torch.compile and
torch.export."""

import numpy as np
import pytest
from hypothesis import given, settings

torch = pytest.importorskip("torch", reason="the torch front-end needs the 'torch' extra: pip install '.[torch]'")

import kvcache_op.torch as kt  # noqa: E402
from invalid_calls import INVALID, make_invalid  # noqa: E402
from ort_helpers import assert_same_bits, copies, reference_result  # noqa: E402
from strategies import COMBINATIONS, calls_for, shift_calls  # noqa: E402
from torch_convert import to_numpy, to_torch, torch_inputs  # noqa: E402

from kvcache_op.reference import INT4, KeyValueCacheError, key_cache_rotary_shift, pack_int4  # noqa: E402
from kvcache_op.validation.cases import CASES  # noqa: E402


def torch_result(inputs, attrs, **convert):
    """(key, value, cache, scale) of the torch op, as numpy arrays like the reference's."""
    tensors = torch_inputs(inputs, **convert)
    key, value = kt.key_value_cache(**tensors, **attrs)
    like = np.asarray(inputs["current_key"])
    return (to_numpy(key, np.empty(tuple(key.shape), like.dtype)), to_numpy(value, np.empty(tuple(value.shape), like.dtype)),
            to_numpy(tensors["cache"], inputs["cache"]), to_numpy(tensors["scale"], inputs["scale"]))


@pytest.mark.parametrize("combo", COMBINATIONS, ids=lambda c: f"q{c[0]}-mode{c[1]}-layout{c[2]}")
def test_eager_cpu_op_matches_reference(combo):
    @given(calls_for(combo, max_batch=5))
    def check(case):
        assert_same_bits(torch_result(case.inputs, case.attributes), reference_result(case.inputs, case.attributes))

    check()


def test_every_conformance_case_matches_reference():
    for name, make in CASES.items():
        case = make()
        assert_same_bits(torch_result(case.inputs, case.attributes), reference_result(case.inputs, case.attributes))


def _torch_call(inputs):
    """The call's inputs as torch tensors. torch holds an int4 cache as packed pairs, so an odd last dim cannot be
    written down: such a cache becomes the packed tensor a user would try (last dim rounded up), zeroed."""
    cache = inputs.get("cache")
    if cache is None or np.asarray(cache).dtype != INT4 or np.asarray(cache).shape[-1] % 2 == 0:
        return torch_inputs(copies(inputs))
    tensors = torch_inputs(copies({k: v for k, v in inputs.items() if k != "cache"}))
    tensors["cache"] = torch.zeros(cache.shape[:-1] + (-(-cache.shape[-1] // 2),), dtype=torch.uint8)
    return tensors


@pytest.mark.parametrize("row", INVALID, ids=[r[0] for r in INVALID])
def test_invalid_call_raises_the_reference_message_and_writes_nothing(row):
    inputs, attrs = make_invalid(row)
    tensors = _torch_call(inputs)
    before = {k: tensors[k].clone() for k in ("cache", "scale") if tensors.get(k) is not None}
    with pytest.raises(KeyValueCacheError, match=row[3]):
        kt.key_value_cache(**tensors, **attrs)
    for name, tensor in before.items():
        assert torch.equal(tensors[name].view(torch.uint8), tensor.view(torch.uint8)), f"{name} was written"


def test_int_launch_bounds_and_cuda_free_index_inputs_are_accepted():
    case = CASES["paged_layout1"]()
    tensors = torch_inputs(copies(case.inputs))
    tensors["max_seqlen"], tensors["max_kvlen"] = int(case.inputs["max_seqlen"]), int(case.inputs["max_kvlen"])
    key, _ = kt.key_value_cache(**tensors, **case.attributes)
    want = reference_result(case.inputs, case.attributes)
    assert key.numpy().tobytes() == want[0].tobytes()


def test_a_non_contiguous_cache_is_refused_untouched():
    case = CASES["offset_layout0"]()
    tensors = torch_inputs(copies(case.inputs))
    wide = torch.zeros(tensors["cache"].shape[:-1] + (2 * tensors["cache"].shape[-1],), dtype=tensors["cache"].dtype)
    tensors["cache"] = wide[..., ::2]
    with pytest.raises(KeyValueCacheError, match="cache must be contiguous"):
        kt.key_value_cache(**tensors, **case.attributes)
    assert not wide.any()


def test_an_int4_cache_must_be_the_packed_uint8_form():
    case = CASES["int4_layout0"]()
    tensors = torch_inputs(copies(case.inputs))
    tensors["cache"] = torch.zeros(tuple(case.inputs["cache"].shape), dtype=torch.int8)  # one code per byte
    scale = tensors["scale"].clone()
    with pytest.raises(KeyValueCacheError, match="torch.uint8 tensor of packed int4 pairs"):
        kt.key_value_cache(**tensors, **case.attributes)
    assert not tensors["cache"].any() and torch.equal(tensors["scale"], scale)


def test_attributes_must_be_ints():
    case = CASES["offset_layout0"]()
    with pytest.raises(TypeError, match="attribute layer_idx must be an int"):
        kt.key_value_cache(**torch_inputs(copies(case.inputs)), layer_idx=0.0)


@given(shift_calls())
@settings(max_examples=60)
def test_rotary_shift_matches_reference(call):
    inputs, attrs = call
    want = copies(inputs)
    want_slots = key_cache_rotary_shift(**want, **attrs)
    tensors = torch_inputs(copies(inputs))
    got_slots = kt.key_cache_rotary_shift(**tensors, **attrs)
    assert np.array_equal(got_slots.numpy(), want_slots)
    assert to_numpy(tensors["cache"], inputs["cache"]).tobytes() == want["cache"].tobytes()
    if inputs["scale"] is not None:
        assert to_numpy(tensors["scale"], inputs["scale"]).tobytes() == want["scale"].tobytes()


def test_pack_int4_matches_the_reference_packing_and_round_trips():
    rng = np.random.default_rng(0)
    codes = rng.integers(-8, 8, (3, 5, 8)).astype(np.int8)
    packed = kt.pack_int4(torch.from_numpy(codes))
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (3, 5, 4)
    assert packed.numpy().tobytes() == pack_int4(codes).tobytes()
    assert np.array_equal(kt.unpack_int4(packed).numpy(), codes)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        kt.pack_int4(torch.tensor([8, 0]))
    with pytest.raises(ValueError, match="even last dim"):
        kt.pack_int4(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\[-8, 7\], got \[-9, 0\]"):
        kt.pack_int4(torch.tensor([-9, 0]))
    for dtype in (torch.float32, torch.bool, torch.complex64):
        with pytest.raises(TypeError, match="int4 codes must be an integer tensor"):
            kt.pack_int4(torch.zeros(2, dtype=dtype))


@pytest.mark.parametrize("quant_bit,layout", [(0, 0), (8, 3), (4, 1), (4, 2)])
def test_new_cache_has_the_shapes_the_op_accepts(quant_bit, layout):
    from kvcache_op.validation.cases import Seq, build

    case = build("new-cache", [Seq(0, 2)], num_layer=2, heads=2, head_dim=8, quant_bit=quant_bit, quant_group=4,
                 cache_layout=layout, t1="float32", t3="float32")
    max_tokens = case.inputs["cache"].shape[layout]  # in layout k, MaxT is axis k
    cache, scale = kt.new_cache(num_layer=2, max_tokens=max_tokens, heads=2, head_dim=8, quant_bit=quant_bit,
                                quant_group=4, cache_layout=layout, dtype=torch.float32)
    assert cache.shape == to_torch(case.inputs["cache"]).shape and not cache.any()
    assert (scale is None) == (quant_bit == 0)
    tensors = torch_inputs(copies(case.inputs))
    tensors["cache"], tensors["scale"] = cache, scale
    kt.key_value_cache(**tensors, **case.attributes)  # the op accepts them and writes the new cache
    assert cache.any()


class TwoLayers(torch.nn.Module):
    """Two layers sharing one cache through layer_idx, the second reading the first's output."""

    def __init__(self, attrs):
        super().__init__()
        self.attrs = {k: v for k, v in attrs.items() if k not in ("num_layer", "layer_idx")}

    def forward(self, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                cache, scale=None):
        index = (seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen)
        k0, v0 = kt.key_value_cache(current_key, current_value, *index, cache, scale, num_layer=2, layer_idx=0,
                                    **self.attrs)
        k1, v1 = kt.key_value_cache(current_key * 2, current_value * 2, *index, cache, scale, num_layer=2,
                                    layer_idx=1, **self.attrs)
        return k0 + k1, v0 - v1


def _two_layer_case(quant_bit=8, mode=1, layout=3):
    from kvcache_op.validation.cases import Seq, build

    return build("two-layers", [Seq(0, 3), Seq(4, 1), Seq(2, 2)], num_layer=2, heads=2, head_dim=8,
                 quant_bit=quant_bit, quant_group=4, cache_mode=mode, page_size=4, cache_layout=layout, t1="float32")


def _run(fn, case):
    tensors = torch_inputs(copies(case.inputs))
    outputs = fn(**tensors)
    return [o.clone() for o in outputs], tensors["cache"].clone(), tensors["scale"]


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_torch_compile_traces_the_op_fullgraph(backend):
    case = _two_layer_case()
    module = TwoLayers(case.attributes)
    want = _run(module, case)
    torch._dynamo.reset()
    got = _run(torch.compile(module, backend=backend, fullgraph=True), case)
    for g, w in zip(got[0], want[0]):
        assert torch.equal(g, w)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_torch_export_traces_the_op_and_its_program_runs():
    case = _two_layer_case(quant_bit=0, mode=0, layout=0)
    module = TwoLayers(case.attributes)
    want = _run(module, case)
    tensors = torch_inputs(copies(case.inputs))
    del tensors["scale"]
    program = torch.export.export(module, (), kwargs=tensors)
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count("kvcache_op.key_value_cache.default") == 2, targets
    fresh = torch_inputs(copies(case.inputs))
    del fresh["scale"]
    outputs = program.module()(**fresh)
    for g, w in zip(outputs, want[0]):
        assert torch.equal(g, w)
    assert torch.equal(fresh["cache"], want[1])


@pytest.mark.parametrize("name,value,message", [
    ("max_seqlen", 3.7, "max_seqlen must be a torch.Tensor or an int, got float"),
    ("max_kvlen", True, "max_kvlen must be a torch.Tensor or an int, got bool"),
    ("max_kvlen", 2**70, "does not fit in int64"),
    ("max_kvlen", 2**63, "max_kvlen = 9223372036854775808 does not fit in int64"),
    ("max_seqlen", -(2**63), "max_seqlen = -9223372036854775808 is smaller than seqlen"),  # fits: the op refuses it
    ("seqstarts", np.array([0, 3]), "seqstarts must be a torch.Tensor, got ndarray"),
])
def test_index_inputs_are_tensors_or_int_bounds_never_coerced(name, value, message):
    case = CASES["offset_layout0"]()
    tensors = torch_inputs(copies(case.inputs))
    tensors[name] = value
    before = tensors["cache"].clone()
    with pytest.raises(KeyValueCacheError, match=message):
        kt.key_value_cache(**tensors, **case.attributes)
    assert torch.equal(tensors["cache"], before)


def test_numpy_int_attributes_are_taken_and_huge_ones_refused():
    case = CASES["paged_layout0"]()
    want = reference_result(case.inputs, case.attributes)
    numpy_attrs = {k: np.int64(v) for k, v in case.attributes.items()}
    assert_same_bits(torch_result(case.inputs, numpy_attrs), want)
    with pytest.raises(KeyValueCacheError, match="does not fit in int64"):
        kt.key_value_cache(**torch_inputs(copies(case.inputs)), **dict(case.attributes, page_size=2**64))
    with pytest.raises(KeyValueCacheError, match="page_size = 9223372036854775808 does not fit in int64"):
        kt.key_value_cache(**torch_inputs(copies(case.inputs)), **dict(case.attributes, page_size=2**63))
    with pytest.raises(KeyValueCacheError, match="layer_idx must be in"):  # fits int64: the op's own rule refuses it
        kt.key_value_cache(**torch_inputs(copies(case.inputs)), **dict(case.attributes, layer_idx=-(2**63)))


@pytest.mark.parametrize("scale", [torch.empty(0, dtype=torch.bfloat16), torch.empty(0, 3, dtype=torch.complex64),
                                   torch.empty((1,) * 8 + (0,))])
def test_an_empty_scale_without_quantization_is_absent_in_torch_too(scale):
    case = CASES["gqa_repeat2"]()
    tensors = torch_inputs(copies(case.inputs))
    tensors["scale"] = scale
    key, value = kt.key_value_cache(**tensors, **case.attributes)
    want = reference_result(case.inputs, case.attributes)
    assert key.numpy().tobytes() == want[0].tobytes() and value.numpy().tobytes() == want[1].tobytes()
    assert to_numpy(tensors["cache"], case.inputs["cache"]).tobytes() == want[2].tobytes()


def test_an_int4_shape_error_says_the_shapes_are_unpacked():
    case = CASES["int4_layout0"]()
    tensors = torch_inputs(copies(case.inputs))
    tensors["cache"] = torch.zeros(tuple(tensors["cache"].shape[:-1]) + (tensors["cache"].shape[-1] * 2,),
                                   dtype=torch.uint8)  # one code per byte instead of packed pairs
    with pytest.raises(KeyValueCacheError, match="cache shape must be .*unpacked int4 cache"):
        kt.key_value_cache(**tensors, **case.attributes)


@pytest.mark.parametrize("kw,message", [(dict(cache_layout=7), "cache_layout must be"),
                                        (dict(quant_bit=8, quant_group=0), "quant_group must be >= 1"),
                                        (dict(quant_bit=8, quant_group=3), "must be a multiple of quant_group=3"),
                                        (dict(quant_bit=4, quant_group=1, head_dim=3), "and even for int4")])
def test_new_cache_refuses_impossible_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        kt.new_cache(**{"num_layer": 1, "max_tokens": 4, "heads": 1, "head_dim": 8, **kw})


@pytest.mark.parametrize("quant_bit, head_dim", [(8, 3), (4, 2)])
def test_new_cache_takes_groups_of_one(quant_bit, head_dim):
    """quant_group 1 (one scale per element) is valid, and int8 takes an odd head_dim."""
    cache, scale = kt.new_cache(num_layer=1, max_tokens=4, heads=1, head_dim=head_dim, quant_bit=quant_bit,
                                quant_group=1)
    assert tuple(scale.shape) == (4, 1, 2, 1, head_dim) and cache.shape[-1] == head_dim // (2 if quant_bit == 4 else 1)


def _small_calls(k, cache):
    """One small call of each op (three tokens of one sequence, 2 heads of 8) on ``cache``, by op name; keyword
    arguments replace the call's inputs."""
    index = dict(seqstarts=torch.tensor([0, 3]), kvstarts=torch.tensor([0, 3]), cachestarts=torch.tensor([0]),
                 start_pos=torch.tensor([0]), max_seqlen=3, max_kvlen=3)
    return {
        "key_value_cache": lambda **a: kt.key_value_cache(**{"current_key": k, "current_value": k, **index,
                                                            "cache": cache, **a}),
        "key_cache_rotary_shift": lambda **a: kt.key_cache_rotary_shift(**{"cache": cache, "scale": None,
                                                                          "slots": torch.tensor([0]),
                                                                          "cos": torch.ones(1, 4),
                                                                          "sin": torch.zeros(1, 4), **a}),
        "multi_head_attention": lambda **a: kt.multi_head_attention(**{"query": k, "key": k, "value": k,
                                                                      "seqstarts": index["seqstarts"],
                                                                      "kvstarts": index["kvstarts"],
                                                                      "decoding_batches": 0, "max_seqlen": 3,
                                                                      "max_kvlen": 3, **a}, num_heads=2, head_dim=8),
        "multi_head_cache_attention": lambda **a: kt.multi_head_cache_attention(
            **{"query": k, "current_key": k, "current_value": k, **index, "decoding_batches": 0, "cache": cache, **a},
            num_heads=2, head_dim=8),
    }


@pytest.mark.parametrize("op, name", [("key_value_cache", "cache"), ("key_value_cache", "current_key"),
                                      ("key_cache_rotary_shift", "cache"), ("multi_head_attention", "key"),
                                      ("multi_head_cache_attention", "cache"), ("multi_head_cache_attention", "query")])
def test_a_missing_data_tensor_is_the_ops_error(op, name):
    """None where a data tensor is needed is the op's error naming it (it reached the kernels as an AttributeError)."""
    from kvcache_op.reference import MultiHeadAttentionError

    k = torch.randn(3, 2, 8)
    cache = torch.zeros(16, 1, 2, 2, 8)
    calls = _small_calls(k, cache)
    before = cache.clone()
    error = MultiHeadAttentionError if op == "multi_head_attention" else KeyValueCacheError
    with pytest.raises(error, match=f"^{name} must be a torch.Tensor, got NoneType$"):
        calls[op](**{name: None})
    assert torch.equal(cache, before)


@pytest.mark.parametrize("op", ["key_value_cache", "key_cache_rotary_shift", "multi_head_cache_attention"])
def test_a_cache_that_requires_grad_is_refused_and_its_detached_memory_written(op):
    """The kernels write the cache where autograd cannot see: as torch refuses an in-place write to a leaf that
    requires grad, so does the op (the cache untouched), under no_grad too; ``cache.detach()`` (the same memory)
    is written."""
    k = torch.randn(3, 2, 8)
    cache = torch.zeros(16, 1, 2, 2, 8, requires_grad=True)
    with torch.no_grad():
        cache[0].fill_(1.0)  # keys to rotate
    before = cache.detach().clone()
    rotate = dict(sin=torch.ones(1, 4), cos=torch.zeros(1, 4)) if op == "key_cache_rotary_shift" else {}
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(KeyValueCacheError,
                                                         match="^cache requires grad, and the op writes it in place"):
            _small_calls(k, cache)[op](**rotate)
        assert torch.equal(cache.detach(), before)
    _small_calls(k, cache.detach())[op](**rotate)
    assert not torch.equal(cache.detach(), before)


def test_the_registered_op_refuses_a_cache_that_requires_grad_too():
    case = CASES["offset_layout0"]()
    tensors = torch_inputs(copies(case.inputs))
    tensors["cache"].requires_grad_(True)
    before = tensors["cache"].detach().clone()
    attrs = dict(case.attributes, num_repeat=case.attributes.get("num_repeat", 1))
    args = [tensors[name] for name in ("current_key", "current_value", "seqstarts", "kvstarts", "cachestarts",
                                       "start_pos", "max_seqlen", "max_kvlen", "cache", "scale")]
    with pytest.raises(KeyValueCacheError, match="^cache requires grad"):
        torch.ops.kvcache_op.key_value_cache(*args, *(attrs[n] for n in (
            "num_layer", "layer_idx", "quant_bit", "quant_group", "num_repeat", "cache_mode", "cache_layout",
            "page_size")))
    assert torch.equal(tensors["cache"].detach(), before)


def test_a_scale_that_requires_grad_is_refused():
    case = CASES["int8_layout0"]()
    tensors = torch_inputs(copies(case.inputs))
    tensors["scale"].requires_grad_(True)
    cache, scale = tensors["cache"].clone(), tensors["scale"].detach().clone()
    with pytest.raises(KeyValueCacheError, match="^scale requires grad"):
        kt.key_value_cache(**tensors, **case.attributes)
    assert torch.equal(tensors["cache"], cache) and torch.equal(tensors["scale"].detach(), scale)


def _store_two_rows():
    """A store of 2 tokens at slots 0-1 of a layout-0 cache of 8 slots, 2 heads of 8 dims."""
    idx = dict(seqstarts=torch.tensor([0, 2]), kvstarts=torch.tensor([0, 2]), cachestarts=torch.tensor([0]),
               start_pos=torch.tensor([0]), max_seqlen=torch.tensor(2), max_kvlen=torch.tensor(2))
    return torch.randn(8, 1, 2, 2, 8), idx


@pytest.mark.parametrize("op", ["kv", "mhca"])
def test_a_strided_input_viewing_the_cache_is_refused_untouched(op):
    """The spec refuses a cache sharing memory with what the op reads (the numpy binding and the C entry points do);
    a strided view of it was copied before the C check and went through, the op writing the cache it read."""
    cache, idx = _store_two_rows()
    before = cache.clone()
    view, other = cache[4:6, 0, 0], torch.randn(2, 2, 8)  # slots 4-5's keys: strided, inside the cache
    assert not view.is_contiguous()
    name = "current_key" if op == "kv" else "query"
    with pytest.raises(KeyValueCacheError, match=f"cache overlaps {name}: the op writes cache while it reads"):
        if op == "kv":
            kt.key_value_cache(view, other, **idx, cache=cache)
        else:
            kt.multi_head_cache_attention(view, other, other.clone(), **idx, decoding_batches=torch.tensor(0),
                                          cache=cache, num_heads=2, head_dim=8)
    assert torch.equal(cache, before)
    kt.key_value_cache(view.clone(), other, **idx, cache=cache)  # its copy is fine


def test_a_cache_that_is_a_lazily_negated_view_is_refused_untouched():
    """torch._neg_view's memory holds the values negated: the op's write hit PyTorch's internal assert."""
    cache, idx = _store_two_rows()
    negated = torch._neg_view(cache)
    with pytest.raises(KeyValueCacheError, match="cache is a lazily negated or conjugated view"):
        kt.key_value_cache(torch.randn(2, 2, 8), torch.randn(2, 2, 8), **idx, cache=negated)


def test_an_inference_cache_is_written_inside_inference_mode_only():
    """torch refuses an in-place write to an inference tensor outside inference mode; the op wrote it anyway."""
    with torch.inference_mode():
        cache, idx = _store_two_rows()
    before = cache.clone()
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    with pytest.raises(KeyValueCacheError, match="cache is an inference tensor"):
        kt.key_value_cache(key, value, **idx, cache=cache)
    assert torch.equal(cache, before)
    with torch.inference_mode():
        kt.key_value_cache(key, value, **idx, cache=cache)
    assert torch.equal(cache[0:2, 0, 0], key)


def _registered_store(key, value, idx, cache):
    return torch.ops.kvcache_op.key_value_cache(key, value, *(idx[n] for n in (
        "seqstarts", "kvstarts", "cachestarts", "start_pos", "max_seqlen", "max_kvlen")), cache, None, 1, 0, 0, 8, 1,
        0, 0, 128)


@pytest.mark.parametrize("route", ["registered op", "torch.compile"])
def test_the_kernel_itself_refuses_an_inference_cache_outside_inference_mode(route):
    """The Python API's check is not on every path: the registered op called directly, and a compiled call (whose
    Python API traces fake tensors), reach the kernel, which now refuses before writing (it wrote the cache)."""
    with torch.inference_mode():
        cache, idx = _store_two_rows()
    before = cache.clone()
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    if route == "registered op":
        call = _registered_store
    else:
        call = torch.compile(lambda k, v, i, c: kt.key_value_cache(k, v, **i, cache=c), backend="eager",
                             fullgraph=True)
    with pytest.raises(Exception, match="cache is an inference tensor") as raised:
        call(key, value, idx, cache)
    assert isinstance(raised.value, KeyValueCacheError) or "KeyValueCacheError" in repr(raised.value)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("layout", ["sparse", "mkldnn"])
def test_a_tensor_with_no_dense_memory_is_refused_by_name(layout):
    """A sparse or mkldnn tensor has no memory of its elements to hand over: refused by name through the Python API
    and the registered ops (torch's "no storage" error before), the cache untouched."""
    cache, idx = _store_two_rows()
    before = cache.clone()
    key = torch.randn(2, 2, 8)
    key = key.to_sparse() if layout == "sparse" else key.to_mkldnn()
    with pytest.raises(KeyValueCacheError, match="current_key must be a dense \\(strided\\) tensor, got a torch"):
        kt.key_value_cache(key, torch.randn(2, 2, 8), **idx, cache=cache)
    with pytest.raises(KeyValueCacheError, match="current_key must be a dense \\(strided\\) tensor"):
        _registered_store(key, torch.randn(2, 2, 8), idx, cache)
    assert torch.equal(cache, before)
    other = torch.randn(2, 2, 8)
    with pytest.raises(KeyValueCacheError, match="query must be a dense \\(strided\\) tensor"):
        torch.ops.kvcache_op.multi_head_attention(key, other, other, idx["seqstarts"], idx["kvstarts"],
                                                  torch.tensor(0), idx["max_seqlen"], idx["max_kvlen"], None, 2, 8, 1,
                                                  0, 2, 0, 0.0, 0.0)
