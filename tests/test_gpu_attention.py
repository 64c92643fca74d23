"""MultiHeadAttention and MultiHeadCacheAttention's CUDA kernels on a real GPU through the library's C entry points,
with device memory from torch or CuPy (no onnxruntime-gpu needed).

Oracles written apart from the kernels: the naive float64 attention (tests/naive_attention.py) and the naive
KeyValueCache (tests/naive_reference.py) for hypothesis's calls, every element within the spec's bound of the
exact attention and the cache after the call bit for bit; for the larger calls (too slow for the naive
attention) the numpy reference, within twice the bound (the reference and the kernels are each within the bound
of the exact result), the cache still bit for bit with the naive KeyValueCache. Every device buffer sits between
sentinel guards (no byte written outside it); rows without an effective key are exactly zero; misaligned
buffers (per-element loads) give results within the same bound; invalid calls raise the library's error with the
device cache, scale and output unchanged; a head_dim the kernels cannot run is refused by name.

Every check takes its runner as a parameter (:data:`GPU`: the CUDA entry points on device memory); the module's
tests run the GPU."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attention_strategies import attention_calls
from gpu_support import DeviceBuffer, Stream
from naive_reference import naive_key_value_cache
from test_mha_reference import assert_within, oracle
from test_mhca_ort_cpu import naive_oracle
from test_mhca_reference import _split, cache_attention_calls

from kvcache_op.capi import c_api
from kvcache_op.reference import (KeyValueCacheError, MultiHeadAttentionError, attention_tolerance,
                                  cache_attention_tolerance, multi_head_attention, multi_head_cache_attention)
from kvcache_op.reference.validate import effective_scale
from kvcache_op.validation import mha_error_cases
from kvcache_op.validation.cases import Seq
from kvcache_op.validation.mha_cases import ATTENTION_CASES, build_attention
from kvcache_op.validation.mhca_cases import ATTENTION_INVALID, CASES as CACHE_ATTENTION_CASES
from kvcache_op.validation.mhca_cases import build_cache_attention, error_cases
from kvcache_op.validation.error_cases import INVALID as CACHE_INVALID, MORE_INVALID as MORE_CACHE_INVALID
from kvcache_op.validation import strategies
from kvcache_op.validation.strategies import COMBINATIONS, calls_for

pytestmark = pytest.mark.gpu

#: Per op: its inputs in order, the ones in device memory (the index inputs are host memory) and the entry point.
OPS = {
    "mha": (c_api.MHA_INPUTS, ("query", "key", "value", "attn_mask"), c_api.run_multi_head_attention),
    "mhca": (c_api.MHCA_INPUTS, ("query", "current_key", "current_value", "cache", "scale", "attn_mask"),
             c_api.run_multi_head_cache_attention),
}
#: The output's bytes before the call: NaN in every float type, so an element the kernels leave unwritten fails
#: the bound (and an invalid call must leave them all).
UNWRITTEN = 0xFF


class GpuRunner:
    """Runs a call on the CUDA device: buffers from gpu_support (torch or CuPy), a non-default stream."""

    device = "cuda"

    @staticmethod
    def buffer(array, offset=0):
        return DeviceBuffer(array, offset=offset)

    @staticmethod
    def stream():
        return Stream()


GPU = GpuRunner()


class AttentionCall:
    """One call of ``op`` ("mha" or "mhca") on ``runner``'s memory: every device input and the output sit
    ``offset`` bytes past a 16-byte boundary between sentinel guards; index inputs are host numpy arrays.
    :meth:`run` raises what the entry point raises (after the stream is synchronized)."""

    def __init__(self, op, inputs, attributes, *, runner=GPU, offset=0):
        names, device_names, self._entry = OPS[op]
        inputs = dict(inputs)
        if "scale" in inputs:  # an empty scale with quant_bit 0 is absent (never read or written)
            inputs["scale"] = effective_scale(inputs["scale"], attributes.get("quant_bit", 0))
        self.runner, self.attributes = runner, attributes
        self.host = c_api.HostBuffers()  # the index arrays, alive for the call
        self.device = {n: runner.buffer(np.asarray(inputs[n]), offset) for n in device_names
                       if inputs.get(n) is not None}
        self.inputs = [self._described(self.device[n]) if n in self.device else self.host.tensor(n, inputs.get(n))
                       for n in names]
        query = np.asarray(inputs["query"])
        out_dtype = query.dtype if query.dtype.kind == "f" or query.dtype.name == "bfloat16" else np.dtype(np.float16)
        self.unwritten = np.full(int(np.prod(query.shape)) * out_dtype.itemsize, UNWRITTEN,
                                 np.uint8).view(out_dtype).reshape(query.shape)
        self.out = runner.buffer(self.unwritten, offset)
        self.output_tensor = self._described(self.out)

    @staticmethod
    def _described(buffer):
        return c_api.Tensor(c_api.onnx_type(buffer.dtype), buffer.shape, buffer.ptr)

    def run(self, stream=None):
        """On a fresh stream, synchronized after; on ``stream`` when given, left to the caller to synchronize (a
        stream being captured into a graph may not be)."""
        own = stream is None
        stream = self.runner.stream() if own else stream
        try:
            self._entry(self.inputs, self.output_tensor, device=self.runner.device, stream=stream.handle,
                        **self.attributes)
        finally:
            if own:
                stream.synchronize()

    def output(self) -> np.ndarray:
        return self.out.to_host()

    def after(self, name):
        """A device input's bytes as a host array (None when it was not given)."""
        return self.device[name].to_host() if name in self.device else None

    def guards_intact(self) -> bool:
        return all(b.guards_intact() for b in [*self.device.values(), self.out])


