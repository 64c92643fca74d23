"""The CUDA kernels' per-thread work, run on the host for every (block, thread) of the launcher's exact
grids: bit for bit the reference's results, and no launch with an out-of-bounds or misaligned access,
two threads writing one byte, or a thread reading a byte another thread writes."""

import numpy as np
import pytest
from hypothesis import given

from cuda_host_runner import HostRunner, assert_clean, build
from far_rows import moved_cache, moved_call, slots_past_2_to_the_31
from ort_helpers import assert_same_bits, copies, reference_result
from strategies import COMBINATIONS, calls, calls_for, shift_calls

from kvcache_op.capi import c_api
from kvcache_op.reference import key_cache_rotary_shift, rotary_shift_tables
from kvcache_op.validation.cases import Seq, build as build_case


@pytest.fixture(scope="module")
def runner(request, tmp_path_factory):
    cache = getattr(request.config, "cache", None)  # reuse a build across runs when pytest's cache is on
    path = build(cache.mkdir("kv_host_runner") if cache else tmp_path_factory.mktemp("kv_host_runner"))
    return HostRunner(path)


def run_case(runner, case, **options):
    fresh = copies(case.inputs)
    result = runner.run(fresh, case.attributes, **options)
    return result, (result.key, result.value, fresh["cache"], fresh["scale"])


@pytest.mark.parametrize("combo", COMBINATIONS, ids=lambda c: f"q{c[0]}-mode{c[1]}-layout{c[2]}")
def test_host_runner_matches_reference(runner, combo):
    @given(calls_for(combo, max_batch=5))
    def check(case):
        want = reference_result(case.inputs, case.attributes)
        result, got = run_case(runner, case)
        assert_clean(result)
        assert_same_bits(got, want)

    check()


@pytest.mark.parametrize("quant_bit,t1,t3,head_dim,group", [
    (0, "float16", "float32", 128, 8), (0, "bfloat16", "float32", 64, 8), (0, "float32", "float32", 24, 8),
    (8, "float16", "float16", 64, 8), (8, "bfloat16", "float32", 48, 16), (4, "float16", "float16", 64, 8),
    (4, "float32", "float32", 30, 3), (4, "bfloat16", "float16", 10, 5), (8, "float16", "float32", 9, 3)])
@pytest.mark.parametrize("mode,layout", [(0, 0), (1, 3), (1, 1), (0, 2)])
def test_host_runner_on_many_blocks(runner, quant_bit, t1, t3, head_dim, group, mode, layout):
    """Several blocks per sequence (8 tokens a block), GQA, vector units (Dh % 8 == 0) and odd groups."""
    rng = np.random.default_rng(head_dim * 7 + quant_bit + 100 * mode + 1000 * layout)
    seqs = [Seq(int(rng.integers(0, 40)), int(rng.integers(0, 20))) for _ in range(6)] + [Seq(5, 0), Seq(0, 0)]
    case = build_case("blocks", seqs, heads=3, head_dim=head_dim, quant_bit=quant_bit, quant_group=group,
                      num_repeat=2, cache_mode=mode, cache_layout=layout, page_size=8, t1=t1, t3=t3)
    want = reference_result(case.inputs, case.attributes)
    result, got = run_case(runner, case)
    assert_clean(result)
    assert result.report.blocks > 2 * len(seqs)
    assert_same_bits(got, want)


@pytest.mark.parametrize("quant_bit,t1,t3,group", [
    (0, "float16", "float32", 8), (8, "bfloat16", "float16", 8), (4, "float32", "float32", 16), (8, "float16", "float32", 32)])
@pytest.mark.parametrize("mode,layout,page_size,heads,repeat", [
    (1, 0, 3, 8, 1), (1, 3, 5, 12, 2), (0, 1, 1, 8, 2), (1, 2, 8, 12, 1)])
