"""The CPU kernel's row paths against the reference, bit for bit, in every build (AVX-512 and AVX2+F16C where
the CPU has them, and the generic one): quantization and dequantization over every kind of group size (one
vector of 8, a batch of eight or sixteen groups, partial batches, longer groups, groups of 1, 2 and 4, odd
groups), rows with exact ties, zeros, subnormals, overflowing scales, infinities and NaNs, codes -128 / -8
already in the cache, and outputs large enough for streaming stores, at every offset from a cache line."""

import ctypes
import platform

import numpy as np
import pytest

from cpu_kernels import (CPU_KERNELS, CPU_VENDORS, NEEDS_MXCSR, amd_processor, call_reports, expected_prefetch_heads,
                         give_back_mxcsr, use_cpu_kernel, use_cpu_vendor)
from cpu_kernels import mxcsr  # noqa: F401 - a fixture
from ort_helpers import assert_same_bits, copies, reference_result

from kvcache_op.benchmarks.bound_session import aligned_copy
from kvcache_op.capi import c_api
from kvcache_op.reference.dtypes import QMAX
from kvcache_op.validation.cases import Seq, build

# (head_dim, quant_group): group 8 in one partial batch (1, 3 groups), whole batches (8, 16, 32: a head row of
# one or two AVX-512 blocks), a batch and one group (17); longer groups (16 ... 128); groups of 1, 2, 4 (spread
# scales); groups of 3 (the portable loop). The cases run every layout, so layout 3's rows quantized a token's
# heads at a time meet one block and two per row.
ROW_SHAPES = [(8, 8), (24, 8), (64, 8), (128, 8), (136, 8), (256, 8), (128, 16), (64, 32), (256, 128), (128, 1),
              (64, 2), (128, 4), (24, 3), (6, 3)]
TYPES = [(t1, t3) for t1 in ("float32", "float16", "bfloat16") for t3 in ("float32", "float16")]


def special_rows(rng, shape, group, quant_bit, dtype):
    """Rows of ``shape`` (tokens, H, Dh) whose groups are each of one kind: plain, exact ties of the quotient
    (max |x| = qmax * m * 2^e, the rest (k + 1/2) * m * 2^e, m odd), zeros and -0, subnormal-small, huge (a float16 scale
    overflows), one NaN, one infinity, one large element among small ones, small enough for the smallest
    scale (dequantized values then float16 subnormals), and max |x| just above eps * qmax, where a float16
    scale rounds down by up to 0.3% and |x / scale| reaches 1.003 qmax (the fast paths round it unclamped)."""
    qmax = QMAX[quant_bit]
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    groups = x.reshape(-1, group)
    for g, kind in zip(groups, rng.integers(0, 10, len(groups))):
        at = rng.integers(group)
        if kind == 1:  # the scale an odd m of 1, 3, 5 or 7 times a power of two (the ties' quotient is then
            # not a product with a power of two; in bfloat16, whose 8 bits cannot hold every (k + 1/2) * m, the
            # inputs next to ties)
            step = np.float32(rng.choice([1, 3, 5, 7]) * 2.0 ** int(rng.integers(-10, 4)))
            g[:] = (rng.integers(-qmax, qmax, group) + np.float32(0.5)) * step
            g[at] = qmax * step * rng.choice([-1, 1])
        elif kind == 2:
            g[:] = rng.choice([np.float32(0), np.float32(-0.0)], group)
        elif kind == 3:
            g *= np.float32(1e-7)
        elif kind == 4:
            g *= np.float32(1e7)
        elif kind == 5:
            g[at] = np.nan  # the canonical quiet NaN: NaN payloads are not specified
        elif kind == 6:
            g[at] = np.inf * rng.choice([-1, 1])
        elif kind == 7:
            g *= np.float32(1e-3)
            g[at] = np.float32(50)
        elif kind == 8:
            g *= np.float32(1e-4)
        elif kind == 9:  # amax / qmax = (k + f) * 2^-24 in float16's subnormal steps above eps = 1e-5
            amax = np.float32(qmax * (rng.integers(168, 1024) + rng.uniform(0.3, 0.5)) * 2.0**-24)
            g[:] = rng.uniform(-1, 1, group).astype(np.float32) * amax
            g[at] = amax * rng.choice([-1, 1])
    with np.errstate(over="ignore"):  # huge values overflow float16 inputs to inf: one more kind of row
        return x.astype(dtype)


def fill_special_rows(case, rng, group, quant_bit):
    """Replaces the case's current_key, then its current_value, with special_rows of their shapes and types."""
    for name in ("current_key", "current_value"):
        x = case.inputs[name]
        case.inputs[name] = special_rows(rng, x.shape, group, quant_bit, x.dtype)