#: KVCACHE_OP_CUDA_DECODE_KERNEL of a decode route: the tile kernel, the first decode kernel, the staged decode
#: kernel (the default where float16 / bfloat16 rows as stored fit it; "2" sends quantized rows that fit it too,
#: e.g. int8 and int4 of head_dim 128 in groups of 8; other rows to the tile kernel), its second form (every head of a
#: tile in each thread's registers; rows as the staged kernel's, quantized too).
DECODE_ROUTES = {"tile": "0", "decode": "1", "staged": "2", "heads": "3"}


@pytest.fixture(params=list(DECODE_ROUTES))
def kernel(request, monkeypatch):
    """Sequences of one token through the tile kernel, the first decode kernel, the staged one (the default where it
    fits) or the staged one's second form (KVCACHE_OP_CUDA_DECODE_KERNEL, read on every call)."""
    monkeypatch.setenv("KVCACHE_OP_CUDA_DECODE_KERNEL", DECODE_ROUTES[request.param])
    return request.param


@pytest.fixture(params=["mma", "mma2", "tile"])
def prefill_kernel(request, monkeypatch):
    """Sequences of more than one token in float16 / bfloat16 through the tensor-core kernel (the default), its
    second form (products in registers, KVCACHE_OP_CUDA_MMA=2) or the tile kernel (KVCACHE_OP_CUDA_MMA=0); read on
    every call."""
    monkeypatch.setenv("KVCACHE_OP_CUDA_MMA", {"mma": "1", "mma2": "2", "tile": "0"}[request.param])
    return request.param


@pytest.fixture(params=["tile+mma", "heads+mma2", "staged+mma", "tile+tile"])
def routes(request, monkeypatch):
    """Both routes at once (fewer calls than every pairing): decodes through the tile kernel or either form of the
    staged decode kernel (the first decode kernel's route is the `kernel` fixture's), longer float16 / bfloat16
    sequences through either form of the tensor-core kernel or the tile kernel. Returns the decode route."""
    decode, prefill = request.param.split("+")
    monkeypatch.setenv("KVCACHE_OP_CUDA_DECODE_KERNEL", DECODE_ROUTES[decode])
    monkeypatch.setenv("KVCACHE_OP_CUDA_MMA", {"mma": "1", "mma2": "2", "tile": "0"}[prefill])
    return decode


def _expect_zero_rows(got, bound):
    assert np.all(got[bound == 0] == 0), "a row without an effective key must be exactly zero"


