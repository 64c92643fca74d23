"""The tensor-core tile kernel's work, both forms (cuda/attention_mma.h, attention_mma_regs.h), run on the host through the attention host runner: the
blocks of the launch the GPU path plans for float16 and bfloat16 prefills and chunks, each block's team phase by
phase, its warps' matrix products in float over the checked shared memory. Within the spec's bound of the naive
float64 oracle (and the cache bit for bit the naive KeyValueCache's), with no out-of-bounds access, race, or read
of shared memory nothing wrote; keys staged in chunks across a rising max, split key ranges merged, every cache
layout and quantization read in place, and the one-by-one path for value rows holding inf or NaN."""

import types

import numpy as np
import pytest

from ort_helpers import copies
from test_attention_host_runner import check_mha, check_mhca, runner  # noqa: F401 (the runner fixture)

from kvcache_op.reference import multi_head_attention
from kvcache_op.validation.cases import Seq
from kvcache_op.validation.mha_cases import build_attention
from kvcache_op.validation.mhca_cases import build_cache_attention

#: Prefill sequences longer than a chunk of keys (64) and than a tile's rows, a decoding chunk, a decode row, an empty
#: query, and a prefill of more query rows than keys would allow without decoding_batches.
SEQS = [(1, 150), (19, 25), (70, 70), (3, 7), (0, 4), (1, 1)]


@pytest.fixture(params=[1, 2], ids=["smem-products", "register-products"])
def form(request):
    """The tensor-core kernel's form: its products through shared memory (1) or in fragment registers (2)."""
    return request.param


@pytest.mark.parametrize("head_dim,t,heads,kv_heads,extras", [
    (128, "float16", 8, 2, {}),
    (64, "bfloat16", 4, 4, {"mask": 3, "softcap": 3.0}),
    (16, "float16", 16, 1, {"is_alibi": 1, "sliding_window": 20}),
    (32, "bfloat16", 6, 2, {"mask": 2, "sliding_window": 9}),
    (80, "float16", 2, 1, {"is_causal": 0}),
])
def test_prefill_tiles_are_within_the_bound(runner, form, head_dim, t, heads, kv_heads, extras):
    """GQA groups of 4, 1, 16 (a tile of four rows of sixteen heads), 3 and 2; masks, softcap, ALiBi, windows."""
    case = build_attention(f"mma-{head_dim}-{t}-{heads}", SEQS, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                           t=t, decoding=1, **extras)
    result = check_mha(runner, case, min_blocks=1, mma_form=form)
    assert result.report.mma_tiles > 0 and result.report.mma_form == form


def test_float32_and_unfit_head_dims_take_the_tile_kernel(runner, form):
    for t, head_dim in (("float32", 64), ("float16", 24), ("bfloat16", 144)):
        case = build_attention(f"no-mma-{t}-{head_dim}", [(5, 9)], heads=2, head_dim=head_dim, t=t)
        result = check_mha(runner, case, min_blocks=1, mma_form=form)
        assert result.report.mma_tiles == 0 and result.report.tiles > 0, (t, head_dim)


def test_split_key_ranges_of_tensor_core_tiles_merge_within_the_bound(runner, form):
    case = build_attention("mma-split", [(2, 400), (40, 300)], heads=4, kv_heads=2, head_dim=32, t="float16")
    result = check_mha(runner, case, min_blocks=10**6, min_split_keys=64, mma_form=form)
    assert result.report.mma_tiles > 0 and result.report.split_tiles > 0 and result.report.merges > 0


def test_a_rising_max_rescales_the_output_sums_of_earlier_chunks(runner, form):
    """Scores rising from chunk to chunk: every raised max must rescale the output sums already in shared memory."""
    case = build_attention("mma-rising", [(3, 600)], heads=2, kv_heads=1, head_dim=16, t="bfloat16")
    key, query = case.inputs["key"], case.inputs["query"].astype(np.float32)
    direction = query[0, 0] / np.linalg.norm(query[0, 0])
    ramp = np.linspace(0.0, 6.0, key.shape[0], dtype=np.float32)
    key[...] = (ramp[:, None, None] * direction + 0.1 * key.astype(np.float32)).astype(key.dtype)
    result = check_mha(runner, case, min_blocks=1, mma_form=form)
    assert result.report.mma_tiles == 1 and result.report.split_tiles == 0