def test_host_runner_on_wide_rows(runner, quant_bit, t1, t3, group, mode, layout, page_size, heads, repeat):
    """Rows of at least as many units as a block has threads (H * Dh >= 1024 at 8 elements a unit): a thread
    keeps its row unit for all of a block's tokens and walks their slots with a cursor, here across page
    boundaries inside a block (pages of 3 and 5 tokens), and some threads take more row units than others."""
    rng = np.random.default_rng(quant_bit + 10 * layout + 100 * page_size + heads)
    seqs = [Seq(int(rng.integers(0, 30)), int(rng.integers(0, 12))) for _ in range(4)] + [Seq(0, 9)]
    case = build_case("wide", seqs, heads=heads, head_dim=128, quant_bit=quant_bit, quant_group=group,
                      num_repeat=repeat, cache_mode=mode, cache_layout=layout, page_size=page_size, t1=t1, t3=t3)
    want = reference_result(case.inputs, case.attributes)
    result, got = run_case(runner, case)
    assert_clean(result)
    assert_same_bits(got, want)


def test_host_runner_reports_invalid_calls_like_the_reference(runner):
    case = build_case("bad", [Seq(2, 3)], heads=1, head_dim=8)
    inputs = copies(case.inputs)
    inputs["start_pos"] = np.array([10**6])
    result = runner.run(inputs, case.attributes)
    assert result.code == 1 and "cache" in result.message and result.report.launches == 0


def test_an_empty_scale_without_quantization_is_absent_on_the_gpu_path(runner):
    """ppl.pmx's empty kv_scale: the GPU path's validation drops it, the kernels never touch it."""
    case = build_case("empty-scale", [Seq(0, 3), Seq(4, 2)], heads=2, head_dim=8, cache_mode=1, page_size=4)
    want = reference_result(case.inputs, case.attributes)
    fresh = copies(case.inputs)
    fresh["scale"] = np.zeros(0, np.float16)
    result = runner.run(fresh, case.attributes)
    assert_clean(result)
    assert_same_bits((result.key, result.value, fresh["cache"]), want[:3])


# The checks themselves: each launch-shape mistake the launcher avoids is caught when forced.

def odd_int4_case():
    return build_case("odd-int4", [Seq(0, 5), Seq(3, 4)], heads=2, head_dim=6, quant_bit=4, quant_group=3,
                      cache_mode=1, page_size=4, t1="float16", t3="float16")


def test_two_threads_packing_one_int4_byte_are_caught(runner):
    """With odd int4 groups, one work item per group would split a packed byte between two threads; the
    launcher gives each thread two groups. Forcing one group per thread must be reported as a race."""
    case = odd_int4_case()
    assert_clean(run_case(runner, case)[0])
    result, _ = run_case(runner, case, store_unit=3)
    assert result.code == 4 and result.report.write_write > 0
    assert "store launch" in result.message and "already written by" in result.message


def test_an_out_of_bounds_write_is_caught(runner):
    """The runner takes the cache one byte shorter than the kernels think: the store into the last slot's
    last byte must be reported (and not performed)."""
    case = build_case("last-slot", [Seq(0, 3)], heads=1, head_dim=8, max_t=3, t1="float16")
    cache = case.inputs["cache"]
    result, _ = run_case(runner, case, buffer_bytes={"cache": cache.nbytes - 1})
    assert result.code == 4 and result.report.out_of_bounds > 0
    assert "writes bytes" in result.message and f"of cache, which has {cache.nbytes - 1} bytes" in result.message


def offset_outputs(case, offset):
    """Outputs whose data start `offset` bytes into a larger buffer (a caller's view), kept alive."""
    import kvcache_op.capi.c_api as capi

    shape = capi.output_shape([capi.HostBuffers().tensor(n, case.inputs.get(n)) for n in capi.KV_INPUTS],
                              **case.attributes)
    dtype = case.inputs["current_key"].dtype
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = [np.zeros(nbytes + 64, np.uint8) for _ in range(2)]
    base = [r.ctypes.data + (-r.ctypes.data) % 16 + offset for r in raw]
    tensors = {name: capi.Tensor(capi.ONNX_TYPES[dtype], shape, b) for name, b in zip(("out_key", "out_value"), base)}
    views = [np.frombuffer(r, np.uint8, nbytes, b - r.ctypes.data).view(dtype).reshape(shape) for r, b in zip(raw, base)]
    return tensors, views, raw