# -- checks (runner is a parameter) -----------------------------------------------------------------------------------

def check_mha_against_naive(case, runner=GPU, offset=0):
    """MultiHeadAttention: every element within the spec's bound of the naive float64 oracle."""
    exact, bound = oracle(case)
    call = AttentionCall("mha", case.inputs, case.attributes, runner=runner, offset=offset)
    call.run()
    got = call.output()
    assert got.dtype == case.inputs["query"].dtype and got.shape == case.inputs["query"].shape
    assert_within(got, exact, bound, f"CUDA MultiHeadAttention ({case.name})")
    _expect_zero_rows(got, bound)
    assert call.guards_intact(), "a write landed outside a device buffer"


def check_mha_against_reference(case, runner=GPU, offset=0):
    """MultiHeadAttention on a call too large for the naive oracle: within twice the bound of the reference."""
    inputs, attributes = case.inputs, case.attributes
    want = multi_head_attention(**{k: None if v is None else np.array(v) for k, v in inputs.items()}, **attributes)
    tolerance = 2 * attention_tolerance(**inputs, **attributes)
    call = AttentionCall("mha", inputs, attributes, runner=runner, offset=offset)
    call.run()
    got = call.output()
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_within(got, want.astype(np.float64), tolerance, f"CUDA MultiHeadAttention ({case.name})")
    _expect_zero_rows(got, tolerance)
    assert call.guards_intact(), "a write landed outside a device buffer"


def _assert_cache_is(call, cache_after, scale_after):
    got_cache = call.after("cache")
    assert got_cache.dtype == cache_after.dtype and got_cache.shape == cache_after.shape
    assert got_cache.tobytes() == cache_after.tobytes(), "the cache after the call differs from the naive KeyValueCache's"
    got_scale = call.after("scale")
    if got_scale is None:  # absent, or empty with quant_bit 0 (the call leaves it out): the naive op left it as given
        assert scale_after is None or scale_after.size == 0, "the naive KeyValueCache wrote a scale the call had not"
    else:
        assert got_scale.tobytes() == scale_after.tobytes(), \
            "the scale after the call differs from the naive KeyValueCache's"


def check_mhca_against_naive(inputs, attributes, runner=GPU, offset=0):
    """MultiHeadCacheAttention: the cache and scale bit for bit with the naive KeyValueCache, every element within
    the bound of the naive attention over what it gathers."""
    exact, bound, cache_after, scale_after = naive_oracle(inputs, attributes)
    call = AttentionCall("mhca", inputs, attributes, runner=runner, offset=offset)
    call.run()
    _assert_cache_is(call, cache_after, scale_after)
    got = call.output()
    assert got.dtype == inputs["query"].dtype and got.shape == inputs["query"].shape
    assert_within(got, exact, bound, "CUDA MultiHeadCacheAttention")
    _expect_zero_rows(got, bound)
    assert call.guards_intact(), "a write landed outside a device buffer"


def naive_cache_after(inputs, attributes):
    """(cache, scale) after the call, from the naive KeyValueCache."""
    cache_attrs, _ = _split(attributes)
    _, _, cache, scale = naive_key_value_cache(
        inputs["current_key"], inputs["current_value"], inputs["seqstarts"], inputs["kvstarts"],
        inputs["cachestarts"], inputs["start_pos"], inputs["cache"],
        effective_scale(inputs["scale"], attributes.get("quant_bit", 0)), **cache_attrs)
    return cache, scale


