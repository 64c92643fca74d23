"""The attention CUDA kernels' work (cuda/attention_work.h, attention_decode.h), run on the host for every block of
the exact tile, decode and merge launches the GPU path plans, each block's team phase by phase: within the spec's bound of the naive float64
oracle (MultiHeadCacheAttention's cache bit for bit the naive KeyValueCache's), and no launch with an
out-of-bounds or misaligned access, a race between threads of a launch or of a phase, or a read of shared memory
nothing wrote. Long key ranges split over blocks (the log-sum-exp merge), tiles of many query rows, misaligned
buffers (the element-by-element path) and a missing barrier are each exercised."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings

from attention_host_runner import AttentionHostRunner, assert_clean, build
from attention_strategies import attention_calls
from far_rows import moved_call, slots_past_2_to_the_31
from ort_helpers import copies
from test_mha_reference import assert_within, oracle
from test_mhca_ort_cpu import naive_oracle
from test_mhca_reference import cache_attention_calls

from kvcache_op.reference import multi_head_attention
from kvcache_op.reference.layout import canonical_view
from kvcache_op.reference.quantize import dequantize
from kvcache_op.validation.cases import Seq
from kvcache_op.validation.mha_cases import ATTENTION_CASES, build_attention
from kvcache_op.validation.mhca_cases import build_cache_attention


@pytest.fixture(scope="module")
def runner(request, tmp_path_factory):
    cache = getattr(request.config, "cache", None)  # reuse a build across runs when pytest's cache is on
    path = build(cache.mkdir("attention_host_runner") if cache else tmp_path_factory.mktemp("attention_host_runner"))
    return AttentionHostRunner(path)


#: The decode form each decode route runs (0: no decode kernel).
DECODE_FORM = {"decode": 1, "staged": 2, "heads": 3, "tile": 0}


def decode_route(kernel):
    """The runner's options that send decodes to `kernel`: the tile kernel, the first decode kernel or the staged one
    (heads: its second form, every head of a tile in a thread's registers)."""
    return {"tile_kernel_only": kernel == "tile", "decode_form": max(DECODE_FORM[kernel], 1)}


def check_mha(runner, case, **options):
    exact, bound = oracle(case)
    result = runner.run(copies(case.inputs), case.attributes, **options)
    assert_clean(result)
    assert_within(result.output, exact, bound, "CUDA attention kernels (host runner)")
    assert np.all(result.output[bound == 0] == 0), "a row without an effective key must be exactly zero"
    return result


def check_mhca(runner, inputs, attributes, **options):
    exact, bound, cache_after, scale_after = naive_oracle(inputs, attributes)
    fresh = copies(inputs)
    result = runner.run(fresh, attributes, **options)
    assert_clean(result)
    assert fresh["cache"].tobytes() == cache_after.tobytes()
    if scale_after is not None:
        assert fresh["scale"].tobytes() == scale_after.tobytes()
    assert_within(result.output, exact, bound, "CUDA cache attention kernels (host runner)")
    assert np.all(result.output[bound == 0] == 0), "a row without an effective key must be exactly zero"
    return result


@settings(deadline=None)
@given(attention_calls(max_seqlen=20))
def test_multi_head_attention_blocks_are_within_the_bound(runner, case):
    check_mha(runner, case)


@settings(deadline=None)
@given(cache_attention_calls())
def test_cache_attention_blocks_write_the_naive_cache_and_are_within_the_bound(runner, call):
    check_mhca(runner, *call)


@settings(deadline=None, max_examples=20)
@given(attention_calls(max_kvlen=40, max_seqlen=3))
def test_split_key_ranges_merge_within_the_bound(runner, case):
    """Every tile with 4+ keys split into parts of 2+ keys: the parts' records and the merge launch."""
    check_mha(runner, case, min_blocks=10**6, min_split_keys=2)


@pytest.mark.parametrize("head_dim,t", [(128, "float16"), (24, "bfloat16"), (5, "float32"), (256, "float16")])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (16, 2)])
def test_prefill_tiles_and_split_decodes(runner, head_dim, t, heads, kv_heads):
    """Prefill sequences of more rows than a tile holds, a decoding chunk, and decodes long enough to split."""
    case = build_attention(f"tiles-{head_dim}-{heads}", [(1, 300), (19, 25), (3, 7), (1, 1), (0, 4)], heads=heads,
                           kv_heads=kv_heads, head_dim=head_dim, t=t, decoding=1, sliding_window=0)
    result = check_mha(runner, case, min_blocks=64, min_split_keys=64)
    assert result.report.split_tiles > 0 and result.report.merges > 0


