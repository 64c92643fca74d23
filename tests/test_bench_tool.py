"""The benchmark tool runs end to end (tiny shapes) and writes its table, data and chart."""

import json
import pathlib
import platform
import re
import subprocess
import sys

import numpy as np
import pytest

from kvcache_op.benchmarks import kv_shapes
from kvcache_op.benchmarks.cpu import bench as cpu_bench
from cpu_kernels import cpu_flags
from native_build import compiler

ROOT = pathlib.Path(__file__).resolve().parents[1]
BOUND = ROOT / "benchmarks" / "cpu" / "bound"


def build_bound_tool(source: str, binary: pathlib.Path, *flags: str) -> pathlib.Path:
    """benchmarks/cpu/bound/`source` built to `binary` with the host C++ compiler the test libraries are built with
    ($CXX, else c++ or g++) and `flags`; fails the test with the compiler's errors where it does not build."""
    built = subprocess.run([compiler(), *flags, str(BOUND / source), "-o", str(binary)], capture_output=True,
                           text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    return binary


def test_bench_quick_run_writes_results(tmp_path, capsys):
    assert cpu_bench.main(["--quick", "--repeats", "1", "--warmup", "0", "--rounds", "2",
                           "--reference-repeats", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    # shapes x (paged: 4 layouts, offset: 2) x quant x threads
    assert len(data["rows"]) == len(kv_shapes.QUICK_SHAPES) * (4 + 2) * 2 * 2
    assert {r["shape"] for r in data["rows"]} == {"decode", "prefill", "chunk"}
    assert all(r["op_GBps"] > 0 and r["vs_copy"] > 0 and r["rounds"] == 2 for r in data["rows"])
    assert all(len(r["op_ms_rounds"]) == 2 and r["vs_copy_range"][0] <= r["vs_copy"] <= r["vs_copy_range"][1]
               for r in data["rows"])
    baseline = {("paged", 0), ("paged", 3)} | ({("offset", 0)} if data["tensor_scatter"] else set())
    assert all((r["vs_standard"] is not None) == (r["quant_bit"] == 0 and (r["cache_mode"], r["layout"]) in baseline)
               for r in data["rows"])
    assert all(r["vs_standard"] > 0 for r in data["rows"] if r["vs_standard"] is not None)
    assert all(r["plain_ms"] > 0 and len(r["plain_ms_rounds"]) == 2 for r in data["rows"])
    table = (tmp_path / "results.md").read_text()
    assert "| op / copy (range) | plain run ms | plain / copy |" in table
    assert table.splitlines()[0].endswith("— --quick: a smoke run of tiny shapes, not a measurement")
    assert "op/copy" in capsys.readouterr().out
    assert data["output_offset"] == 0


def test_bench_quick_run_with_outputs_off_their_cache_lines_says_so(tmp_path):
    assert cpu_bench.main(["--quick", "--repeats", "1", "--warmup", "0", "--rounds", "1", "--threads", "1",
                           "--reference-repeats", "1", "--output-offset", "16", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["output_offset"] == 16 and "--output-offset 16" in data["command"]
    assert "start 16 bytes past one" in (tmp_path / "results.md").read_text()


def test_bytes_moved_counts_reads_and_writes():
    shape = kv_shapes.Shape("t", batch=1, seqlen=1, start_pos=0, heads=1, head_dim=8, page_size=4)
    # fp16: store reads 2 x 16 B and writes 2 x 16 B; gather reads 2 x 16 B and writes 2 x 16 B
    assert kv_shapes.bytes_moved(shape, 0) == 128


def test_bytes_moved_parts_by_hand():
    # decode, B=2, kvlen 4 (start_pos 3, seqlen 1), H=2, Dh=16: a row is 32 elements, 4 groups of 8.
    shape = kv_shapes.Shape("t", batch=2, seqlen=1, start_pos=3, heads=2, head_dim=16, page_size=4)
    # quant 0, 2-byte values: store reads 2 tokens x 64 B and writes 2 x 64 B, for K and V: 2*2*(64+64);
    # gather reads 8 kv tokens x 64 B and writes 8 x 64 B, for K and V: 2*8*(64+64).
    assert kv_shapes.bytes_moved_parts(shape, 0) == (512, 2048)
    # quant 8: a cache row is 32 B of codes + 4 scales x 2 B = 40 B; store 2*2*(64+40), gather 2*8*(40+64).
    assert kv_shapes.bytes_moved_parts(shape, 8) == (416, 1664)
    # float32 values and scales: rows of 128 B; a cache row is 32 + 4 x 4 = 48 B.
    assert kv_shapes.bytes_moved_parts(shape, 8, value_bytes=4, scale_bytes=4) == (2 * 2 * (128 + 48),
                                                                                       2 * 8 * (48 + 128))
    assert kv_shapes.bytes_moved(shape, 8) == 416 + 1664


def test_the_standard_ops_baseline_reproduces_the_ops_bits():
    """The baseline copies exactly what the op copies: key, value and the cache it updates in place (cache_out
    bound to the cache's memory: an output of its own made ScatterND copy the whole cache every step) are the
    reference's, so the speed-up compares the same work."""
    import numpy as np

    from kvcache_op.reference import key_value_cache
    from kvcache_op.benchmarks.cpu.standard_ops import baseline_runner

    for shape in kv_shapes.QUICK_SHAPES:
        for layout in (0, 3):
            inputs = kv_shapes.make_inputs(shape, 0, layout, seed=layout)
            attrs = dict(cache_mode=1, cache_layout=layout, page_size=shape.page_size)
            want_cache = inputs["cache"].copy()
            key, value = key_value_cache(**dict(inputs, cache=want_cache), **attrs)
            given = dict(inputs, cache=inputs["cache"].copy())
            run, outputs = baseline_runner(given, shape.page_size, layout, 1)
            assert outputs["cache_out"] is given["cache"]
            run()
            assert outputs["key"].tobytes() == key.tobytes() and outputs["value"].tobytes() == value.tobytes()
            assert given["cache"].tobytes() == want_cache.tobytes()
            assert not np.array_equal(want_cache, inputs["cache"])  # the step stored something


def test_every_contender_is_timed_as_often_as_the_op_in_each_round():
    """No figure gets a second chance the others do not (the faster of two op timings against one copy timing
    favours the op)."""
    import types

    calls = {"op": 0, "copy": 0, "standard": 0, "plain": 0}

    def counting(name):
        def call():
            calls[name] += 1
        return call
    args = types.SimpleNamespace(rounds=3, warmup=1, repeats=4)
    rounds = cpu_bench.measure_rounds(counting("op"), counting("copy"), counting("standard"), args,
                                      plain=counting("plain"))
    assert calls == dict.fromkeys(calls, 3 * (1 + 4))
    assert {name: len(times) for name, times in rounds.items()} == dict.fromkeys(calls, 3)


def test_a_row_is_medians_over_rounds_and_the_medians_of_the_rounds_ratios():
    """Made-up rounds with known answers: ``op / copy`` is copy time over op time (above 1: the op is faster), the
    speed-up standard time over op time, each the median of the rounds' ratios with its range."""
    shape = kv_shapes.QUICK_SHAPES[0]
    rounds = {"op": [0.002, 0.004, 0.002], "copy": [0.001, 0.001, 0.003], "standard": [0.006, 0.004, 0.010],
              "plain": [0.004, 0.004, 0.004]}
    row = cpu_bench.summary(shape, 1, 0, 0, 1, rounds, reference_s=0.02)
    assert row["op_ms"] == 2.0 and row["copy_ms"] == 1.0 and row["standard_ms"] == 6.0
    assert row["vs_copy"] == 0.5 and row["vs_copy_range"] == [0.25, 1.5]  # 0.5, 0.25, 1.5
    assert row["vs_standard"] == 3.0  # 3, 1, 5
    assert row["plain_vs_copy"] == 0.25 and row["vs_reference"] == 10.0
    moved = kv_shapes.bytes_moved(shape, 0)
    assert row["op_GBps"] == moved / 0.002 / 1e9 and row["copy_GBps"] == moved / 0.001 / 1e9


def test_the_copy_moves_the_bytes_the_op_moves():
    """A copy of N bytes reads N and writes N: the copy of half the op's traffic moves as much as the op."""
    shape = kv_shapes.QUICK_SHAPES[0]
    moved = kv_shapes.bytes_moved(shape, 8)
    copy = cpu_bench.copy_runner(moved)
    copy()
    assert 2 * copy.nbytes == moved - moved % 2


def test_the_standard_ops_baselines_gather_each_output_straight_from_the_cache():
    """What a user would run copies no more than it must: each output is one Gather of the updated cache read as
    rows (a Reshape), with no intermediate tensor (picking the layer, the half or the heads first copies rows
    again) and no Transpose; the keys and values are stored by one ScatterND."""
    from kvcache_op.benchmarks.cpu import standard_ops

    shape = kv_shapes.QUICK_SHAPES[0]
    models = [standard_ops.baseline_model(kv_shapes.make_inputs(shape, 0, layout, seed=1), layout) for layout in (0, 3)]
    offset = kv_shapes.make_inputs(shape, 0, 0, seed=1, cache_mode=0)
    models.append(standard_ops.offset_baseline_model(offset, standard_ops.offset_capacity(offset)))
    for model in models:
        nodes = {n.output[0]: n for n in model.graph.node}
        gathers = [n for n in model.graph.node if n.op_type == "Gather"]
        assert sorted(n.output[0] for n in gathers) == ["key", "value"]
        for gather in gathers:
            rows = nodes[gather.input[0]]
            assert rows.op_type == "Reshape" and rows.input[0] == "cache_out", rows
        assert not [n for n in model.graph.node if n.op_type in ("Transpose", "Slice", "Split")]
    for model in models[:2]:  # paged: one ScatterND, its output bound to the cache (baseline_runner)
        assert [n.op_type for n in model.graph.node].count("ScatterND") == 1



def test_the_offset_baseline_updates_the_cache_in_place_with_the_ops_bits():
    """TensorScatter + Gather on an offset call: key, value and the cache it writes in place (its output bound
    to the cache's memory) are the reference's."""
    import numpy as np
    import pytest

    from kvcache_op.reference import key_value_cache
    from kvcache_op.benchmarks.cpu.standard_ops import offset_baseline_runner, tensor_scatter_available

    if not tensor_scatter_available():
        pytest.skip("this onnxruntime has no TensorScatter: the benchmark reports no offset baseline")
    for shape in kv_shapes.QUICK_SHAPES:
        inputs = kv_shapes.make_inputs(shape, 0, 0, seed=1, cache_mode=0)
        want_cache = inputs["cache"].copy()
        key, value = key_value_cache(**dict(inputs, cache=want_cache), cache_mode=0, cache_layout=0)
        given = dict(inputs, cache=inputs["cache"].copy())
        run, outputs = offset_baseline_runner(given, 1)
        run()
        assert outputs["key"].tobytes() == key.tobytes() and outputs["value"].tobytes() == value.tobytes()
        assert given["cache"].tobytes() == want_cache.tobytes()
        assert not np.array_equal(want_cache, inputs["cache"])  # the step stored something


def test_the_offset_baseline_refuses_calls_tensor_scatter_cannot_express():
    import pytest

    from kvcache_op.benchmarks.cpu.standard_ops import offset_capacity

    shape = kv_shapes.QUICK_SHAPES[1]
    inputs = kv_shapes.make_inputs(shape, 0, 0, cache_mode=0)
    assert offset_capacity(inputs) == inputs["cache"].shape[0] // shape.batch
    with pytest.raises(ValueError, match="cachestarts"):
        offset_capacity(dict(inputs, cachestarts=inputs["cachestarts"][::-1].copy()))
    with pytest.raises(ValueError, match="one-layer layout-0"):
        offset_capacity(dict(inputs, cache=inputs["cache"].reshape(inputs["cache"].shape[0], 2, 1, *inputs["cache"].shape[3:])))


def test_benchmark_arrays_start_on_cache_lines_like_onnx_runtimes():
    from kvcache_op.benchmarks.bound_session import ALIGNMENT, aligned_copy, aligned_empty

    for shape, dtype in (((3, 5, 7), np.float16), ((1 << 20,), np.uint8), ((9, 4), np.int64)):
        array = aligned_empty(shape, dtype)
        assert array.shape == shape and array.dtype == dtype and array.flags.c_contiguous
        assert array.ctypes.data % ALIGNMENT == 0
    for offset in (2, 16, 48):  # outputs placed as numpy's large arrays start, for the benchmark's --output-offset
        array = aligned_empty((3, 5), np.float16, offset)
        assert array.ctypes.data % ALIGNMENT == offset and array.shape == (3, 5) and array.flags.c_contiguous
    for offset, dtype in ((1, np.float16), (64, np.uint8), (-16, np.uint8)):
        with pytest.raises(ValueError, match="offset"):
            aligned_empty((4,), dtype, offset)
    source = np.arange(35, dtype=np.float32).reshape(5, 7)[:, ::2]  # not contiguous
    copy = aligned_copy(source)
    assert copy.ctypes.data % ALIGNMENT == 0 and np.array_equal(copy, source)
    inputs = kv_shapes.make_inputs(kv_shapes.Shape("t", 2, 1, 7, heads=2, head_dim=16, page_size=4), 8, 3)
    assert all(inputs[name].ctypes.data % ALIGNMENT == 0 for name in ("current_key", "current_value", "cache", "scale"))


def test_the_profiling_script_runs_a_benchmark_case():
    """benchmarks/cpu/bound/profile_case.py (run under a sampling profiler) still builds and runs the
    benchmark's cases through the tool's own functions, outputs off their lines included."""
    script = BOUND / "profile_case.py"
    done = subprocess.run([sys.executable, str(script), "--shape", "prefill", "--layout", "3", "--output-offset", "16",
                           "--calls", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "prefill cache_mode=1 quant_bit=8 layout=3 output_offset=16:" in done.stdout
    assert "ms per call (1 calls)" in done.stdout


def test_the_quantization_cost_tool_builds_and_times_the_streamed_dequantizer(tmp_path):
    """benchmarks/cpu/bound/quantize_cost.cc still builds with the commands its header gives (the generic build,
    and the AVX2 and AVX-512 builds where this CPU has them) and prints every figure: the quantizer's, the
    dequantizer's, and the streamed dequantizer's on a line and, where the build streams there, 16 bytes past one
    (rows chained as the gathers chain them, and with their part lines held)."""
    flags = cpu_flags()
    builds = {"generic": []}
    if {"avx2", "f16c", "fma"} <= flags:
        builds["avx2"] = ["-mavx2", "-mf16c", "-mfma"]
    if {"avx512f", "avx512bw", "avx512vl", "avx2", "f16c", "fma"} <= flags:
        builds["avx512"] = ["-mavx2", "-mf16c", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl"]
    figure = r"\d+\.\d+"
    for isa, extra in builds.items():
        binary = build_bound_tool("quantize_cost.cc", tmp_path / f"quantize_cost_{isa}", "-O3", "-std=gnu++17",
                                  "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math",
                                  f"-I{ROOT / 'cpu'}", f"-DKV_CPU_ISA={isa}", *extra)
        done = subprocess.run([str(binary), "128"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert re.search(rf"^  quantizer {figure} ns per element", done.stdout, re.M), done.stdout
        assert re.search(rf"^  dequantizer {figure} ns per element", done.stdout, re.M), done.stdout
        streamed = (rf"^  dequantizer streamed \(output rows of 512 elements, 2 passes a token; 15 rounds\): {figure} "
                    r"ns per element on a line")
        if platform.machine() not in ("x86_64", "AMD64"):  # the generic build streams rows on x86-64 only
            streamed = r"^  dequantizer streamed: not at this row length in this build"
        elif isa == "avx512":
            streamed += rf", {figure} 16 bytes past one \({figure}x\), {figure} with part lines held \({figure}x\)"
        else:
            streamed += "; 16 bytes past one this build streams through a scratch row instead"
        assert re.search(streamed, done.stdout, re.M), done.stdout
        bad = subprocess.run([str(binary), "12"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "usage" in bad.stderr


def test_the_token_runs_tool_builds_and_times_the_kernels_writer_on_and_off_lines(tmp_path):
    """benchmarks/cpu/bound/token_runs.cc builds with the command its header gives (x86-64, the kernel's own
    cpu/kv_row_streams.h included) and, where the CPU has AVX-512, prints a time and a ratio to memcpy for each
    order and for the kernel's writer of runs side by side on lines and 16 bytes past one; a round count below 1
    is refused with its usage."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the tool is written with x86-64 intrinsics")
    binary = build_bound_tool("token_runs.cc", tmp_path / "token_runs", "-O2", "-mavx2", "-mf16c", "-mfma", "-mavx512f",
                              "-mavx512bw", "-mavx512vl", "-DKV_CPU_ISA=avx512", f"-I{ROOT}", "-std=c++17")
    if not {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags():
        pytest.skip("built; this CPU has no AVX-512 to run it")
    bad = subprocess.run([str(binary), "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr
    done = subprocess.run([str(binary), "1"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = re.findall(r"^  (.+?) +(\d+\.\d+) ms  (\d+\.\d+)x$", done.stdout, re.M)
    orders = ["one row after another", "4 runs, token-major", "8 runs, token-major", "16 runs, token-major",
              "8 runs, keys then values"]
    kernel = [f"kernel, {heads} heads, {where}" for heads in (8, 32) for where in ("on lines", "16 B past")]
    assert [name for name, _, _ in rows] == orders * 2 + kernel, done.stdout
    assert all(float(ms) > 0 and float(ratio) > 0 for _, ms, ratio in rows), done.stdout


def test_the_scale_rows_tool_builds_and_times_every_store_pattern(tmp_path):
    """benchmarks/cpu/bound/scale_rows.cc builds with the command its header gives (x86-64) and, where the CPU has
    AVX2, prints a time and a ratio to layout 0 for each of its five ways of storing an int8 prefill's scale rows;
    a round count below 1 is refused with its usage."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the tool is written with x86-64 intrinsics")
    binary = build_bound_tool("scale_rows.cc", tmp_path / "scale_rows", "-O2", "-mavx2")
    if "avx2" not in cpu_flags():
        pytest.skip("built; this CPU has no AVX2 to run it")
    done = subprocess.run([str(binary), "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = re.findall(r"^  (.+?) +(\d+\.\d+) ms \((\d+\.\d+)x layout 0\)$", done.stdout, re.M)
    assert [name for name, _, _ in rows] == [
        "layout 0 (a token's rows together), ordinary scale stores", "layout 3, scale rows with ordinary stores",
        "layout 3, no scale rows written", "layout 3, a page's scale rows copied a head at a time",
        "layout 3, scale lines held, streamed whole"], done.stdout
    assert all(float(ms) > 0 for _, ms, _ in rows) and rows[0][2] == "1.00", done.stdout
    bad = subprocess.run([str(binary), "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr
