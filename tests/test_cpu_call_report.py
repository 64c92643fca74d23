"""$KVCACHE_OP_CPU_VERBOSE=1 makes each KeyValueCache call on the CPU print its plan as the kernel received it, one
line on stderr: the build that ran, the call's shape, and every measured choice, overrides included. A call's own
plan is what the per-choice queries cannot give (streaming stores only for large outputs; choices a quantized
call does not take), so the tests that set a choice can see it reach the kernel."""

import numpy as np
import pytest

from cpu_kernels import CPU_KERNELS, call_reports, expected_prefetch_heads, use_cpu_kernel
from ort_helpers import assert_same_bits, copies, reference_result

from kvcache_op.capi import c_api
from kvcache_op.validation.cases import Seq, build

SWITCHES = ("KVCACHE_OP_STORES", "KVCACHE_OP_CACHED_GATHER", "KVCACHE_OP_STREAMED_HEADS", "KVCACHE_OP_GATHER_TILE",
            "KVCACHE_OP_TOKEN_STREAMS", "KVCACHE_OP_TOKEN_PREFETCH", "KVCACHE_OP_CODE_STORES",
            "KVCACHE_OP_HEAD_PREFETCH")


def small_case(quant_bit, layout, cache_mode=1):
    """Three sequences in 3 heads of 64 (decode, prefill, a chunk after cached rows): outputs far below the size
    that streams."""
    return build(f"report-{quant_bit}-{layout}", [Seq(5, 1), Seq(0, 9), Seq(7, 4)], heads=3, head_dim=64,
                 quant_bit=quant_bit, quant_group=8, num_repeat=1, cache_mode=cache_mode, cache_layout=layout,
                 page_size=4, t1="float16", t3="float16")


def run_case(case):
    """(key, value, cache, scale) of the C entry point on a copy of the case's inputs."""
    given = copies(case.inputs)
    args = c_api.HostBuffers()
    inputs = [args.tensor(n, given[n], written=n in ("cache", "scale")) for n in c_api.KV_INPUTS]
    shape = c_api.output_shape(inputs, **case.attributes)
    outputs = [np.empty(shape, given["current_key"].dtype) for _ in range(2)]
    c_api.run_key_value_cache(inputs, [c_api.Tensor(c_api.ONNX_TYPES[o.dtype], shape, o.ctypes.data) for o in outputs],
                              num_threads=1, **case.attributes)
    args.finish()
    return outputs[0], outputs[1], given["cache"], given["scale"]


@pytest.fixture
def measured_choices(monkeypatch):
    """Every choice left to measurement ($KVCACHE_OP_* switches unset)."""
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("value", [None, "0", "yes", "true", ""])
def test_calls_print_nothing_unless_asked(value, monkeypatch, capfd, measured_choices):
    if value is None:
        monkeypatch.delenv("KVCACHE_OP_CPU_VERBOSE", raising=False)
    else:
        monkeypatch.setenv("KVCACHE_OP_CPU_VERBOSE", value)
    run_case(small_case(0, 0))
    assert "kvcache_op" not in capfd.readouterr().err


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("quant_bit,layout,cache_mode", [(0, 0, 1), (0, 3, 1), (8, 1, 1), (8, 3, 0), (4, 2, 1)])
def test_a_call_reports_its_shape_and_the_measured_choices(kernel, quant_bit, layout, cache_mode, monkeypatch, capfd,
                                                           measured_choices):
    """One line a call, its fields the call's and the choices the queries give for a call of its kind (the heads
    and code stores of its quantization, the tiles of its layout); outputs this small are never streamed, only
    unquantized rows take the measured head-prefetch level, and the report changes no bit."""
    use_cpu_kernel(monkeypatch, kernel)
    monkeypatch.setenv("KVCACHE_OP_CPU_VERBOSE", "1")
    case = small_case(quant_bit, layout, cache_mode)
    capfd.readouterr()
    got = run_case(case)
    assert_same_bits(got, reference_result(case.inputs, case.attributes))
    [plan] = call_reports(capfd.readouterr().err)
    assert plan == {
        "build": kernel, "quant_bit": quant_bit, "layout": layout, "tokens": int(case.inputs["seqstarts"][-1]),
        "kv_tokens": int(case.inputs["kvstarts"][-1]), "heads": 3, "head_dim": 64, "outputs": 1,
        "out_bytes": got[0].nbytes,
        "stream_outputs": 0, "side_by_side": 0, "cached_gather": c_api.cpu_cached_gather(),
        "streamed_heads": c_api.cpu_streamed_heads(quant_bit),
        "tile_bytes": c_api.cpu_gather_tile_bytes(layout, quant_bit),
        "token_streams": c_api.cpu_token_streams(), "prefetch_heads": expected_prefetch_heads(quant_bit, 3, 64),
        "code_stores": c_api.cpu_code_stores() if quant_bit else "cached",
        "head_prefetch": c_api.cpu_head_prefetch() if quant_bit == 0 else "l1"}