#: (quant_bit, quant_group, head_dim, whether the staged decode kernel takes the rows): unquantized float16, or
#: codes in groups of 8 or more whose code rows and scale rows (at two bytes a scale) are whole 16-byte chunks.
CACHE_ROWS = [(0, 8, 128, True), (8, 8, 64, True), (8, 3, 24, False), (4, 8, 32, False), (4, 5, 10, False),
              (8, 4, 16, False), (4, 8, 64, True), (8, 16, 128, True)]


@pytest.mark.parametrize("quant_bit,group,head_dim,staged_fits", CACHE_ROWS)
@pytest.mark.parametrize("mode,layout,page_size", [(0, 0, 0), (1, 3, 5), (1, 1, 16), (1, 2, 4)])
@pytest.mark.parametrize("kernel", ["decode", "staged", "heads", "tile"])
def test_cache_layouts_pages_and_quantization(runner, quant_bit, group, head_dim, staged_fits, mode, layout, page_size,
                                              kernel):
    """The decode row (a sequence of one token) goes to the decode kernel where its head_dim fits it (8 x a power of
    two), in its staged form where the rows fit it (CACHE_ROWS), or to the tile kernel: each reads every layout, page
    size and quantization in place."""
    seqs = [Seq(70, 1), Seq(1, 70), Seq(6, 9), Seq(0, 5), Seq(2, 0), Seq(33, 1)]
    case = build_cache_attention(f"mhca-{quant_bit}-{group}-{layout}", seqs, group=4, decoding=1, is_alibi=1,
                                 sliding_window=50, softcap=3.0, mask=True, heads=2, head_dim=head_dim,
                                 quant_bit=quant_bit, quant_group=group, cache_mode=mode, cache_layout=layout,
                                 page_size=page_size or 4, t1="float16", t3="float16")
    result = check_mhca(runner, case.inputs, case.attributes, min_blocks=64, min_split_keys=16,
                        **decode_route(kernel))
    assert (result.report.decode_tiles > 0) == (kernel != "tile" and head_dim in (16, 32, 64, 128))
    if result.report.decode_tiles:
        assert result.report.decode_form == (DECODE_FORM[kernel] if kernel in ("staged", "heads") and staged_fits
                                             else 1)