def test_decode_rows_through_the_tensor_core_kernel(runner, form):
    case = build_attention("mma-decode", [(1, 200), (1, 1), (1, 65)], heads=8, kv_heads=2, head_dim=64, t="float16",
                           decoding=3, mask=2)
    result = check_mha(runner, case, min_blocks=1, mma_decode=True, mma_form=form)
    assert result.report.mma_tiles > 0 and result.report.decode_tiles == 0 and result.report.tiles == 0


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_value_reaches_only_the_queries_that_see_it(runner, form, bad):
    """A causal prefill whose last key's value row holds NaN (or inf): in a matrix product the queries that do not
    see that key would still multiply it by their weight 0 (0 x inf is NaN), so that chunk adds its weights one by
    one. Rows before the last stay finite; in the last row the element of that column is not (NaN, or inf), as in
    the reference."""
    case = build_attention(f"mma-nonfinite-{bad}", [(40, 40)], heads=2, kv_heads=1, head_dim=16, t="float16")
    case.inputs["value"][39, 0, 3] = bad
    result = runner.run(copies(case.inputs), case.attributes, min_blocks=1, mma_form=form)
    assert result.code == 0 and result.report.faults() == 0, result.message
    assert result.report.mma_tiles > 0
    want = multi_head_attention(**case.inputs, **case.attributes)
    assert np.isfinite(result.output[:39]).all()
    assert np.isfinite(want[:39]).all()
    np.testing.assert_array_equal(np.isfinite(result.output[39]), np.isfinite(want[39]))
    assert not np.isfinite(result.output[39, :, 3]).any()


def test_a_nan_value_under_a_minus_inf_score_makes_the_row_nan(runner, form):
    """Spec, non-finite values: a visible key masked to -inf has weight 0 but stays in the sums (weight 0 x NaN)."""
    case = build_attention("mma-nan-under-mask", [(4, 100)], heads=1, head_dim=16, t="bfloat16", mask=2)
    case.inputs["attn_mask"][:, :50] = -np.inf
    case.inputs["value"][0, 0, 0] = np.nan
    result = runner.run(copies(case.inputs), case.attributes, min_blocks=1, mma_form=form)
    assert result.code == 0 and result.report.mma_tiles > 0, result.message
    assert np.isnan(result.output).any(axis=-1).all()
    assert np.isnan(multi_head_attention(**case.inputs, **case.attributes)).any(axis=-1).all()


@pytest.mark.parametrize("below,want", [(80.0, np.inf), (90.0, np.nan)])
def test_an_inf_value_under_a_weight_below_2_to_the_126_is_nan(runner, form, below, want):
    """The weights come from the GPU's exp2 unit, which flushes results below 2^-126 to 0 (the host runner flushes as
    it does): an inf value whose key scores 80 below the max still gives inf (weight e^-80 = 1.8e-35), but 90 below
    (e^-90 = 8.2e-40) its weight is 0 and 0 x inf is NaN. The spec leaves the weights' underflow open: the naive
    oracle gives inf for both. The other columns are exactly 1."""
    head_dim = 16
    query = np.zeros((2, 1, head_dim), np.float16)
    query[:, 0, 0] = 1
    key = np.zeros((2, 1, head_dim), np.float16)
    key[1, 0, 0] = -1  # key 0 scores 0, key 1 -below
    value = np.ones((2, 1, head_dim), np.float16)
    value[1, 0, 3] = np.inf
    inputs = dict(query=query, key=key, value=value, attn_mask=None, seqstarts=np.array([0, 2]),
                  kvstarts=np.array([0, 2]), decoding_batches=np.array(0), max_seqlen=np.array(2),
                  max_kvlen=np.array(2))
    attributes = dict(num_heads=1, head_dim=head_dim, is_causal=0, softmax_scale=below)
    result = runner.run(copies(inputs), attributes, min_blocks=1, mma_form=form)
    assert result.code == 0 and result.report.faults() == 0 and result.report.mma_tiles > 0, result.message
    assert np.isposinf(multi_head_attention(**inputs, **attributes)[:, 0, 3]).all()
    column = result.output[:, 0, 3]
    assert (np.isnan(column) if np.isnan(want) else np.isposinf(column)).all(), column
    assert np.all(np.delete(result.output, 3, axis=-1) == 1)