def test_the_overrides_reach_the_kernel(monkeypatch, capfd, measured_choices):
    """The head prefetch's level, the cached order, the heads a streamed row, the tiles, the token streams and the
    token prefetch, each set outright, show in the call's own plan (the store plans and code stores: in the
    streamed-output test, whose outputs are large enough to stream)."""
    monkeypatch.setenv("KVCACHE_OP_CPU_VERBOSE", "1")
    monkeypatch.delenv("KVCACHE_OP_CPU_KERNEL", raising=False)
    case = small_case(0, 3)
    for level in ("l1", "l2"):
        for order in ("tokens", "head-runs"):
            monkeypatch.setenv("KVCACHE_OP_HEAD_PREFETCH", level)
            monkeypatch.setenv("KVCACHE_OP_CACHED_GATHER", order)
            monkeypatch.setenv("KVCACHE_OP_STREAMED_HEADS", "3")
            monkeypatch.setenv("KVCACHE_OP_GATHER_TILE", "5000")
            monkeypatch.setenv("KVCACHE_OP_TOKEN_STREAMS", "5")
            capfd.readouterr()
            run_case(case)
            [plan] = call_reports(capfd.readouterr().err)
            assert (plan["head_prefetch"], plan["cached_gather"], plan["streamed_heads"], plan["tile_bytes"],
                    plan["token_streams"]) == (level, order, 3, 5000, 5), plan
    for asked, heads in (("1", 1), ("130", 2), ("0", 3), ("100000", 3)):  # int8 heads of 64 bytes
        monkeypatch.setenv("KVCACHE_OP_TOKEN_PREFETCH", asked)
        capfd.readouterr()
        run_case(small_case(8, 0))
        assert call_reports(capfd.readouterr().err)[0]["prefetch_heads"] == heads, asked
    monkeypatch.setenv("KVCACHE_OP_STREAMED_HEADS", "40")  # capped at the most a pass holds
    capfd.readouterr()
    run_case(case)
    assert call_reports(capfd.readouterr().err)[0]["streamed_heads"] == 16


def test_quantized_calls_keep_the_first_level_whatever_the_switch(monkeypatch, capfd, measured_choices):
    """Quantized rows are asked for into the first-level cache (measured mixed with the second), even where the
    switch names the second."""
    monkeypatch.setenv("KVCACHE_OP_CPU_VERBOSE", "1")
    monkeypatch.setenv("KVCACHE_OP_HEAD_PREFETCH", "l2")
    for quant_bit in (8, 4):
        capfd.readouterr()
        run_case(small_case(quant_bit, 3))
        assert call_reports(capfd.readouterr().err)[0]["head_prefetch"] == "l1"


def test_multi_head_cache_attentions_stores_report_no_outputs_and_plain_code_stores(monkeypatch, capfd,
                                                                                    measured_choices):
    """MultiHeadCacheAttention runs KeyValueCache's stores alone and reads the cache in place: its call reports no
    outputs, and its codes are stored plainly (attention reads them back at once), whatever the code-store switch."""
    from kvcache_op.validation.mhca_cases import CASES

    monkeypatch.setenv("KVCACHE_OP_CPU_VERBOSE", "1")
    monkeypatch.setenv("KVCACHE_OP_CODE_STORES", "stream")
    case = CASES["mhca_paged_int8_layout3"]()
    capfd.readouterr()
    c_api.multi_head_cache_attention(**copies(case.inputs), **case.attributes)
    [plan] = call_reports(capfd.readouterr().err)
    assert (plan["outputs"], plan["code_stores"], plan["quant_bit"], plan["layout"]) == (0, "cached", 8, 3), plan


def test_a_large_stores_only_call_streams_nothing_where_the_same_keyvaluecache_call_does(monkeypatch, capfd,
                                                                                        measured_choices):
    """Outputs of over 16 MiB are streamed; MultiHeadCacheAttention's stores of the same size write no outputs, so
    its report says nothing streams, side by side or not."""
    from kvcache_op.validation.mhca_cases import build_cache_attention

    monkeypatch.setenv("KVCACHE_OP_CPU_VERBOSE", "1")
    monkeypatch.setenv("KVCACHE_OP_STORES", "side-by-side")
    seqs, cache = [Seq(20000, 1)], dict(heads=4, head_dim=128, cache_mode=1, page_size=64, t1="float16", t3="float16")
    kv = build("report-large", seqs, **cache)
    capfd.readouterr()
    run_case(kv)
    [plan] = call_reports(capfd.readouterr().err)
    assert plan["out_bytes"] > 16 << 20 and (plan["outputs"], plan["stream_outputs"], plan["side_by_side"]) == (1, 1, 1)
    attention = build_cache_attention("report-large", seqs, **cache)
    c_api.multi_head_cache_attention(**copies(attention.inputs), **attention.attributes)
    [plan] = call_reports(capfd.readouterr().err)
    assert plan["out_bytes"] > 16 << 20 and (plan["outputs"], plan["stream_outputs"], plan["side_by_side"]) == (0, 0, 0)