def check_mhca_against_reference(case, runner=GPU, offset=0):
    """MultiHeadCacheAttention on a call too large for the naive attention: the cache bit for bit with the naive
    KeyValueCache, the output within twice the bound of the reference."""
    inputs, attributes = case.inputs, case.attributes
    cache_after, scale_after = naive_cache_after(inputs, attributes)
    fresh = {k: None if v is None else np.array(v) for k, v in inputs.items()}
    want = multi_head_cache_attention(**fresh, **attributes)
    assert fresh["cache"].tobytes() == cache_after.tobytes()  # the two oracles agree (else the test is wrong)
    tolerance = 2 * cache_attention_tolerance(**inputs, **attributes)
    call = AttentionCall("mhca", inputs, attributes, runner=runner, offset=offset)
    call.run()
    _assert_cache_is(call, cache_after, scale_after)
    got = call.output()
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_within(got, want.astype(np.float64), tolerance, f"CUDA MultiHeadCacheAttention ({case.name})")
    _expect_zero_rows(got, tolerance)
    assert call.guards_intact(), "a write landed outside a device buffer"


def check_invalid(op, inputs, attributes, message, runner=GPU, error=KeyValueCacheError):
    """An invalid call raises the library's error (the reference's message) and writes nothing: the device cache,
    scale and output byte for byte as before, the guards intact."""
    call = AttentionCall(op, inputs, attributes, runner=runner)
    before = {n: call.after(n).tobytes() for n in ("cache", "scale") if n in call.device}
    with pytest.raises(error, match=message):
        call.run()
    assert {n: call.after(n).tobytes() for n in before} == before, "an invalid call wrote the cache"
    assert call.output().tobytes() == call.unwritten.tobytes(), "an invalid call wrote the output"
    assert call.guards_intact(), "a write landed outside a device buffer"


# -- hypothesis: every attribute, against the naive oracles -------------------------------------------------------------

@given(attention_calls())
def test_mha_calls_are_within_the_bound_of_the_naive_oracle(case):
    check_mha_against_naive(case)


@given(attention_calls(max_batch=3, max_kvlen=48, max_seqlen=40, head_dims=(1, 5, 16, 20, 33, 40)))
def test_mha_prefill_tiles_are_within_the_bound_of_the_naive_oracle(case):
    """Sequences of up to 40 queries: several tiles of query rows, causal edges and window starts inside a tile,
    head dims that are no multiple of 8 (element loads)."""
    check_mha_against_naive(case)


@pytest.mark.parametrize("combo", COMBINATIONS, ids=lambda c: f"q{c[0]}-mode{c[1]}-layout{c[2]}")
@given(data=st.data())
def test_mhca_calls_write_the_naive_cache_and_are_within_the_bound(combo, data):
    """Every (quant_bit, cache_mode, cache_layout) gets its own examples, pages of 1-8 and shared prefix pages."""
    call = data.draw(strategies.cache_attention_calls(calls_for(combo, special_values=False)))
    check_mhca_against_naive(call.inputs, call.attributes)


@given(cache_attention_calls())
def test_mhca_calls_of_the_reference_tests_strategy(call):
    """tests/test_mhca_reference.py's calls (their own query draw, softcaps 0.7 and 4)."""
    inputs, attributes = call
    check_mhca_against_naive(inputs, attributes)


@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
def test_mha_named_cases(name):
    check_mha_against_naive(ATTENTION_CASES[name]())


@pytest.mark.parametrize("name", sorted(CACHE_ATTENTION_CASES))
def test_mhca_named_cases(name):
    case = CACHE_ATTENTION_CASES[name]()
    check_mhca_against_naive(case.inputs, case.attributes)


# -- deterministic larger calls: the kernels' paths -------------------------------------------------------------------

SPLIT_VARIANTS = {"plain": {}, "window-mask-alibi-softcap": dict(sliding_window=2000, mask=2, is_alibi=1, softcap=5.0)}


@pytest.mark.parametrize("t, variant", [("float32", "plain"), ("float16", "plain"), ("bfloat16", "plain"),
                                        ("float16", "window-mask-alibi-softcap")])
def test_mha_split_decode(t, variant, kernel):
    """Two decodes of 3000 and 1500 keys, 8 query heads over 2 kv heads, head_dim 128: too few blocks for the GPU,
    so the planner splits their keys into parts merged after (log-sum-exp)."""
    case = build_attention(f"split-{t}-{variant}", [(1, 3000), (1, 1500)], heads=8, kv_heads=2, head_dim=128, t=t,
                           decoding=2, **SPLIT_VARIANTS[variant])
    check_mha_against_reference(case)