def test_misaligned_buffers_get_scalar_accesses(runner):
    """A caller's output may start at any element boundary: the launcher then uses one element per work
    item (16-byte accesses would fault on the GPU); forcing 16-byte units there is reported."""
    case = build_case("misaligned", [Seq(2, 5), Seq(0, 3)], heads=2, head_dim=16, num_repeat=2, t1="float16")
    want = reference_result(case.inputs, case.attributes)
    tensors, views, keep = offset_outputs(case, 2)
    fresh = copies(case.inputs)
    result = runner.run(fresh, case.attributes, tensors=tensors)
    assert_clean(result)
    assert_same_bits((views[0], views[1], fresh["cache"], fresh["scale"]), want)
    result = runner.run(copies(case.inputs), case.attributes, tensors=tensors, gather_unit=8)
    assert result.code == 4 and result.report.misaligned > 0 and "not 16-byte aligned" in result.message
    del keep


def test_a_thread_reading_what_another_writes_is_caught(runner):
    """current_key placed inside the cache it is stored into (the C entry points refuse such aliasing):
    threads read bytes that other threads of the same launch write."""
    case = build_case("alias", [Seq(0, 8)], heads=2, head_dim=8, max_t=16, t1="float32")
    fresh = copies(case.inputs)
    cache = fresh["cache"]
    key = case.inputs["current_key"]
    slot_bytes = cache.nbytes // 16
    alias = c_api.Tensor(c_api.ONNX_TYPES[key.dtype], key.shape, cache.ctypes.data + 4 * slot_bytes)
    result = runner.run(fresh, case.attributes, tensors={"current_key": alias})
    assert result.code == 4 and result.report.read_write > 0 and "read by" in result.message


# KeyCacheRotaryShift's kernel: one thread per (slot, head) row.

def test_rotary_host_runner_matches_reference(runner):
    @given(shift_calls())
    def check(call):
        inputs, attrs = call
        want = copies(inputs)
        key_cache_rotary_shift(**want, **attrs)
        got = copies(inputs)
        result = runner.run_rotary(got, attrs)
        assert_clean(result)
        assert_same_bits((got["cache"], got["scale"]), (want["cache"], want["scale"]), names=("cache", "scale"))

    check()


@pytest.mark.parametrize("quant_bit,layout,head_dim,rotary,interleaved", [
    (0, 0, 128, 0, 0), (8, 3, 128, 64, 1), (4, 1, 256, 0, 0), (8, 2, 9 * 2, 6, 0), (0, 3, 64, 32, 1)])
def test_rotary_host_runner_on_many_blocks(runner, quant_bit, layout, head_dim, rotary, interleaved):
    """More rows than one block (N * H > 256), full-size heads, partial rotation, both pairings."""
    rng = np.random.default_rng(head_dim + quant_bit)
    case = build_case("shift-blocks", [Seq(0, 40)], num_layer=2, layer_idx=1, heads=8, head_dim=head_dim,
                      quant_bit=quant_bit, quant_group=2 if head_dim % 8 else 8, cache_layout=layout, t1="float16",
                      max_t=160)
    slots = rng.permutation(160)[:100].astype(np.int64)
    cos, sin = rotary_shift_tables(rng.integers(-40, 40, 100), rotary or head_dim)
    inputs = dict(cache=case.inputs["cache"], scale=case.inputs["scale"], slots=slots, cos=cos, sin=sin)
    attrs = dict(num_layer=2, layer_idx=1, cache_layout=layout, quant_bit=quant_bit,
                 quant_group=2 if head_dim % 8 else 8, rotary_dim=rotary, rotary_interleaved=interleaved)
    want = copies(inputs)
    key_cache_rotary_shift(**want, **attrs)
    got = copies(inputs)
    result = runner.run_rotary(got, attrs)
    assert_clean(result)
    assert result.report.blocks > 1
    assert_same_bits((got["cache"], got["scale"]), (want["cache"], want["scale"]), names=("cache", "scale"))