@pytest.mark.parametrize("route", ["chunk", "mma-decode", "draft-tokens", "cache-attention"])
def test_outputs_at_the_float16_maximum_saturate_instead_of_overflowing(runner, form, route):
    """Every value 65504 (float16's largest), so the exact output is 65504. The weights exp(-0.69265) = 0.500249 of
    all keys but the first round to 0.5005 in float16 while the weight sum stays unrounded, so O / sum reaches
    65504 (1 + ~2^-11), which float16 rounds to inf: the spec saturates it to 65504. A causal chunk at the end of 64
    keys, a decode row through the tensor-core kernel, a decoding sequence of two draft tokens, and a causal prefill
    of 64 tokens through MultiHeadCacheAttention (its float16 cache)."""
    n, head_dim = 64, 16
    queries = {"chunk": 4, "mma-decode": 1, "draft-tokens": 2, "cache-attention": n}[route]
    query = np.zeros((queries, 1, head_dim), np.float16)
    query[:, 0, 0] = 1
    key = np.zeros((n, 1, head_dim), np.float16)
    key[1:, 0, 0] = -1  # key 0 scores 0, the others -0.69265
    value = np.full((n, 1, head_dim), 65504, np.float16)
    attributes = dict(num_heads=1, head_dim=head_dim, is_causal=1, softmax_scale=0.69265)
    options = dict(min_blocks=1, mma_form=form, mma_decode=route == "mma-decode")
    if route == "cache-attention":
        case = build_cache_attention("mma-saturate", [Seq(0, n)], group=1, heads=1, head_dim=head_dim, t1="float16")
        inputs = dict(case.inputs, query=query, current_key=key, current_value=value)
        result = check_mhca(runner, inputs, {**case.attributes, **attributes}, **options)
    else:
        inputs = dict(query=query, key=key, value=value, attn_mask=None, seqstarts=np.array([0, queries]),
                      kvstarts=np.array([0, n]), decoding_batches=np.array(int(route != "chunk")),
                      max_seqlen=np.array(queries), max_kvlen=np.array(n))
        result = check_mha(runner, types.SimpleNamespace(inputs=inputs, attributes=attributes), **options)
    assert result.report.mma_tiles > 0
    assert np.all(result.output == np.float16(65504)), result.output[:, 0, :2]


@pytest.mark.parametrize("quant_bit,group,head_dim", [(0, 8, 128), (8, 8, 64), (4, 16, 32), (8, 16, 16)])
@pytest.mark.parametrize("mode,layout,page_size", [(0, 0, 0), (1, 3, 5), (1, 1, 16), (1, 2, 4)])
def test_cache_layouts_pages_and_quantization(runner, form, quant_bit, group, head_dim, mode, layout, page_size):
    """Prefill rows read every layout, page size and quantization in place, staged as KeyValueCache's gather gives
    them (dequantized and rounded to T1). The second form is built for unquantized rows only: a quantized cache
    asking for it runs the first."""
    seqs = [Seq(70, 1), Seq(1, 70), Seq(6, 9), Seq(0, 5), Seq(2, 0), Seq(33, 1)]
    case = build_cache_attention(f"mma-mhca-{quant_bit}-{group}-{layout}", seqs, group=4, decoding=1, is_alibi=1,
                                 sliding_window=50, softcap=3.0, mask=True, heads=2, head_dim=head_dim,
                                 quant_bit=quant_bit, quant_group=group, cache_mode=mode, cache_layout=layout,
                                 page_size=page_size or 4, t1="bfloat16" if quant_bit == 4 else "float16",
                                 t3="float16")
    result = check_mhca(runner, case.inputs, case.attributes, min_blocks=64, min_split_keys=16, mma_form=form)
    assert result.report.mma_tiles > 0
    assert result.report.mma_form == (form if quant_bit == 0 else 1)


def test_a_missing_barrier_in_the_tensor_core_kernel_is_a_race_the_runner_reports(runner, form):
    case = build_attention("mma-no-sync", [(20, 20)], heads=2, head_dim=16, t="float16")
    result = runner.run(copies(case.inputs), case.attributes, skip_sync=True, mma_form=form)
    assert result.code == 4 and result.report.read_write > 0, result.message


def test_a_wait_that_leaves_copies_in_flight_in_the_register_form_is_a_race_the_runner_reports(runner):
    """The register form copies each chunk's rows with cp.async and reads them only after waiting for them. With the
    wait leaving one more group in flight than the kernel asks, it reads rows a copy still writes: flagged."""
    case = build_attention("mma-short-wait", [(40, 200)], heads=4, kv_heads=2, head_dim=64, t="float16")
    result = runner.run(copies(case.inputs), case.attributes, min_blocks=1, mma_form=2, short_wait=1)
    assert result.code == 4 and result.report.read_write > 0, result.message
    assert "asynchronous copy in flight" in result.message
    check_mha(runner, case, min_blocks=1, mma_form=2)