#: Mixed batches: decoding sequences of several rows (never causal), chunks of a chunked prefill, first prefills,
#: a decode long enough to split, empty sequences; each with one feature set.
PREFILL = [(3, 20), (2, 9), (24, 24), (17, 40), (1, 700), (0, 5), (40, 52)]
PREFILL_VARIANTS = {
    "causal-float16": dict(t="float16"),
    "window-bfloat16": dict(t="bfloat16", sliding_window=7),
    "softcap-scale-float32": dict(t="float32", softcap=5.0, softmax_scale=0.3),
    "alibi-mask2-float16": dict(t="float16", is_alibi=1, mask=2, mask_extra_cols=3, mask_neg_inf=0.2),
    "mask3-not-causal-float32": dict(t="float32", is_causal=0, mask=3, mask_neg_inf=0.1),
    "mask3-alibi-window-bfloat16": dict(t="bfloat16", is_alibi=1, mask=3, sliding_window=16, mask_neg_inf=0.05),
}


@pytest.mark.parametrize("head_dim", [128, 24])
@pytest.mark.parametrize("variant", sorted(PREFILL_VARIANTS))
def test_mha_prefill(variant, head_dim, prefill_kernel):
    """Chunked prefill (S > 1, causal aligned to the last keys), decoding_batches = 2 with S > 1 rows, GQA 4;
    head_dim 24 with 1 query head per kv head: tiles of 16 query rows."""
    heads, kv_heads = (8, 2) if head_dim == 128 else (3, 3)
    case = build_attention(f"prefill-{variant}-{head_dim}", PREFILL, heads=heads, kv_heads=kv_heads,
                           head_dim=head_dim, decoding=2, **PREFILL_VARIANTS[variant])
    check_mha_against_reference(case)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [128, 64, 24, 5, 256])
def test_mha_head_dims_and_groups(head_dim, group, routes):
    if routes in ("decode", "staged", "heads") and head_dim not in (8, 16, 32, 64, 128, 256):
        pytest.skip("the decode kernel takes head_dim 8 x a power of two, at most 256 (the tile kernel runs this one)")
    case = build_attention(f"dims-{head_dim}-{group}", [(1, 700), (19, 19), (4, 30), (1, 1)], heads=2 * group,
                           kv_heads=2, head_dim=head_dim, decoding=1, t="float16", mask=2)
    check_mha_against_reference(case)


def test_mha_widest_head_the_kernels_run():
    """head_dim 2048 (the CUDA kernels' limit): one query vector per tile."""
    case = build_attention("head-dim-2048", [(1, 40), (3, 8)], heads=2, kv_heads=1, head_dim=2048, decoding=1,
                           t="bfloat16")
    check_mha_against_reference(case)


def test_mha_fully_masked_rows_are_zero():
    case = ATTENTION_CASES["mha_fully_masked_rows"]()
    check_mha_against_naive(case)
    case = build_attention("masked-split", [(1, 3000), (1, 1500), (1, 9)], heads=4, kv_heads=2, head_dim=64,
                           t="float16", decoding=3, mask=2)
    case.inputs["attn_mask"][0, :] = -np.inf  # every key of a split decode hidden: exactly zero
    case.inputs["attn_mask"][1, 3000:3000 + 1200] = -np.inf  # whole key parts hidden
    check_mha_against_reference(case)


@pytest.mark.parametrize("t1", ["float32", "float16", "bfloat16"])
def test_mhca_split_decode(t1, kernel):
    """Decodes over 3000 and 1500 cached keys (offset cache), 8 query heads over 2 kv heads, head_dim 128."""
    case = build_cache_attention(f"mhca-split-{t1}", [Seq(2999, 1), Seq(1499, 1)], heads=2, head_dim=128, group=4,
                                 cache_mode=0, t1=t1)
    check_mhca_against_reference(case)