def test_rotary_host_runner_catches_an_access_past_a_buffer(runner):
    """The tracing reaches the rotary kernel too: a cache shorter than the rows written is reported."""
    case = build_case("shift-oob", [Seq(0, 4)], heads=2, head_dim=8, t1="float32", max_t=8)
    cos, sin = rotary_shift_tables(np.array([1, 2]), 8)
    inputs = dict(cache=case.inputs["cache"], scale=None, slots=np.array([1, 7], np.int64), cos=cos, sin=sin)
    result = runner.run_rotary(copies(inputs), {}, buffer_bytes={"cache": 64})
    assert result.code == 4 and result.report.out_of_bounds > 0, result.message
    assert "rotary launch" in result.message and "cache" in result.message


def test_rotary_host_runner_refuses_a_quantized_row_longer_than_the_kernel_buffer(runner):
    case = build_case("shift-long", [Seq(0, 2)], heads=1, head_dim=512, quant_bit=8, t1="float32", max_t=4)
    cos, sin = rotary_shift_tables(np.array([1]), 512)
    inputs = dict(cache=case.inputs["cache"], scale=case.inputs["scale"], slots=np.array([1], np.int64), cos=cos,
                  sin=sin)
    before = inputs["cache"].tobytes()
    result = runner.run_rotary(inputs, dict(quant_bit=8))
    assert result.code == 1 and "at most 256" in result.message
    assert inputs["cache"].tobytes() == before


# Rows past 2^31 elements (far_rows): a call whose slots are moved past them must store, gather and rotate the rows
# it would near slot 0. A 2.2 GB int8 cache in layout 0 (a slot's rows are 512 codes), allocated lazily.

def _far_case():
    case = build_case("far-rows", [Seq(5, 1), Seq(0, 20), Seq(9, 3, 12), Seq(30, 1)], heads=2, head_dim=128,
                      quant_bit=8, quant_group=8, cache_mode=1, cache_layout=0, page_size=4, t1="float16",
                      t3="float16")
    return case, slots_past_2_to_the_31(case.inputs["cache"])


def test_rows_past_2_to_the_31_elements_are_stored_and_gathered_where_they_are(runner):
    case, moved = _far_case()
    want = reference_result(case.inputs, case.attributes)
    far, cache, scale = moved_call(case.inputs, moved)
    result = runner.run(far, case.attributes)
    assert_clean(result)
    assert_same_bits((result.key, result.value, cache[moved:], scale[moved:]), want)
    assert not cache[:moved].any()  # nothing stored below the moved rows (untouched pages read as the zero page)


def test_rows_past_2_to_the_31_elements_are_rotated_where_they_are(runner):
    case, moved = _far_case()
    slots = np.array([0, 3, 17, 40, case.inputs["cache"].shape[0] - 1], np.int64)
    cos, sin = rotary_shift_tables(np.array([3, -7, 11, 1, -2]), 128)
    attrs = dict(quant_bit=8, quant_group=8)
    want = dict(cache=case.inputs["cache"].copy(), scale=case.inputs["scale"].copy(), slots=slots, cos=cos, sin=sin)
    key_cache_rotary_shift(**want, **attrs)
    cache, scale = moved_cache(case.inputs, moved)
    result = runner.run_rotary(dict(cache=cache, scale=scale, slots=slots + moved, cos=cos, sin=sin), attrs)
    assert_clean(result)
    assert_same_bits((cache[moved:], scale[moved:]), (want["cache"], want["scale"]), names=("cache", "scale"))
    assert not cache[:moved].any()