@pytest.mark.parametrize("layout,page_size", [(0, 4), (3, 5)])
def test_a_page_table_reaches_the_device_only_as_far_as_the_call_reads_it(runner, layout, page_size):
    """A page table sized for the longest context a model allows (MaxP far past the pages of positions
    [0, start_pos + seqlen), the columns after them -1) gives the same cache, the same output bit for bit and the
    same index words, for the attention and for the stores, as a table of just the columns read: its unread columns
    are neither copied nor read."""
    seqs = [Seq(70, 1), Seq(6, 9), Seq(0, 5), Seq(2, 0), Seq(12, 0, 10)]
    case = build_cache_attention(f"wide-table-{layout}", seqs, group=2, decoding=1, heads=2, head_dim=16,
                                 cache_mode=1, cache_layout=layout, page_size=page_size, t1="float16", t3="float16")
    table = case.inputs["cachestarts"]
    seqlen, kvlen = np.diff(case.inputs["seqstarts"]), np.diff(case.inputs["kvstarts"])
    touched = np.where(seqlen > 0, case.inputs["start_pos"] + seqlen, kvlen)
    read = int(-(-touched.max() // page_size))
    assert read < table.shape[1], "the built table must have columns the call does not read"
    narrow, wide = copies(case.inputs), copies(case.inputs)
    narrow["cachestarts"] = np.ascontiguousarray(table[:, :read])
    wide["cachestarts"] = np.full((len(seqs), 4096), -1, np.int64)
    wide["cachestarts"][:, :table.shape[1]] = table
    results = [check_mhca(runner, inputs, case.attributes) for inputs in (narrow, wide)]
    assert results[0].output.tobytes() == results[1].output.tobytes()
    words = [(r.report.index_words, r.report.store_index_words) for r in results]
    assert words[0] == words[1], f"index words (attention, stores): narrow table {words[0]}, wide {words[1]}"
    assert words[0][1] == 3 * len(seqs) + 2 + len(seqs) * read  # seqstarts, kvstarts, start_pos, the columns read


@pytest.mark.parametrize("head_dim,t", [(8, "float32"), (16, "bfloat16"), (32, "float16"), (64, "float32"),
                                        (128, "float16"), (256, "bfloat16")])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 1), (6, 2), (2, 2)])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("form", [1, 2, 3])