def special_case(quant_bit, head_dim, group, t1, t3, index, layout=None):
    """A case of special_rows in 2 heads; its layout is ``layout``, else index % 4."""
    seqs = [Seq(0, 21), Seq(9, 1), Seq(4, 6, 7), Seq(2, 0, 2)]  # prefill, decode, chunk with a partial load, empty
    # num_repeat turns with index // 2, so that both kinds of scales meet outputs without repeats (TYPES
    # alternates them)
    case = build(f"rows-{quant_bit}-{head_dim}-{group}-{t1}-{t3}", seqs, heads=2, head_dim=head_dim,
                 quant_bit=quant_bit, quant_group=group, num_repeat=1 + index // 2 % 2, cache_mode=index % 2,
                 cache_layout=index % 4 if layout is None else layout, page_size=4, t1=t1, t3=t3)
    rng = np.random.default_rng(index)
    fill_special_rows(case, rng, group, quant_bit)
    cache = case.inputs["cache"]  # codes the op never writes, read by the loads: -128 and -8 included
    low = np.array(-128 if quant_bit == 8 else -8).astype(cache.dtype)
    cache.reshape(-1)[rng.integers(0, cache.size, cache.size // 10)] = low
    scale = case.inputs["scale"]  # and scales around every edge of a fast path: float16 subnormals, 2^-14,
    # products near float16's largest value and past it (with -128), inf, NaN, negative
    edges = np.array([6e-8, 1e-5, 2.0**-14 * 0.999, 2.0**-14, 255.9, 256, 256.2, 511.7, 511.8, 515.9, 520, 65504,
                      np.inf, np.nan, -0.5, -300], np.float32)
    with np.errstate(over="ignore"):
        scale.reshape(-1)[rng.integers(0, scale.size, scale.size // 4)] = rng.choice(edges, scale.size // 4).astype(scale.dtype)
    return case


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("quant_bit", [8, 4])
@pytest.mark.parametrize("head_dim,group", ROW_SHAPES, ids=[f"Dh{d}-g{g}" for d, g in ROW_SHAPES])
def test_quantized_rows_give_the_references_bits(head_dim, group, quant_bit, kernel, monkeypatch):
    use_cpu_kernel(monkeypatch, kernel)
    for index, (t1, t3) in enumerate(TYPES):
        # the layout turns with the group count and the code width too, so that layout 3 meets other types than
        # the one pair it would with head_dim (a multiple of 4) alone
        layout = (index + head_dim + head_dim // 8 + quant_bit // 4) % 4
        case = special_case(quant_bit, head_dim, group, t1, t3, index + head_dim, layout)
        want = reference_result(case.inputs, case.attributes)
        fresh = copies(case.inputs)
        key, value = c_api.key_value_cache(**fresh, **case.attributes, num_threads=2)
        assert_same_bits((key, value, fresh["cache"], fresh["scale"]), want)


def large_case(quant_bit, layout, num_repeat, t1, head_dim, heads=4, page_size=64):
    """Outputs of > 16 MiB each, so the kernel writes them with streaming stores."""
    longest = 9000 if head_dim >= 128 else 45000  # either way outputs of > 16 MiB
    # partial loads too, and sequences that only load (gathered rows beside each other across sequences, and
    # the output's last row gathered)
    seqs = [Seq(longest, 1), Seq(0, 70, 50), Seq(3000, 0), Seq(8000, 3), Seq(1000, 1), Seq(0, 130, 90), Seq(500, 0)]
    return build(f"large-{quant_bit}-{layout}-{num_repeat}", seqs, heads=heads, head_dim=head_dim, quant_bit=quant_bit,
                 quant_group=8, num_repeat=num_repeat, cache_mode=1, cache_layout=layout, page_size=page_size, t1=t1,
                 t3="float16")


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("quant_bit,layout,num_repeat,t1,head_dim,heads,page_size",
                         [(0, 0, 1, "float16", 128, 4, 64), (0, 3, 1, "float32", 128, 4, 64),
                          (0, 1, 2, "bfloat16", 128, 4, 64), (0, 2, 1, "float16", 128, 7, 64),
                          (0, 3, 1, "float16", 128, 6, 64), (0, 3, 2, "bfloat16", 64, 5, 64),
                          (0, 0, 1, "float16", 40, 6, 64), (0, 3, 1, "float16", 40, 6, 64),
                          (0, 3, 1, "float16", 48, 5, 64), (8, 0, 1, "float16", 128, 4, 64),
                          (8, 3, 1, "float16", 128, 4, 64), (8, 3, 2, "float16", 128, 4, 64),
                          (8, 3, 1, "float16", 40, 4, 64), (8, 2, 2, "float32", 128, 4, 64),
                          (4, 3, 1, "bfloat16", 128, 4, 64), (4, 1, 1, "float16", 128, 4, 64),
                          (8, 1, 1, "float32", 128, 4, 64), (8, 3, 1, "float32", 64, 4, 64),
                          (8, 3, 1, "float32", 128, 4, 64), (8, 2, 1, "float16", 128, 4, 64),
                          (0, 2, 1, "bfloat16", 128, 4, 64), (0, 3, 1, "float16", 128, 12, 64),
                          (8, 3, 1, "float16", 128, 4, 5), (8, 3, 2, "float16", 128, 4, 5),
                          (0, 3, 1, "float16", 128, 6, 16), (0, 3, 1, "float16", 128, 6, 5),
                          (4, 2, 1, "float16", 128, 4, 64), (0, 1, 1, "float32", 64, 3, 16),
                          (0, 0, 1, "float16", 64, 5, 64), (8, 3, 1, "float16", 128, 12, 64),
                          (8, 0, 1, "float16", 128, 12, 64)])
def test_streamed_outputs_give_the_references_bits(quant_bit, layout, num_repeat, t1, head_dim, heads, page_size,
                                                   kernel, monkeypatch, capfd):
    """Under every store plan ($KVCACHE_OP_STORES) and output offset (on a line, 16 and 2 bytes past one, and an
    odd 33, which no row cut in registers takes): layout 3's streamed quantized rows go a few heads at a time (head
    rows of whole cache lines or not: Dh 40's 80-byte rows, Dh 48's 96 bytes, 8 groups of Dh 64), each token's
    heads one row where they are whole vectors, the edge lines of rows held by the task's line writer until the
    next rows complete them; quantized rows are dequantized straight into the streamed outputs (the AVX-512 build
    at any even offset, the others on lines) and through a scratch row where that cannot be. Layout 3's
    unquantized rows streamed one stream at a time go a page run and that many heads at a time too, with repeats
    each head's copies through the line writer. The heads a row ($KVCACHE_OP_STREAMED_HEADS) turn with the plan
    and offset: one, three and four of 4-7 heads leave short last groups, 16 is every head, and the measured count
    (eight values; quantized, eight on Intel processors running the AVX-512 build, else four) leaves four of 12
    or none. Token-order gathers go in tiles
    ($KVCACHE_OP_GATHER_TILE) of a token, of 32 KiB, of bytes that are no whole number of tokens or of more than a
    task's tokens; quantized codes are stored with streaming stores and plain ones in turn
    ($KVCACHE_OP_CODE_STORES), and their tokens asked for ahead a head, 300 bytes, whole, past their end or the
    measured bytes ($KVCACHE_OP_TOKEN_PREFETCH; 12 heads of 128 int8 codes are rows over a kilobyte, of which AMD
    processors ask for 512 bytes); layout 3's unquantized head rows are asked for into the second-level cache and
    into the first in turn ($KVCACHE_OP_HEAD_PREFETCH). Unquantized rows of layouts 0-2 without repeats, of whole vectors
    at even offsets, are read as several runs of a task's rows side by side in the AVX-512 build ($KVCACHE_OP_TOKEN_STREAMS: one,
    three, eight, the measured count and 16; rows of 768, 1024 and 1792 bytes, and of 640, whose last 256-byte
    chunk is short), each row off a line chained to its neighbours or its edge lines held; the others (Dh 40's
    480-byte rows, the odd 33, the other builds) row after row whatever the count. Nothing around the outputs is written. With side-by-side streams, unquantized rows
    are read as several streams at any offset (runs of tokens, or in layout 3 groups of heads: 5, 6 and 7 heads leave a short last group, and the
    last task's tiles are short). Pages of 64 slots, and in layout 3 of 16 and of 5 (page runs shorter than the
    rows the gathers ask for ahead of their use: the requests go on across passes). Each call's own plan
    ($KVCACHE_OP_CPU_VERBOSE) shows every setting reached the kernel and the outputs were streamed where the plan
    streams (side by side where it reads unquantized rows so)."""
    use_cpu_kernel(monkeypatch, kernel)
    monkeypatch.setenv("KVCACHE_OP_CPU_VERBOSE", "1")  # each call's plan as the kernel received it, checked below
    case = large_case(quant_bit, layout, num_repeat, t1, head_dim, heads, page_size)
    want = reference_result(case.inputs, case.attributes)
    assert want[0].nbytes > 16 << 20
    runs = [  # (store plan, output offset, heads a row (None: the measured count), tile bytes, token streams (None:
        # the measured count))
        ("side-by-side", 0, 4, 0, 3), ("side-by-side", 16, 3, 32768, None), ("side-by-side", 2, 1, 5000, 16),
        ("stream", 0, 3, 5000, 1), ("stream", 16, None, 524288, None), ("stream", 16, 3, 0, 3),
        ("stream", 2, 4, 32768, 16), ("stream", 0, 8, 0, 8), ("stream", 33, 16, 0, 5),
        ("cached", 0, 16, 0, 8), ("cached", 16, 1, 5000, None), ("cached", 2, 4, 32768, 3)]
    for run, (stores, offset, streamed_heads, tile, token_streams) in enumerate(runs):
        monkeypatch.setenv("KVCACHE_OP_STORES", stores)
        monkeypatch.setenv("KVCACHE_OP_CODE_STORES", ("stream", "cached")[run % 2])
        head_prefetch = ("l2", "l1", None)[run % 3]  # None: the measured level (layout 3's value rows)
        if head_prefetch is None:
            monkeypatch.delenv("KVCACHE_OP_HEAD_PREFETCH", raising=False)
        else:
            monkeypatch.setenv("KVCACHE_OP_HEAD_PREFETCH", head_prefetch)
            assert c_api.cpu_head_prefetch() == head_prefetch
        prefetch = ("1", "0", None, "300", "1000000")[run % 5]  # None: the measured bytes for the row
        if prefetch is None:
            monkeypatch.delenv("KVCACHE_OP_TOKEN_PREFETCH", raising=False)
        else:
            monkeypatch.setenv("KVCACHE_OP_TOKEN_PREFETCH", prefetch)
        if streamed_heads is None:  # the measured count: 8 values, 8 or 4 quantized heads a pass
            monkeypatch.delenv("KVCACHE_OP_STREAMED_HEADS", raising=False)
            assert c_api.cpu_streamed_heads(quant_bit) == default_streamed_heads(quant_bit)
        else:
            monkeypatch.setenv("KVCACHE_OP_STREAMED_HEADS", str(streamed_heads))
            assert c_api.cpu_streamed_heads(quant_bit) == streamed_heads
        monkeypatch.setenv("KVCACHE_OP_GATHER_TILE", str(tile))
        assert tile_bytes_by_layout(quant_bit) == [tile] * 4
        if token_streams is None:
            monkeypatch.delenv("KVCACHE_OP_TOKEN_STREAMS", raising=False)
        else:
            monkeypatch.setenv("KVCACHE_OP_TOKEN_STREAMS", str(token_streams))
            assert c_api.cpu_token_streams() == token_streams
        fresh = copies(case.inputs)
        fresh["cache"] = aligned_copy(fresh["cache"])  # code rows on lines, where streaming stores take them
        capfd.readouterr()
        (key, value), guards = guarded_outputs(fresh, case.attributes, offset)
        assert_same_bits((key, value, fresh["cache"], fresh["scale"]), want)
        assert all((g == 0xA5).all() for g in guards), f"bytes around the outputs were written ({stores}, {offset})"
        # The settings reached the kernel: this call's own plan, not what the queries say a call would get.
        [plan] = call_reports(capfd.readouterr().err)
        level = "l1" if quant_bit else (head_prefetch or default_head_prefetch())
        codes = "stream" if quant_bit and kernel == "avx512" and run % 2 == 0 else "cached"
        assert (plan["build"], plan["stream_outputs"], plan["side_by_side"]) == (
            kernel, int(stores != "cached"), int(stores == "side-by-side" and quant_bit == 0)), plan
        assert (plan["streamed_heads"], plan["tile_bytes"], plan["token_streams"], plan["code_stores"],
                plan["head_prefetch"], plan["prefetch_heads"]) == (
            streamed_heads or default_streamed_heads(quant_bit), tile, token_streams or default_token_streams(), codes,
            level, expected_prefetch_heads(quant_bit, heads, head_dim)), plan


def tile_bytes_by_layout(quant_bit: int) -> list:
    """c_api.cpu_gather_tile_bytes of cache layouts 0-3, in order, for ``quant_bit``."""
    return [c_api.cpu_gather_tile_bytes(layout, quant_bit) for layout in range(4)]


def guarded_outputs(given, attributes, offset=0, guard=256):
    """(key, value), and their guards' bytes, of the C entry point run with outputs that hold a pattern first,
    start ``offset`` bytes past a cache line and lie between ``guard`` bytes (a multiple of 64) of another
    pattern on either side; the cache in ``given`` is written in place."""
    args = c_api.HostBuffers()
    inputs = [args.tensor(n, given[n], written=n in ("cache", "scale")) for n in c_api.KV_INPUTS]
    shape = c_api.output_shape(inputs, **attributes)
    dtype = given["current_key"].dtype
    nbytes = int(np.prod(shape)) * dtype.itemsize
    placed = [guarded_bytes(nbytes, offset, guard, 0xA5) for _ in range(2)]
    for bytes_, _ in placed:
        bytes_[:] = 0x7F  # NaN-like bits in every type: a row left unwritten shows
    outputs = [c_api.Tensor(c_api.ONNX_TYPES[dtype], shape, bytes_.ctypes.data) for bytes_, _ in placed]
    c_api.run_key_value_cache(inputs, outputs, num_threads=2, **attributes)
    args.finish()
    body = [bytes_.view(dtype).reshape(shape) for bytes_, _ in placed]
    guards = [np.concatenate(sides) for _, sides in placed]
    return body, guards


def guarded_bytes(nbytes, offset, guard, pattern):
    """(body, guards): ``nbytes`` bytes starting ``offset`` bytes past a cache line, between ``guard`` bytes (a
    multiple of 64) on either side, all holding ``pattern``; guards are views of the two sides, to check after the
    body is written."""
    raw = np.full(nbytes + 2 * guard + 128, pattern, np.uint8)
    start = (-raw.ctypes.data) % 64 + guard + offset
    return raw[start:start + nbytes], [raw[:start], raw[start + nbytes:]]


def guarded_copy(array, offset, guard=256):
    """(copy, guards): a C-contiguous copy of ``array`` starting ``offset`` bytes past a cache line, between
    ``guard`` bytes (a multiple of 64) of a pattern on either side; guards are views of those bytes, to check
    after the copy is written in place."""
    body, guards = guarded_bytes(array.nbytes, offset, guard, 0x5A)
    copy = body.view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy, guards


def load_only(given):
    """The inputs of a call that loads what ``given`` loads and stores nothing: the gathers' own reading of the
    cache."""
    loads = dict(given)
    loads["seqstarts"] = np.zeros_like(given["seqstarts"])
    loads["start_pos"] = np.diff(given["kvstarts"]).astype(np.int64)
    loads["max_seqlen"] = np.zeros_like(given["max_seqlen"])
    for name in ("current_key", "current_value"):
        loads[name] = given[name][:0]
    return loads


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("quant_bit,layout,num_repeat,cache_mode",
                         [(0, 0, 1, 1), (0, 3, 2, 1), (0, 1, 1, 0), (8, 0, 2, 1), (8, 3, 1, 1), (8, 3, 1, 0),
                          (4, 2, 1, 1), (4, 3, 2, 1)])
@pytest.mark.parametrize("heads,head_dim", [(3, 64), (2, 128), (2, 256)])
def test_stored_tokens_reach_their_output_rows_only_where_loaded(quant_bit, layout, num_repeat, cache_mode, heads,
                                                                 head_dim, kernel, monkeypatch):
    """A token the call stores and loads is written to its output rows by the store (from the cache rows it has just
    written) and left by the gather: every output row is the reference's, a stored token past its sequence's kvlen
    reaches no output row (the last sequence's would lie past the outputs' end), and nothing around the outputs or
    the scales is touched. Sequences store and load all, load part of what they store (up to a stored position, or
    below every stored one), store without loading, load without storing, across pages (of 16, 5 or 7 slots with
    head rows of 64, 128 or 256) and the gather's tasks of 64 tokens; the gathers in either cached order and in
    tiles of one token, a few or many, outputs on a cache line or off it, codes stored with streaming stores (the
    cache on a line or off it) or plain ones, scales on a line, 32 bytes past one (layout 3's scale rows of 16
    float16 then streamed a whole line at a time, the halves held in between, starting on either half) or 16 past
    (ordinary stores). Head rows of 128 and 256 quantized without repeats are one and two blocks of 16 groups: the
    AVX-512 build writes their values as it quantizes them (QuantizeRowsWithValues, its codes then streamed where
    $KVCACHE_OP_CODE_STORES says so), the others read them back. Quantized rows hold special_rows' values (NaN, inf,
    ties, scales at float16's edges), and every output byte, NaN payloads included, is also the one a call that only
    loads (the gathers' own dequantization) reads from the cache written."""
    use_cpu_kernel(monkeypatch, kernel)
    seqs = [Seq(0, 70, 40), Seq(5, 3), Seq(9, 0), Seq(30, 100), Seq(4, 6, 2), Seq(12, 5, 0), Seq(0, 66, 65)]
    t1 = ("float16", "bfloat16", "float32")[(quant_bit + layout + num_repeat + head_dim // 64) % 3]
    t3 = ("float16", "float32")[(layout + num_repeat + cache_mode + head_dim // 128) % 2]
    case = build(f"fused-{quant_bit}-{layout}-{num_repeat}-{cache_mode}-{head_dim}", seqs, heads=heads, head_dim=head_dim,
                 quant_bit=quant_bit, quant_group=8, num_repeat=num_repeat, cache_mode=cache_mode,
                 cache_layout=layout, page_size=(16, 5, 7)[head_dim // 128], t1=t1, t3=t3)
    if quant_bit:
        fill_special_rows(case, np.random.default_rng(head_dim + layout), 8, quant_bit)
    want = reference_result(case.inputs, case.attributes)
    # (cached order, output offset, tile bytes, code stores, cache offset, scale offset)
    for order, offset, tile, codes, at, scale_at in (
            ("tokens", 0, 0, "stream", 0, 0), ("head-runs", 16, 32768, "cached", 0, 32),
            ("tokens", 2, 1000, "stream", 16, 32), ("head-runs", 0, 0, "stream", 0, 16)):
        monkeypatch.setenv("KVCACHE_OP_CACHED_GATHER", order)
        monkeypatch.setenv("KVCACHE_OP_GATHER_TILE", str(tile))  # token-order gathers' tiles: 1, 2 or many tokens
        monkeypatch.setenv("KVCACHE_OP_CODE_STORES", codes)
        assert c_api.cpu_code_stores() == codes
        fresh = copies(case.inputs)
        # the cache on a line or 16 bytes past one: code rows streamed, or not streamable
        fresh["cache"] = aligned_copy(fresh["cache"], at)
        scale_guards = []
        if quant_bit:
            fresh["scale"], scale_guards = guarded_copy(fresh["scale"], scale_at)
        (key, value), guards = guarded_outputs(fresh, case.attributes, offset)
        assert_same_bits((key, value, fresh["cache"], fresh["scale"]), want)
        assert all((g == 0xA5).all() for g in guards), f"bytes around the outputs were written ({order}, {offset})"
        assert all((g == 0x5A).all() for g in scale_guards), f"bytes around the scales were written ({scale_at})"
        loaded = c_api.key_value_cache(**load_only(copies(fresh)), **case.attributes, num_threads=2)
        for got, gathered in zip((key, value), loaded):
            assert got.tobytes() == gathered.tobytes(), f"bits other than the gathers' ({order}, {offset})"


def reserved_zeros(nbytes):
    """(address, unmap) of ``nbytes`` of zero pages reserved but not committed (MAP_NORESERVE): a cache whose
    slots reach far while only the few the test touches take memory. Skips where the system refuses it."""
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    address = libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        pytest.skip(f"the system refused a {nbytes >> 40} TiB reservation (errno {ctypes.get_errno()})")
    return address, lambda: libc.munmap(address, nbytes)


@pytest.mark.skipif(platform.system() != "Linux", reason="reserves address space with Linux's mmap")
@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_a_stored_position_past_int64_max_reaches_no_output_row(kernel, monkeypatch):
    """Paged positions may pass INT64_MAX (a page table of 2^22 pages of 2^41 slots): a sequence storing 200
    tokens from INT64_MAX and loading none has no output row, and none of its tokens may land in one, nor past the
    outputs' end. The other sequence stores one token at position 0 and loads it: the one output row."""
    use_cpu_kernel(monkeypatch, kernel)
    page, stored = 1 << 41, 200
    first = (1 << 63) - 1
    last_page = first // page
    max_pages = (first + stored) // page + 1
    slots = page + (1 << 20)  # the cache's MaxT: a page from slot 0, and sequence 0's page at 2^20 (its one slot)
    address, unmap = reserved_zeros(slots * 2 * 2)  # layout 0: (MaxT, 1 layer, K/V, 1 head, Dh 1) float16
    try:
        cache = np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_uint16)), shape=(slots * 2,))
        table = np.full((2, max_pages), -1, np.int64)
        table[0, 0] = 1 << 20
        table[1, last_page], table[1, last_page + 1] = 0, 1  # position 2^63 - 1 at slot page - 1, the rest from 1
        key = (np.arange(1 + stored) + 100).astype(np.float16).reshape(-1, 1, 1)
        value = (np.arange(1 + stored) + 400).astype(np.float16).reshape(-1, 1, 1)
        arrays = [key, value, np.array([0, 1, 1 + stored], np.int64), np.array([0, 1, 1], np.int64), table,
                  np.array([0, first], np.int64), np.array(stored, np.int64), np.array(1, np.int64)]
        inputs = [c_api.Tensor(c_api.onnx_type(a.dtype), a.shape, a.ctypes.data) for a in arrays]
        inputs += [c_api.Tensor(c_api.ONNX_TYPES[np.dtype(np.float16)], (slots, 1, 2, 1, 1), address), c_api.ABSENT]
        attributes = dict(cache_mode=1, page_size=page, cache_layout=0)
        shape = c_api.output_shape(inputs, **attributes)
        assert tuple(shape) == (1, 1, 1)
        guard = 4096
        buffers = [np.full(2 + 2 * guard, 0xA5, np.uint8) for _ in range(2)]
        outputs = [c_api.Tensor(c_api.ONNX_TYPES[np.dtype(np.float16)], shape, b.ctypes.data + guard) for b in buffers]
        c_api.run_key_value_cache(inputs, outputs, num_threads=2, **attributes)
        assert [float(b[guard:guard + 2].view(np.float16)[0]) for b in buffers] == [100.0, 400.0]
        assert all((np.delete(b, [guard, guard + 1]) == 0xA5).all() for b in buffers), "bytes past the outputs written"
        stored_keys = np.concatenate([cache[(page - 1) * 2:(page - 1) * 2 + 1], cache[2:2 * stored:2]])
        assert (stored_keys.view(np.float16) == key[1:, 0, 0]).all()  # the stores themselves happened
    finally:
        unmap()


def test_the_store_plan_follows_the_override_and_else_streams_one_source(monkeypatch):
    """$KVCACHE_OP_STORES names the plan outright (anything else leaves the measured choice); unset, every
    processor streams one source stream, measured ahead of four side by side on AMD EPYCs and on Intel Xeons of
    models 207 and 167 (on that last 0.86x against 0.60x a copy into outputs 16 bytes past a line)."""
    for plan in ("side-by-side", "stream", "cached"):
        monkeypatch.setenv("KVCACHE_OP_STORES", plan)
        assert c_api.cpu_stores() == plan
    for other in ("Stream", "side_by_side", ""):
        monkeypatch.setenv("KVCACHE_OP_STORES", other)
        assert c_api.cpu_stores() == "stream", other
    monkeypatch.delenv("KVCACHE_OP_STORES")
    assert c_api.cpu_stores() == "stream"


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("order", ["head-runs", "tokens"])
@pytest.mark.parametrize("quant_bit,head_dim,group,num_repeat,page_size",
                         [(8, 128, 8, 1, 4), (4, 64, 8, 2, 16), (8, 24, 3, 1, 5), (8, 136, 8, 2, 64), (4, 128, 16, 1, 7)])
def test_layout3_gathers_into_cached_outputs_give_the_references_bits_in_either_order(
        order, quant_bit, head_dim, group, num_repeat, page_size, kernel, monkeypatch):
    """Quantized layout-3 gathers into outputs that stay cached, a head's page runs at a time or token by
    token: runs cut by pages and by the gather's tasks (64 tokens), a chunk loading part of its keys, repeats."""
    use_cpu_kernel(monkeypatch, kernel)
    monkeypatch.setenv("KVCACHE_OP_CACHED_GATHER", order)
    assert c_api.cpu_cached_gather() == order
    seqs = [Seq(0, 70), Seq(130, 1), Seq(9, 6, 7), Seq(61, 64)]
    case = build(f"cached-gather-{quant_bit}-{head_dim}-{page_size}", seqs, heads=3, head_dim=head_dim,
                 quant_bit=quant_bit, quant_group=group, num_repeat=num_repeat, cache_mode=1, cache_layout=3,
                 page_size=page_size, t1="float16", t3="float16")
    want = reference_result(case.inputs, case.attributes)
    fresh = copies(case.inputs)
    key, value = c_api.key_value_cache(**fresh, **case.attributes, num_threads=2)
    assert_same_bits((key, value, fresh["cache"], fresh["scale"]), want)


@pytest.mark.parametrize("vendor", CPU_VENDORS)
def test_the_streamed_heads_follow_the_override_and_else_the_vendor_and_the_kernel_build(monkeypatch, vendor):
    """$KVCACHE_OP_STREAMED_HEADS names the count outright for quantized and unquantized caches alike (a positive
    integer, at most 16: more is taken as 16; anything else is not a count and leaves the measured choice); unset,
    quantized heads eight on Intel processors running the AVX-512 build (measured on an Intel Xeon of model 167) and
    four on AMD processors and under the other builds (eight source streams: codes and scales; measured best on an
    AMD EPYC of Zen 4), and eight unquantized everywhere (measured on that AMD EPYC and on the Intel Xeon). A
    quant_bit the op does not have is refused, by the binding and by the C function (-1)."""
    use_cpu_vendor(monkeypatch, vendor)
    monkeypatch.delenv("KVCACHE_OP_CPU_KERNEL", raising=False)
    defaults = {q: default_streamed_heads(q) for q in (0, 4, 8)}
    for given, want in (("1", 1), ("3", 3), ("16", 16), ("40", 16), ("0", None), ("-2", None), ("four", None),
                        ("4x", None), ("", None)):
        monkeypatch.setenv("KVCACHE_OP_STREAMED_HEADS", given)
        for quant_bit, default in defaults.items():
            assert c_api.cpu_streamed_heads(quant_bit) == (want or default), (given, quant_bit)
    monkeypatch.delenv("KVCACHE_OP_STREAMED_HEADS")
    assert {q: c_api.cpu_streamed_heads(q) for q in defaults} == defaults
    for quant_bit in (-1, 2, 16, 8.0, True):
        with pytest.raises(ValueError, match="quant_bit must be 0, 4 or 8"):
            c_api.cpu_streamed_heads(quant_bit)
    for quant_bit in (-1, 1, 2, 16, 1 << 40):
        assert c_api.library().kvcache_op_cpu_streamed_heads(quant_bit) == -1
    for build in ("avx2", "generic"):
        monkeypatch.setenv("KVCACHE_OP_CPU_KERNEL", build)
        assert {q: c_api.cpu_streamed_heads(q) for q in (0, 4, 8)} == {0: 8, 4: 4, 8: 4}, build


def default_streamed_heads(quant_bit: int) -> int:
    """The heads a streamed layout-3 row measured best for this processor: eight unquantized; quantized, eight on
    Intel processors running the AVX-512 build, else four."""
    return 8 if quant_bit == 0 or (c_api.cpu_kernel() == "avx512" and not amd_processor()) else 4


@pytest.mark.parametrize("vendor", CPU_VENDORS)
def test_the_token_streams_follow_the_override_and_else_the_vendor_and_the_kernel_build(monkeypatch, vendor):
    """$KVCACHE_OP_TOKEN_STREAMS names how many runs of a task's rows token-order gathers read side by side (a
    positive integer, at most 16: more is taken as 16; anything else is not a count and leaves the measured choice);
    unset, in the AVX-512 build 8 on Intel processors (measured on an Intel Xeon of model 167) and 4 on AMD
    processors (measured on an AMD EPYC of Zen 4); 1, one row after another, under the other builds, which never
    read runs."""
    use_cpu_vendor(monkeypatch, vendor)
    monkeypatch.delenv("KVCACHE_OP_CPU_KERNEL", raising=False)
    default = default_token_streams()
    for given, want in (("1", 1), ("3", 3), ("16", 16), ("40", 16), ("0", default), ("-2", default),
                        ("eight", default), ("8x", default), ("", default)):
        monkeypatch.setenv("KVCACHE_OP_TOKEN_STREAMS", given)
        assert c_api.cpu_token_streams() == want, given
    monkeypatch.delenv("KVCACHE_OP_TOKEN_STREAMS")
    assert c_api.cpu_token_streams() == default
    for build in ("avx2", "generic"):
        monkeypatch.setenv("KVCACHE_OP_CPU_KERNEL", build)
        assert c_api.cpu_token_streams() == 1, build
        monkeypatch.setenv("KVCACHE_OP_TOKEN_STREAMS", "5")
        assert c_api.cpu_token_streams() == 5, build
        monkeypatch.delenv("KVCACHE_OP_TOKEN_STREAMS")


PREFETCH_ROWS = (1, 512, 1024, 1025, 2048, 4096, 1 << 40)


def default_token_prefetch(row_bytes: int) -> int:
    """The token prefetch measured best for this processor and a token of ``row_bytes`` of codes: on AMD processors
    the whole row (0) up to 1 KiB and 512 bytes of longer ones; 1024 bytes on others."""
    if not amd_processor():
        return 1024
    return 0 if row_bytes <= 1024 else 512


@pytest.mark.parametrize("vendor", CPU_VENDORS)
def test_the_token_prefetch_follows_the_override_and_else_the_vendor_and_the_row(monkeypatch, vendor):
    """$KVCACHE_OP_TOKEN_PREFETCH names how many bytes of a quantized token's codes token-order gathers ask for ahead
    whatever the row (a non-negative integer, 0 for the whole row; anything else is not a count and leaves the
    measured choice); unset, 1024 on Intel processors (measured on an Intel Xeon of model 167), and on AMD
    processors the whole row up to 1 KiB and 512 bytes of longer rows (measured on an AMD EPYC of Zen 4), whichever
    kernel build runs (every build prefetches). A row below one byte is refused, by the binding and by the C
    function (-1)."""
    use_cpu_vendor(monkeypatch, vendor)
    for build in (None, "avx2", "generic"):
        if build is None:
            monkeypatch.delenv("KVCACHE_OP_CPU_KERNEL", raising=False)
        else:
            monkeypatch.setenv("KVCACHE_OP_CPU_KERNEL", build)
        for row in PREFETCH_ROWS:
            default = default_token_prefetch(row)
            for given, want in (("0", 0), ("1", 1), ("4096", 4096), ("-1", default), ("1k", default),
                                ("", default)):
                monkeypatch.setenv("KVCACHE_OP_TOKEN_PREFETCH", given)
                assert c_api.cpu_token_prefetch_bytes(row) == want, (build, row, given)
            monkeypatch.delenv("KVCACHE_OP_TOKEN_PREFETCH")
            assert c_api.cpu_token_prefetch_bytes(row) == default, (build, row)
    for row in (0, -1, 1.0, True, "1024", 1 << 63, (1 << 64) + 4096):  # ctypes would wrap the last two
        with pytest.raises(ValueError, match="row_bytes must be a positive int"):
            c_api.cpu_token_prefetch_bytes(row)
    for row in (0, -1, -(1 << 40)):
        assert c_api.library().kvcache_op_cpu_token_prefetch_bytes(row) == -1


def default_token_streams() -> int:
    """The token streams measured best for this processor: in the AVX-512 build 8 on Intel processors and 4 on AMD
    processors; 1 in the other builds."""
    if c_api.cpu_kernel() != "avx512":
        return 1
    return 4 if amd_processor() else 8


def test_the_cpu_vendor_override_names_amd_or_intel_and_else_leaves_the_processors_kind(monkeypatch):
    """$KVCACHE_OP_CPU_VENDOR makes the measured choices follow AMD's ("amd") or Intel's ("intel") on any machine;
    any other word, and none, leaves this processor's kind. Read through a choice that differs by kind: layout 2's
    gather tiles, 512 KiB on AMD processors and 32 KiB on others."""
    monkeypatch.delenv("KVCACHE_OP_GATHER_TILE", raising=False)
    monkeypatch.delenv("KVCACHE_OP_CPU_VENDOR", raising=False)
    this_kind_amd = amd_processor()
    for given, amd in (("amd", True), ("intel", False), ("AMD", this_kind_amd), ("zen", this_kind_amd),
                       ("", this_kind_amd)):
        monkeypatch.setenv("KVCACHE_OP_CPU_VENDOR", given)
        assert amd_processor() == amd, given
        assert c_api.cpu_gather_tile_bytes(2, 0) == (512 << 10 if amd else 32 << 10), given


@pytest.mark.parametrize("quant_bit", [0, 4, 8])
@pytest.mark.parametrize("vendor", CPU_VENDORS)
def test_the_gather_tile_follows_the_override_and_else_the_layout_and_quantization(monkeypatch, vendor, quant_bit):
    """$KVCACHE_OP_GATHER_TILE names the tile's bytes outright, in every layout and quantization (a non-negative
    integer; anything else leaves the measured choice). Unset: a token at a time where a token's key and value rows
    lie together (layouts 0 and 1), as measured on the Intel Xeon of model 207 and on an AMD EPYC of Zen 4; where
    they lie apart (layouts 2 and 3), tiles of 512 KiB on AMD processors (measured on that AMD EPYC), and on others
    tiles of 32 KiB for unquantized rows and a token at a time for quantized ones (measured on the Intel Xeons of
    models 207 and 167). A layout the op does not have, or another quant_bit, is refused, by the binding and by the
    C function (-1)."""
    use_cpu_vendor(monkeypatch, vendor)
    default = default_gather_tiles(quant_bit)
    if vendor is not None:  # the kind's rule written out, apart from the helper that this machine's kind uses
        apart = 512 << 10 if vendor == "amd" else 0 if quant_bit else 32 << 10
        assert default == [0, 0, apart, apart]
    for given, want in (("0", [0] * 4), ("5000", [5000] * 4), ("32768", [32768] * 4), ("-1", default),
                        ("32k", default), ("", default)):
        monkeypatch.setenv("KVCACHE_OP_GATHER_TILE", given)
        assert tile_bytes_by_layout(quant_bit) == want, given
    monkeypatch.delenv("KVCACHE_OP_GATHER_TILE")
    assert tile_bytes_by_layout(quant_bit) == default
    for layout in (-1, 4, 1.0, True):
        with pytest.raises(ValueError, match="cache_layout must be 0, 1, 2 or 3"):
            c_api.cpu_gather_tile_bytes(layout, quant_bit)
    for bits in (1, 2, 16, 8.0, True, None):
        with pytest.raises(ValueError, match="quant_bit must be 0, 4 or 8"):
            c_api.cpu_gather_tile_bytes(2, bits)
    for layout, bits in ((-1, quant_bit), (4, quant_bit), (1 << 40, quant_bit), (2, 1), (2, 16), (2, -8)):
        assert c_api.library().kvcache_op_cpu_gather_tile_bytes(layout, bits) == -1


def default_gather_tiles(quant_bit: int) -> list:
    """The gather tiles measured best for layouts 0-3 of ``quant_bit`` on this processor: a token where a token's
    key and value rows lie together; else 512 KiB on AMD processors, and on others 32 KiB for unquantized rows and
    a token at a time for quantized ones."""
    apart = 512 << 10 if amd_processor() else 0 if quant_bit else 32 << 10
    return [0, 0, apart, apart]


def test_benchmark_titles_name_the_heads_the_token_streams_the_tiles_of_each_layout_and_the_code_stores(monkeypatch):
    """The benchmarks' titles record the choices that ran: the heads a streamed row, the runs token-order gathers
    read side by side, the tiles of layouts 0-3, how codes are stored and where layout 3's value rows are asked for
    ahead, overrides included."""
    from kvcache_op.benchmarks.timing import kernel_build

    for name in ("KVCACHE_OP_STREAMED_HEADS", "KVCACHE_OP_TOKEN_STREAMS", "KVCACHE_OP_TOKEN_PREFETCH",
                 "KVCACHE_OP_GATHER_TILE", "KVCACHE_OP_CODE_STORES", "KVCACHE_OP_CPU_KERNEL",
                 "KVCACHE_OP_HEAD_PREFETCH"):
        monkeypatch.delenv(name, raising=False)
    codes = default_code_stores()
    other = "cached" if codes == "stream" else "stream"
    tiles = " and ".join("/".join(map(str, default_gather_tiles(quant_bit))) for quant_bit in (8, 0))
    prefetch = "whole rows/512 B" if amd_processor() else "1024 B/1024 B"
    assert (f"{default_streamed_heads(8)}/8 streamed heads a row (quantized/values), {default_token_streams()} token"
            f" streams, quantized token prefetch of {prefetch} (rows of 1/4 KiB), gather tiles of {tiles} B (quantized"
            f" and values), {codes} code stores, layout-3 value prefetch into {default_head_prefetch()}"
            in kernel_build())
    monkeypatch.setenv("KVCACHE_OP_STREAMED_HEADS", "3")
    monkeypatch.setenv("KVCACHE_OP_TOKEN_STREAMS", "5")
    monkeypatch.setenv("KVCACHE_OP_TOKEN_PREFETCH", "300")
    monkeypatch.setenv("KVCACHE_OP_GATHER_TILE", "5000")
    monkeypatch.setenv("KVCACHE_OP_CODE_STORES", other)
    other_level = "l1" if default_head_prefetch() == "l2" else "l2"
    monkeypatch.setenv("KVCACHE_OP_HEAD_PREFETCH", other_level)
    assert (f"3/3 streamed heads a row (quantized/values), 5 token streams, quantized token prefetch of 300 B/300 B"
            f" (rows of 1/4 KiB), gather tiles of 5000/5000/5000/5000 and 5000/5000/5000/5000 B (quantized and values),"
            f" {other} code stores, layout-3 value prefetch into {other_level}" in kernel_build())
    monkeypatch.setenv("KVCACHE_OP_TOKEN_PREFETCH", "0")
    assert "quantized token prefetch of whole rows/whole rows (rows of 1/4 KiB)," in kernel_build()


def default_code_stores() -> str:
    """The code stores measured best for this processor: streamed wherever the AVX-512 build runs."""
    return "stream" if c_api.cpu_kernel() == "avx512" else "cached"


def test_the_code_stores_follow_the_override_and_else_the_kernel_build(monkeypatch):
    """$KVCACHE_OP_CODE_STORES names how codes are stored outright ("stream" or "cached"; anything else leaves the
    measured choice); unset, every processor running the AVX-512 build streams them (measured faster on an AMD EPYC
    and an Intel Xeon, layout 3 most); the other builds, which never stream codes, store them plainly."""
    monkeypatch.delenv("KVCACHE_OP_CPU_KERNEL", raising=False)
    for choice in ("stream", "cached"):
        monkeypatch.setenv("KVCACHE_OP_CODE_STORES", choice)
        assert c_api.cpu_code_stores() == choice
    default = default_code_stores()
    for other in ("streaming", "", "Stream"):
        monkeypatch.setenv("KVCACHE_OP_CODE_STORES", other)
        assert c_api.cpu_code_stores() == default, other
    monkeypatch.delenv("KVCACHE_OP_CODE_STORES")
    assert c_api.cpu_code_stores() == default
    for build in ("avx2", "generic"):
        monkeypatch.setenv("KVCACHE_OP_CPU_KERNEL", build)
        assert c_api.cpu_code_stores() == "cached", build


@pytest.mark.parametrize("vendor", CPU_VENDORS)
def test_the_head_prefetch_follows_the_override_and_else_the_cpu_vendor(monkeypatch, vendor):
    """$KVCACHE_OP_HEAD_PREFETCH names where layout 3's unquantized head rows are asked for ahead outright ("l2" or
    "l1"; any other word leaves the measured choice); unset, AMD processors ask for them into the second-level cache
    (measured ahead on an AMD EPYC of Zen 4) and others into the first (the second no faster on an Intel Xeon of
    model 207), whichever kernel build runs (every build prefetches)."""
    use_cpu_vendor(monkeypatch, vendor)
    default = default_head_prefetch()
    for build in (None, "avx2", "generic"):
        if build is None:
            monkeypatch.delenv("KVCACHE_OP_CPU_KERNEL", raising=False)
        else:
            monkeypatch.setenv("KVCACHE_OP_CPU_KERNEL", build)
        for given, want in (("l2", "l2"), ("l1", "l1"), ("L2", default), ("2", default), ("", default)):
            monkeypatch.setenv("KVCACHE_OP_HEAD_PREFETCH", given)
            assert c_api.cpu_head_prefetch() == want, (build, given)
        monkeypatch.delenv("KVCACHE_OP_HEAD_PREFETCH")
        assert c_api.cpu_head_prefetch() == default, build


def default_head_prefetch() -> str:
    """The cache level layout 3's unquantized head rows are asked for into, measured best for this processor: the
    second on AMD processors, else the first."""
    return "l2" if amd_processor() else "l1"


@pytest.mark.parametrize("vendor", CPU_VENDORS)
def test_the_cached_gather_order_follows_the_override_and_else_the_cpu_vendor(monkeypatch, vendor):
    """$KVCACHE_OP_CACHED_GATHER names the order outright; unset, AMD processors walk a head's page runs
    (measured there faster than token by token) and others go token by token (measured so on an Intel Xeon)."""
    use_cpu_vendor(monkeypatch, vendor)
    for order in ("head-runs", "tokens"):
        monkeypatch.setenv("KVCACHE_OP_CACHED_GATHER", order)
        assert c_api.cpu_cached_gather() == order
    monkeypatch.delenv("KVCACHE_OP_CACHED_GATHER")
    amd = amd_processor()
    assert c_api.cpu_cached_gather() == ("head-runs" if amd else "tokens")


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("quant_bit", [8, 4])
def test_a_float16_scale_overflows_from_a_quotient_of_65520_in_every_build(kernel, quant_bit, monkeypatch):
    """The spec's limit, as every build quantizes: a group whose float32 quotient amax / qmax is 65504, just below
    65520 (scale 65504, codes normal) or 65520 (scale inf, codes 0); all four outputs as the reference's."""
    use_cpu_kernel(monkeypatch, kernel)
    qmax = np.float32(QMAX[quant_bit])
    quotients = [np.float32(65504), np.nextafter(np.float32(65520), np.float32(0)), np.float32(65520)]
    case = build(f"scale-edge-{quant_bit}", [Seq(0, 3)], heads=2, head_dim=16, quant_bit=quant_bit, quant_group=8,
                 num_repeat=1, cache_mode=1, cache_layout=0, page_size=4, t1="float32", t3="float16")
    for name in ("current_key", "current_value"):
        groups = case.inputs[name].reshape(-1, 8)
        for g in range(len(groups)):
            groups[g, :] = np.linspace(-0.5, 0.25, 8, dtype=np.float32) * (quotients[g % 3] * qmax)
            groups[g, g % 8] = quotients[g % 3] * qmax
    amaxes = np.abs(case.inputs["current_key"].reshape(-1, 8)).max(axis=1)
    assert {float(a / qmax) for a in amaxes} == {float(q) for q in quotients}
    want = reference_result(case.inputs, case.attributes)
    assert np.isinf(want[3]).any() and np.isfinite(want[3]).any()  # both sides of the edge were stored
    fresh = copies(case.inputs)
    key, value = c_api.key_value_cache(**fresh, **case.attributes, num_threads=1)
    assert_same_bits((key, value, fresh["cache"], fresh["scale"]), want)


@NEEDS_MXCSR
@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_denormals_as_zero_change_no_bit(kernel, monkeypatch, mxcsr):
    """A caller may run the op with denormals read as zero and results flushed to zero (DAZ and FTZ, e.g. ONNX
    Runtime's session.set_denormal_as_zero). The spec's arithmetic flushes no subnormal, so the op's tasks clear both
    and give them back: all four outputs bit for bit as the reference gives them. Without that, the generic build read
    a float16 scale below 2^-14 back as 0 and stored sign-only codes (+-qmax) beside the right scale, a cache
    corrupted for every later call. Every group's scale amax / qmax is a float16 subnormal, some groups all zero."""
    use_cpu_kernel(monkeypatch, kernel)
    for quant_bit in (8, 4):
        seqs = [Seq(0, 64), Seq(3, 5)]
        case = build(f"daz-{quant_bit}", seqs, heads=2, head_dim=64, quant_bit=quant_bit, quant_group=8,
                     num_repeat=1, cache_mode=1, cache_layout=0, page_size=8, t1="float16", t3="float16")
        rng = np.random.default_rng(quant_bit)
        qmax = QMAX[quant_bit]
        for name in ("current_key", "current_value"):
            x = case.inputs[name]
            amax = rng.uniform(2e-5, 5e-5, x.size // 8).astype(np.float32) * qmax
            values = rng.uniform(-1, 1, (x.size // 8, 8)).astype(np.float32) * amax[:, None]
            values[::5] = 0
            case.inputs[name] = values.reshape(x.shape).astype(np.float16)
        want = reference_result(case.inputs, case.attributes)
        fresh = copies(case.inputs)
        before = mxcsr.kv_test_set_flush_modes(3)
        try:
            key, value = c_api.key_value_cache(**fresh, **case.attributes, num_threads=1)
            after = mxcsr.kv_test_set_flush_modes(3)
        finally:
            give_back_mxcsr(mxcsr, before)
        assert after & 0x8040 == 0x8040, "the op did not give the caller's DAZ and FTZ back"
        assert_same_bits((key, value, fresh["cache"], fresh["scale"]), want)


@NEEDS_MXCSR
@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("mode", [1, 2, 3], ids=["down", "up", "toward-zero"])
def test_every_build_rounds_to_nearest_in_any_rounding_mode(kernel, mode, monkeypatch, mxcsr):
    """The op rounds to nearest even, as the spec says, whatever rounding mode the caller's MXCSR holds: its tasks
    set that mode and give the caller's back. Without that, a directed mode changed dequantized outputs, and in
    the quantizers' fast paths took quotients just above 7 (a float16 scale rounded down) to code 8, stored in
    int4 as -8, which the spec never produces; the AVX-512 build's products with the scales' reciprocals are
    exact in that mode only (int4 21 / 3 became -8). All four outputs against the reference, bit for bit, with
    rows of two blocks of 16 groups (a token's 2 heads of 128, in layout 3 its 2 head rows) and of one (Dh 64)."""
    use_cpu_kernel(monkeypatch, kernel)
    for quant_bit in (8, 4):
        for layout in (0, 3):
            for index, (t1, head_dim) in enumerate((("float16", 128), ("bfloat16", 128), ("float16", 64))):
                case = build(f"rounding-{quant_bit}-{layout}-{t1}", [Seq(0, 40), Seq(5, 3)], heads=2,
                             head_dim=head_dim, quant_bit=quant_bit, quant_group=8, num_repeat=1, cache_mode=1,
                             cache_layout=layout, page_size=8, t1=t1, t3="float16")
                fill_special_rows(case, np.random.default_rng(10 * quant_bit + 3 * layout + index), 8, quant_bit)
                if quant_bit == 4:  # groups of max 21, scale 3: codes 7 exactly
                    for name in ("current_key", "current_value"):
                        groups = case.inputs[name].reshape(-1, 8)
                        groups[::3] = np.array([21, -21, 3, 6, -9, 12, 15, 18], np.float32).astype(groups.dtype)
                want = reference_result(case.inputs, case.attributes)
                fresh = copies(case.inputs)
                before = mxcsr.kv_test_set_rounding(mode)
                try:
                    key, value = c_api.key_value_cache(**fresh, **case.attributes, num_threads=1)
                    after = mxcsr.kv_test_set_rounding(mode)
                finally:
                    give_back_mxcsr(mxcsr, before)
                assert (after >> 13) & 3 == mode, "the op did not give the caller's rounding mode back"
                assert_same_bits((key, value, fresh["cache"], fresh["scale"]), want)