#: (quant_bit, quant_group, head_dim, cache_mode, page_size, t1, t3)
QUANTIZED = {
    "int8-g8-d128-page16": (8, 8, 128, 1, 16, "float16", "float16"),
    "int4-g8-d128-page5": (4, 8, 128, 1, 5, "bfloat16", "float32"),
    "int4-g3-d24-offset": (4, 3, 24, 0, 128, "float16", "float32"),
    "int4-g3-d24-page5": (4, 3, 24, 1, 5, "float32", "float16"),
    "int8-g3-d24-page16": (8, 3, 24, 1, 16, "bfloat16", "float32"),
    # the staged decode kernel's other admitted scale rows: float32 scales in groups of 32 (four to a 16-byte
    # chunk) under float32 queries, float16 scales in groups of 16 (eight to a chunk)
    "int8-g32-d128-offset": (8, 32, 128, 0, 128, "float32", "float32"),
    "int4-g16-d128-page16": (4, 16, 128, 1, 16, "float16", "float16"),
}


@pytest.mark.parametrize("layout", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", sorted(QUANTIZED))
def test_mhca_quantized(kind, layout, routes):
    """int8 and int4 caches (groups of 8, and of 3: no 8-element units), layouts 0-3, offset and paged caches with
    pages of 16 and 5: a decode long enough to split, a chunk of a chunked prefill, a first prefill, GQA 4."""
    quant_bit, group, head_dim, mode, page, t1, t3 = QUANTIZED[kind]
    case = build_cache_attention(f"mhca-{kind}-{layout}", [Seq(1200, 1), Seq(40, 24), Seq(0, 17), Seq(5, 0)],
                                 heads=2, head_dim=head_dim, group=4, quant_bit=quant_bit, quant_group=group,
                                 cache_mode=mode, page_size=page, cache_layout=layout, t1=t1, t3=t3)
    check_mhca_against_reference(case)


@pytest.mark.parametrize("layout", [0, 1, 2, 3])
@pytest.mark.parametrize("page", [16, 5])
def test_mhca_paged_float16(page, layout, kernel):
    case = build_cache_attention(f"mhca-paged-{page}-{layout}", [Seq(1200, 1), Seq(40, 24), Seq(0, 17)], heads=2,
                                 head_dim=128, group=4, cache_mode=1, page_size=page, cache_layout=layout,
                                 t1="float16", num_layer=2, layer_idx=1)
    check_mhca_against_reference(case)


CACHE_PREFILL_VARIANTS = {
    "causal-decoding2": dict(decoding=2),
    "window-softcap": dict(sliding_window=9, softcap=5.0),
    "alibi-mask2": dict(is_alibi=1, mask=True),
    "not-causal-scale": dict(is_causal=0, softmax_scale=0.3, decoding=1),
}


@pytest.mark.parametrize("variant", sorted(CACHE_PREFILL_VARIANTS))
def test_mhca_prefill(variant, prefill_kernel):
    """Decoding sequences with S > 1 rows first, chunks and first prefills after, paged int8 layout 3, GQA 2."""
    case = build_cache_attention(f"mhca-prefill-{variant}", [Seq(17, 3), Seq(6, 2), Seq(0, 24), Seq(30, 19),
                                                             Seq(900, 1)],
                                 heads=2, head_dim=64, group=2, cache_mode=1, page_size=16, quant_bit=8,
                                 cache_layout=3, t1="float16", **CACHE_PREFILL_VARIANTS[variant])
    check_mhca_against_reference(case)


# -- the tensor-core kernel: long prefills, decodes through it, non-finite values ------------------------------------

@pytest.mark.parametrize("head_dim, heads, kv_heads, t", [(128, 16, 4, "float16"), (128, 16, 4, "bfloat16"),
                                                       (64, 8, 8, "bfloat16"), (96, 16, 2, "float16")])
def test_mma_long_prefills(t, head_dim, heads, kv_heads, prefill_kernel):
    """Prefills of 512 and 200 rows (many chunks of keys, many tiles), causal, GQA 4, 1 and 8, beside a decode."""
    case = build_attention(f"mma-long-{t}-{head_dim}", [(512, 512), (200, 200), (1, 300)], heads=heads,
                           kv_heads=kv_heads, head_dim=head_dim, t=t)
    check_mha_against_reference(case)


@pytest.mark.parametrize("form", ["1", "2"])
def test_mma_decode_rows(monkeypatch, form):
    """KVCACHE_OP_CUDA_MMA_DECODE=1: sequences of one token through the tensor-core kernel (either form), split and
    merged."""
    monkeypatch.setenv("KVCACHE_OP_CUDA_MMA_DECODE", "1")
    monkeypatch.setenv("KVCACHE_OP_CUDA_MMA", form)
    case = build_attention("mma-decode", [(1, 3000), (1, 700), (1, 1), (4, 40)], heads=8, kv_heads=2, head_dim=128,
                           t="float16", decoding=3, mask=2)
    check_mha_against_reference(case)
    cache_case = build_cache_attention("mma-decode-cache", [Seq(1200, 1), Seq(40, 1)], heads=2, head_dim=128, group=4,
                                       cache_mode=1, page_size=16, quant_bit=8, quant_group=8, cache_layout=3,
                                       t1="bfloat16")
    check_mhca_against_reference(cache_case)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_mma_non_finite_value_reaches_only_the_queries_that_see_it(bad, prefill_kernel):
    """A causal prefill whose last key's value row holds NaN or inf: the rows that do not see it stay finite (a matrix
    product would give them 0 x inf), the last row's element is not finite, as in the reference."""
    case = build_attention(f"mma-nonfinite-{bad}", [(200, 200)], heads=4, kv_heads=2, head_dim=64, t="float16")
    case.inputs["value"][199, :, 3] = bad
    call = AttentionCall("mha", case.inputs, case.attributes)
    call.run()
    got = call.output()
    want = multi_head_attention(**case.inputs, **case.attributes)
    assert np.isfinite(got[:199]).all() and np.isfinite(want[:199]).all()
    np.testing.assert_array_equal(np.isfinite(got[199]), np.isfinite(want[199]))
    assert not np.isfinite(got[199, :, 3]).any()


def test_mhca_rank3_mask():
    case = build_cache_attention("mhca-mask3", [Seq(0, 18), Seq(600, 1), Seq(10, 5)], heads=2, head_dim=128, group=3,
                                 cache_mode=1, page_size=16, t1="bfloat16", is_alibi=1, sliding_window=12)
    inputs = dict(case.inputs)
    tokens, heads = inputs["query"].shape[:2]
    rng = np.random.default_rng(3)
    mask = rng.standard_normal((heads, tokens, int(inputs["kvstarts"][-1]) + 2))
    mask[rng.random(mask.shape) < 0.1] = -np.inf
    inputs["attn_mask"] = mask.astype(inputs["query"].dtype)
    case.inputs = inputs
    check_mhca_against_reference(case)


@pytest.mark.parametrize("head_dim, group", [(5, 1), (256, 8), (64, 1)])
def test_mhca_head_dims_and_groups(head_dim, group):
    case = build_cache_attention(f"mhca-dims-{head_dim}-{group}", [Seq(700, 1), Seq(0, 19), Seq(12, 4)], heads=2,
                                 head_dim=head_dim, group=group, cache_mode=1, page_size=16, t1="float16",
                                 decoding=1)
    check_mhca_against_reference(case)


# -- misaligned device buffers --------------------------------------------------------------------------------------

@pytest.mark.parametrize("offset", [2, 6])
def test_mha_misaligned_buffers(offset):
    """Buffers off a 16-byte boundary: the kernels take per-element loads, same bound (a split decode, a chunk of
    17 queries)."""
    case = build_attention("misaligned", [(1, 1500), (17, 40), (5, 5)], heads=8, kv_heads=2, head_dim=128,
                           decoding=1, t="float16", mask=2)
    check_mha_against_reference(case, offset=offset)


@pytest.mark.parametrize("quant_bit", [0, 8])
@pytest.mark.parametrize("offset", [2, 6])
def test_mhca_misaligned_buffers(offset, quant_bit):
    case = build_cache_attention(f"mhca-misaligned-{quant_bit}", [Seq(1499, 1), Seq(20, 17), Seq(0, 5)], heads=2,
                                 head_dim=128, group=4, cache_mode=1, page_size=16, quant_bit=quant_bit,
                                 quant_group=8, t1="float16", t3="float16", mask=True)
    check_mhca_against_reference(case, offset=offset)


# -- invalid calls ----------------------------------------------------------------------------------------------------

MHA_INVALID = {r[0]: r for r in mha_error_cases.INVALID}
INVALID_MHA_CALLS = ["seqstarts_total", "kvstarts_total", "mask_too_few_columns", "decoding_batches_above_batch",
                     "causal_seqlen_exceeds_kvlen", "max_kvlen_too_small"]


@pytest.mark.parametrize("name", INVALID_MHA_CALLS)
def test_invalid_mha_call(name):
    row = MHA_INVALID[name]
    inputs, attributes = mha_error_cases.make_invalid(row)
    check_invalid("mha", inputs, attributes, row[2], error=MultiHeadAttentionError)


#: MultiHeadCacheAttention's invalid calls (mhca_error_<name>) and their messages.
MHCA_MESSAGES = {**{r[0]: r[3] for r in CACHE_INVALID + MORE_CACHE_INVALID}, **{r[0]: r[2] for r in ATTENTION_INVALID}}
INVALID_MHCA_CALLS = ["query_rows_differ", "offset_beyond_max_t", "paged_sentinel_minus_one",
                      "int8_offset_beyond_max_t", "int4_paged_sentinel_minus_one", "slot_stored_twice",
                      "paged_page_beyond_max_p", "decoding_batches_above_batch", "mask_too_few_columns",
                      "causal_seqlen_exceeds_kvlen"]


@pytest.mark.parametrize("name", INVALID_MHCA_CALLS)
def test_invalid_mhca_call(name):
    case = error_cases()[f"mhca_error_{name}"]()
    check_invalid("mhca", case.inputs, case.attributes, MHCA_MESSAGES[name])


@pytest.mark.parametrize("op", ["mha", "mhca"])
def test_a_call_on_a_stream_being_captured_into_a_cuda_graph_is_refused_with_nothing_written(op):
    """Every call copies its validated indices and tiles from host memory and sizes its launches by them: on a stream
    being captured into a graph it is refused before anything is enqueued (cache and output as they were)."""
    if op == "mha":
        case = build_attention("captured", [(1, 9), (3, 3)], heads=4, kv_heads=2, head_dim=16, decoding=1)
        error = MultiHeadAttentionError
    else:
        case = build_cache_attention("captured", [Seq(3, 1), Seq(0, 2)], heads=2, head_dim=16, group=2, cache_mode=1,
                                     page_size=4)
        error = KeyValueCacheError
    call = AttentionCall(op, case.inputs, case.attributes)
    before = {n: call.after(n).tobytes() for n in ("cache", "scale") if n in call.device}
    stream = Stream()
    with stream.capturing():
        with pytest.raises(error, match="cannot be captured into a CUDA graph"):
            call.run(stream)
    stream.synchronize()
    assert {n: call.after(n).tobytes() for n in before} == before, "a refused call wrote the cache"
    assert call.output().tobytes() == call.unwritten.tobytes(), "a refused call wrote the output"
    assert call.guards_intact()


def test_head_dim_4096_is_refused_by_name():
    """The CUDA kernels run head_dim <= 2048; a wider head is refused before anything is written."""
    mha = build_attention("wide", [(1, 4), (2, 3)], heads=2, kv_heads=1, head_dim=4096, decoding=1)
    check_invalid("mha", mha.inputs, mha.attributes, r"head_dim <= 2048, got 4096", error=MultiHeadAttentionError)
    mhca = build_cache_attention("wide", [Seq(3, 1), Seq(0, 2)], heads=1, head_dim=4096, group=2, cache_mode=1,
                                 page_size=4, quant_bit=8)
    check_invalid("mhca", mhca.inputs, mhca.attributes, r"head_dim <= 2048, got 4096")