def test_decode_kernel_lanes_head_groups_and_splits(runner, head_dim, t, heads, kv_heads, split, form):
    """Decode rows of every lane count (1 to 32 lanes per key row), GQA groups of 4, 6 (tiles of 4 and 2 heads), 3
    and 1, key ranges not a multiple of a step or a stage (warps with no keys in the last step, stages part empty),
    with and without splits, through every form (the staged ones for float16 / bfloat16 rows; float32 rows take the
    first); a decoding chunk and a prefill row beside them go to the tile kernel."""
    case = build_attention(f"decode-{head_dim}-{heads}-{kv_heads}", [(1, 300), (1, 1), (1, 37), (3, 9)], heads=heads,
                           kv_heads=kv_heads, head_dim=head_dim, t=t, decoding=3, mask=3 if split else 2,
                           is_alibi=int(split), softcap=3.0 if split else 0.0, sliding_window=0 if split else 20)
    result = check_mha(runner, case, min_blocks=10**6 if split else 1, min_split_keys=16, decode_form=form)
    assert result.report.decode_form == (form if form >= 2 and t != "float32" else 1)
    tiles = 3 * kv_heads * -(-(heads // kv_heads) // 4)  # three decode rows, tiles of up to four heads
    assert result.report.decode_tiles >= tiles if split else result.report.decode_tiles == tiles
    assert (result.report.split_tiles > 0) == split


@pytest.mark.parametrize("views", [("key", "value"), ("query",)])
def test_misaligned_buffers_take_the_element_path(runner, views):
    case = build_attention("views", [(1, 40), (5, 9)], heads=4, kv_heads=2, head_dim=16, t="float16", mask=3)
    check_mha(runner, case, views=views)


def test_misaligned_cache_takes_the_element_path(runner):
    case = build_cache_attention("cache-view", [Seq(1, 30), Seq(4, 3)], group=2, heads=2, head_dim=16, quant_bit=8,
                                 quant_group=8, cache_mode=1, page_size=8, t1="float16", t3="float16")
    check_mhca(runner, case.inputs, case.attributes, views=("cache",))


def test_a_missing_barrier_is_a_race_the_runner_reports(runner):
    """With team.Sync() not ending phases, threads read shared words other threads write in the same phase: the
    runner must flag it (a GPU could read either value)."""
    case = build_attention("no-sync", [(1, 12), (3, 5)], heads=2, head_dim=8, t="float32")
    result = runner.run(copies(case.inputs), case.attributes, skip_sync=True)
    assert result.code == 4 and result.report.read_write > 0, result.message
    assert "in the same phase" in result.message  # the first faults reach the caller, to say what raced


@pytest.mark.parametrize("operation", AttentionHostRunner.TEAM_OPERATIONS)
def test_a_block_wide_operation_inside_a_threads_phase_is_flagged(runner, operation):
    """A barrier, a copy group's commit or wait, a shuffle, a warp's product or ldmatrix reached from inside
    team.Each is one thread's part of a phase reaching it: divergent on the GPU, and run mid-loop here. The runner
    flags each such call (one per thread of the block), and nothing when the same operations are called outside."""
    assert runner.team_misuse(operation) == 256
    assert runner.team_misuse(None) == 0


def test_head_dim_above_the_kernels_limit_is_refused_before_anything_runs(runner):
    case = build_attention("wide", [(1, 2)], heads=1, head_dim=2056, t="float16")
    result = runner.run(copies(case.inputs), case.attributes)
    assert result.code not in (0, 4) and "head_dim <= 2048" in result.message and result.report.blocks == 0


@pytest.mark.parametrize("t,form", [("float32", 1), ("bfloat16", 1), ("bfloat16", 2), ("float16", 3)])
def test_a_rising_max_rescales_what_was_summed(runner, t, form):
    """One block walks three chunks of keys whose scores rise from chunk to chunk (no split): each raised max must
    rescale the sums of the chunks before it (the decode row's steps or stages too)."""
    case = build_attention(f"rising-{t}", [(1, 700), (2, 600)], heads=2, kv_heads=1, head_dim=16, t=t)
    key, query = case.inputs["key"], case.inputs["query"].astype(np.float32)
    direction = query[0, 0] / np.linalg.norm(query[0, 0])
    ramp = np.linspace(0.0, 6.0, key.shape[0], dtype=np.float32)
    key[...] = (ramp[:, None, None] * direction + 0.1 * key.astype(np.float32)).astype(key.dtype)
    result = check_mha(runner, case, min_blocks=1, decode_form=form)
    assert result.report.split_tiles == 0 and result.report.decode_tiles > 0  # the decode row's warps rescale too
    assert result.report.decode_form == form


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("kernel", ["decode", "staged", "heads", "tile"])
def test_a_nan_value_under_a_minus_inf_score_makes_the_row_nan_split_or_not(runner, split, kernel):
    """Spec, non-finite values: a key masked to -inf keeps weight 0 but stays in the sums. When the decode is split,
    the part seeing only -inf scores still carries its NaN into the merge (in the decode kernel, the warp seeing
    only -inf scores carries it into the block's combination too)."""
    t = "float16" if kernel in ("staged", "heads") else "float32"  # the staged forms copy rows of two-byte elements
    case = build_attention("nan-under-mask", [(1, 1024)], heads=1, head_dim=8, t=t, mask=2)
    case.inputs["attn_mask"][0, :512] = -np.inf
    case.inputs["value"][0, 0, 0] = np.nan
    result = runner.run(copies(case.inputs), case.attributes, min_blocks=10**6 if split else 1, min_split_keys=256,
                        **decode_route(kernel))
    assert_clean(result)
    assert (result.report.split_tiles > 0) == split
    assert (result.report.decode_tiles > 0) == (kernel != "tile")
    assert result.report.decode_form == DECODE_FORM[kernel]
    assert np.isnan(result.output[0]).any(), result.output[0]
    assert np.isnan(multi_head_attention(**case.inputs, **case.attributes)[0]).any()  # the reference agrees


@pytest.mark.parametrize("split", [False, True])
def test_a_wholly_masked_key_range_holding_non_finite_values_makes_its_columns_non_finite(runner, split):
    """The named case: a decode and chunks of 2 and 4 queries whose first 1536 keys are hidden by -inf, one of them
    with an infinite or NaN value. Split over ranges of 256 keys, the ranges with no finite score still carry it."""
    case = ATTENTION_CASES["mha_masked_key_range_value_not_finite"]()
    result = check_mha(runner, case, min_blocks=10**6 if split else 1, min_split_keys=256)
    assert (result.report.split_tiles > 0) == split
    want = multi_head_attention(**copies(case.inputs), **case.attributes)
    assert (~np.isfinite(want)).sum(axis=(1, 2)).tolist() == [1] * 7  # one column of each query row
    assert not np.isfinite(result.output[~np.isfinite(want)]).any()


@pytest.mark.parametrize("kernel", ["decode", "staged", "heads", "tile"])
def test_keys_masked_to_minus_inf_before_finite_ones_leave_the_row_finite(runner, kernel):
    """A warp (or chunk, or stage) whose first scores are all -inf weights them 0 until a finite score raises the
    max; exp(-inf - -inf) would be NaN."""
    t = "bfloat16" if kernel in ("staged", "heads") else "float32"
    case = build_attention("minus-inf-first", [(1, 600)], heads=4, kv_heads=1, head_dim=16, t=t, mask=2)
    case.inputs["attn_mask"][0, :300] = -np.inf
    result = check_mha(runner, case, min_blocks=1, **decode_route(kernel))
    assert np.isfinite(result.output).all()
    assert result.report.decode_form == DECODE_FORM[kernel]


@pytest.mark.parametrize("form", [2, 3])
def test_a_wait_that_leaves_copies_in_flight_is_a_race_the_runner_reports(runner, form):
    """The staged decode kernel (either form) reads a stage only after waiting for its copies. With every wait leaving
    one more group of copies in flight than the kernel asks, it reads rows a copy still writes: the runner must flag
    it."""
    case = build_attention("short-wait", [(1, 300)], heads=4, kv_heads=1, head_dim=128, t="float16")
    result = runner.run(copies(case.inputs), case.attributes, min_blocks=1, decode_form=form, short_wait=1)
    assert result.code == 4 and result.report.read_write > 0, result.message
    assert "asynchronous copy in flight" in result.message
    assert_clean(runner.run(copies(case.inputs), case.attributes, min_blocks=1, decode_form=form))


@pytest.mark.parametrize("quant_bit,t3", [(8, "float16"), (8, "float32"), (4, "float16"), (4, "float32")])
@pytest.mark.parametrize("t1", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("form", [2, 3])
def test_staged_decode_dequantizes_codes_and_scales_it_copied(runner, quant_bit, t3, t1, form):
    """Codes and their scales staged together: int8 / int4 rows with float16 or float32 scales, for every query type
    (the codes are read as stored, whatever T1 is); decode rows of 4 heads per kv head split into parts of several
    stages (the ring of 5 or 8 stages wraps), one cut short by a sliding window, in head-major pages."""
    seqs = [Seq(700, 1), Seq(333, 1), Seq(1, 1), Seq(4, 9)]
    case = build_cache_attention(f"staged-q{quant_bit}-{t3}-{t1}", seqs, group=4, decoding=3, heads=2, head_dim=64,
                                 quant_bit=quant_bit, quant_group=8, cache_mode=1, cache_layout=3, page_size=16,
                                 sliding_window=300, t1=t1, t3=t3)
    result = check_mhca(runner, case.inputs, case.attributes, min_blocks=10**6, min_split_keys=128, decode_form=form)
    assert result.report.decode_form == form and result.report.decode_tiles > 0 and result.report.split_tiles > 0


def _dequantized(cache, scale, quant_group, dtype):
    """An unquantized cache of `dtype` holding what KeyValueCache's gather gives of every row of (cache, scale) (int8,
    or ml_dtypes' int4: one code an element)."""
    return dequantize(cache.astype(np.int8), scale, quant_group, dtype)


@pytest.mark.parametrize("quant_bit,group,head_dim,t3,t1,layout,layers", [
    (8, 8, 128, "float16", "float16", 3, 1), (4, 16, 256, "float32", "bfloat16", 0, 2),
    (4, 8, 64, "float16", "bfloat16", 1, 3), (8, 32, 128, "float32", "float16", 2, 2)])
@pytest.mark.parametrize("form", [2, 3])
def test_staged_codes_give_bit_for_bit_what_staged_dequantized_rows_give(runner, quant_bit, group, head_dim, t3, t1,
                                                                          layout, layers, form):
    """Independent of any tolerance: the staged kernel over a quantized cache and over an unquantized cache holding
    the gather's dequantized rows (the same tiles, the same order of sums) give the same bytes, so every element is
    dequantized exactly as KeyValueCache gives it (code times scale rounded once, then to T1). Decodes of 4 heads per
    kv head split into parts, a sliding window, pages of 16, the last of `layers` layers."""
    case = build_cache_attention(f"staged-exact-q{quant_bit}-{head_dim}", [Seq(200, 1), Seq(77, 1), Seq(1, 1)],
                                 group=4, decoding=3, heads=2, head_dim=head_dim, quant_bit=quant_bit,
                                 quant_group=group, cache_mode=1, cache_layout=layout, page_size=16, t1=t1, t3=t3,
                                 num_layer=layers, layer_idx=layers - 1, sliding_window=150)
    inputs, attributes = case.inputs, case.attributes
    _, _, cache_after, scale_after = naive_oracle(inputs, attributes)
    rows = _dequantized(cache_after, scale_after, group, inputs["query"].dtype)
    # The unquantized call stores its current rows first: those the quantized call's store left (dequantized).
    table, start = inputs["cachestarts"], inputs["start_pos"]
    slots = [table[b, start[b] // 16] + start[b] % 16 for b in range(len(start))]
    canonical = canonical_view(rows, layout)[layers - 1]  # [2, H, MaxT, Dh]
    plain = dict(inputs, cache=rows, scale=None, current_key=np.stack([canonical[0, :, t] for t in slots]),
                 current_value=np.stack([canonical[1, :, t] for t in slots]))
    options = dict(min_blocks=10**6, min_split_keys=64, decode_form=form)
    quantized = runner.run(copies(inputs), attributes, **options)
    unquantized = runner.run(copies(plain), dict(attributes, quant_bit=0), **options)
    assert_clean(quantized)
    assert_clean(unquantized)
    assert quantized.report.decode_form == unquantized.report.decode_form == form
    assert quantized.report.split_tiles > 0
    assert quantized.output.tobytes() == unquantized.output.tobytes()


@pytest.mark.parametrize("t3,staged", [("float16", False), ("float32", True)])
@pytest.mark.parametrize("form", [2, 3])
def test_staged_decode_takes_scale_rows_of_whole_chunks_only(runner, t3, staged, form):
    """head_dim 128 in groups of 32: four scales a row, 8 bytes of float16 (the kernel copies 16-byte chunks: the
    first decode form reads them) or 16 of float32 (staged)."""
    case = build_cache_attention(f"scale-rows-{t3}", [Seq(90, 1), Seq(3, 4)], group=2, decoding=1, heads=2,
                                 head_dim=128, quant_bit=8, quant_group=32, cache_mode=1, page_size=16, t1="float16",
                                 t3=t3)
    result = check_mhca(runner, case.inputs, case.attributes, min_blocks=1, decode_form=form)
    assert result.report.decode_tiles > 0 and result.report.decode_form == (form if staged else 1)


@pytest.mark.parametrize("form", [2, 3])
def test_a_short_wait_on_staged_codes_is_a_race_the_runner_reports(runner, form):
    """The copies of a stage's scales are waited for as its codes are: with every wait one group short, a scale or
    code read before its copy landed must be flagged."""
    case = build_cache_attention("short-wait-codes", [Seq(300, 1)], group=4, heads=1, head_dim=128, quant_bit=8,
                                 quant_group=8, cache_mode=1, page_size=16, t1="float16", t3="float16")
    result = runner.run(copies(case.inputs), case.attributes, min_blocks=1, decode_form=form, short_wait=1)
    assert result.code == 4 and result.report.read_write > 0, result.message
    assert "asynchronous copy in flight" in result.message
    check_mhca(runner, case.inputs, case.attributes, min_blocks=1, decode_form=form)


def test_split_parts_of_several_chunks_merge_within_the_bound(runner):
    """Parts of 300-400 keys: each part walks two chunks (a rising max inside a part), then the merge."""
    case = build_attention("long-parts", [(1, 1200), (2, 700)], heads=4, kv_heads=2, head_dim=16, t="bfloat16")
    result = check_mha(runner, case, min_blocks=10**6, min_split_keys=300)
    assert result.report.split_tiles >= 4


@pytest.mark.parametrize("group", [16, 32])
def test_eight_code_loads_across_larger_quantization_groups(runner, group):
    case = build_cache_attention(f"groups-{group}", [Seq(1, 60), Seq(3, 5), Seq(50, 1)], group=2, heads=2, head_dim=64,
                                 quant_bit=8, quant_group=group, cache_mode=1, page_size=8, t1="float16",
                                 t3="float32")
    check_mhca(runner, case.inputs, case.attributes)


@pytest.mark.parametrize("buffer", ["output", "key", "shared", "partials"])
def test_an_access_past_a_buffer_is_reported(runner, buffer):
    """The runner's bounds check is live: with a buffer assumed shorter than it is (the last 4 bytes of the output
    and of the keys; all but 400 bytes of shared memory; 4 bytes of the split parts' records), accesses past it
    are flagged (and never made)."""
    case = build_attention("bounds", [(1, 600), (3, 9)], heads=2, head_dim=8, t="float32")
    inputs = copies(case.inputs)
    assumed = {"output": inputs["query"].nbytes - 4, "key": inputs["key"].nbytes - 4, "shared": 400, "partials": 4}
    result = runner.run(inputs, case.attributes, min_blocks=10**6, min_split_keys=256,
                        buffer_bytes={buffer: assumed[buffer]})
    assert result.code == 4 and result.report.out_of_bounds > 0, result.message


def test_a_misaligned_element_access_is_reported(runner):
    """A float32 query 2 bytes off its alignment: its 4-byte reads are flagged (a GPU would fault)."""
    case = build_attention("misaligned-float32", [(1, 5)], heads=1, head_dim=4, t="float32")
    result = runner.run(copies(case.inputs), case.attributes, views=("query",))
    assert result.code == 4 and result.report.misaligned > 0, result.message


#: Routes over the same call: the staged and first decode forms, the tile kernel, split key ranges and their merges.
FAR_ROUTES = {"staged": dict(decode_form=2), "heads": dict(decode_form=3), "decode": dict(decode_form=1),
              "tile": dict(tile_kernel_only=True), "split": dict(min_blocks=10**6, min_split_keys=8, decode_form=2),
              "split-heads": dict(min_blocks=10**6, min_split_keys=8, decode_form=3)}


@pytest.mark.parametrize("route", sorted(FAR_ROUTES))
def test_rows_past_2_to_the_31_elements_are_read_and_written_where_they_are(runner, route):
    """A cache's rows past 2^31 elements (a 2.2 GB int8 cache, layout 0: a slot's rows are 512 elements): the call's
    page table moved past them gives bit for bit the output and the stored rows the same call gives on a small cache.
    A 32-bit element offset anywhere (the rows' offsets, the slots, the scales') would read or write other rows. The
    large cache is allocated lazily (np.zeros): only the rows the call touches take memory."""
    seqs = [Seq(5, 1), Seq(0, 20), Seq(9, 3, 12), Seq(30, 1)]  # decodes, a prefill, a chunk reading earlier rows
    case = build_cache_attention("far-rows", seqs, group=2, decoding=1, heads=2, head_dim=128, quant_bit=8,
                                 quant_group=8, cache_mode=1, cache_layout=0, page_size=4, t1="float16", t3="float16")
    inputs, attributes = case.inputs, case.attributes
    options = FAR_ROUTES[route]
    near = copies(inputs)
    small = runner.run(near, attributes, **options)
    assert_clean(small)
    moved = slots_past_2_to_the_31(inputs["cache"])
    far, cache, scale = moved_call(inputs, moved)
    result = runner.run(far, attributes, **options)
    assert_clean(result)
    assert result.output.tobytes() == small.output.tobytes()
    assert cache[moved:].tobytes() == near["cache"].tobytes() and scale[moved:].tobytes() == near["scale"].tobytes()
    assert not cache[:moved].any()  # nothing stored below the moved rows (untouched pages read as the zero page)
    assert result.report.decode_form == {"staged": 2, "heads": 3, "decode": 1, "tile": 0, "split": 2,
                                         "split-heads": 3}[route]
    assert (result.report.split_tiles > 0) == route.startswith("split")


# A call of 2^31 one-token sequences x kv heads: its query (65,536 tokens x 32,768 heads x 8 float16, 32 GiB on a
# GPU) and output are addresses never touched, since validation and planning read shapes and the index inputs only.
# The process may hold 3 GiB: building the 2^31 tiles first (128 GiB) would fail for want of memory, or, without
# the cap, take the machine's.
_TOO_MANY_BLOCKS = r'''
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import ctypes
import numpy as np
from attention_host_runner import Options, Report
from kvcache_op.capi import c_api

lib = ctypes.CDLL(sys.argv[1])
lib.mha_host_run.restype = ctypes.c_int32
B, H, D = 65536, 32768, 8
f16 = c_api.onnx_type(np.dtype(np.float16))
index = {"seqstarts": np.arange(B + 1, dtype=np.int64), "kvstarts": np.zeros(B + 1, np.int64),
         "decoding_batches": np.array(B, np.int64), "max_seqlen": np.array(1, np.int64),
         "max_kvlen": np.array(0, np.int64)}
query, key, value, output = (c_api.Tensor(f16, shape, (i + 1) << 44)
                             for i, shape in enumerate([(B, H, D), (0, H, D), (0, H, D), (B, H, D)]))
tensors = [query, key, value] + [c_api.Tensor(c_api.onnx_type(index[n].dtype), index[n].shape, index[n].ctypes.data)
                                 for n in ("seqstarts", "kvstarts", "decoding_batches", "max_seqlen", "max_kvlen")]
tensors.append(c_api.ABSENT)
attrs = c_api.multi_head_attention_attributes(num_heads=H, head_dim=D, num_kv_heads=H, is_causal=0)
report, message = Report(), ctypes.create_string_buffer(4096)
options = Options(0, 0, 0)
options.tile_kernel_only = 1
for i in range(len(options.buffer_bytes)):
    options.buffer_bytes[i] = -1
code = lib.mha_host_run(ctypes.byref(attrs), c_api.c_array(tensors, 9, "inputs"), ctypes.byref(output.to_c()),
                        ctypes.byref(options), ctypes.byref(report), message, len(message))
print(code, report.blocks, message.value.decode())
'''


def test_a_call_of_more_blocks_than_one_launch_runs_is_refused_before_its_tiles_are_built(runner):
    tests = pathlib.Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-c", _TOO_MANY_BLOCKS, runner.lib._name], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(tests)})
    assert done.returncode == 0, done.stderr[-2000:]
    code, blocks, message = done.stdout.strip().split(" ", 2)
    assert code not in ("0", "4") and blocks == "0", done.stdout
    assert "blocks, more than one launch runs" in message, message
