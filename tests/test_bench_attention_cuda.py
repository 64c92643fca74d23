"""The attention CUDA benchmark (python -m kvcache_op.benchmarks.gpu.attention): without a GPU it refuses in one
line, its --help and arguments, its cases and the bytes it counts; on a GPU (marker gpu) its smoke run prints and
writes a table of sane figures."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import types

import pytest

from kvcache_op.benchmarks.gpu import attention

TIMES = ("op_ms", "copy_ms", "sdpa_ms", "read_GBps", "copy_GBps", "vs_copy", "vs_sdpa")


def test_help_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "kvcache_op.benchmarks.gpu.attention", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--quick" in done.stdout and "--out" in done.stdout and "scaled_dot_product_attention" in done.stdout


def test_without_a_gpu_it_says_so_in_one_line(monkeypatch, capsys):
    fake = types.SimpleNamespace(__version__="0.0-fake", cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert attention.main(["--quick"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err
    assert lines[0].startswith("attention CUDA benchmark: cannot run: ") and "sees no CUDA GPU" in lines[0]


def test_arguments():
    args = attention.build_parser().parse_args(["--quick", "--out", "d", "--repeats", "5"])
    assert (args.quick, str(args.out), args.repeats, args.warmup) == (True, "d", 5, 3)
    with pytest.raises(SystemExit):
        attention.build_parser().parse_args(["--repeats", "0"])


def test_cases_and_the_bytes_they_read():
    full = attention.cases(quick=False)
    shapes = {(c.op, c.phase, c.batch, c.seqlen, c.kvlen, c.heads, c.kv_heads, c.head_dim, c.quant_bit, c.layout)
              for c in full}
    assert shapes == {("mhca", "decode", 64, 1, 1024, 8, 2, 128, 0, 0), ("mhca", "decode", 64, 1, 1024, 8, 2, 128, 0, 3),
                      *{("mhca", "decode", 32, 1, 2048, 32, 8, 128, q, layout) for q in (0, 8) for layout in (0, 3)},
                      ("mha", "decode", 64, 1, 1024, 8, 2, 128, 0, 0), ("mha", "prefill", 8, 1024, 1024, 32, 8, 128, 0, 0),
                      *{("mhca", "prefill", 8, 1024, 1024, 32, 8, 128, q, 0) for q in (0, 8)}}
    assert all(c.dtype == "float16" and c.page_size == 16 for c in full if c.dtype != "bfloat16")
    assert [c.label() for c in full if c.dtype == "bfloat16"] == [
        "mha prefill B=8 S=1024 H=32/8 Dh=128 bfloat16 packed"]
    # every route beside the default on a shape the default runs too
    assert {c.kernel for c in full} == set(attention.KERNELS)
    defaults = {dataclasses.replace(c, kernel="") for c in full if c.kernel}
    assert defaults <= set(full)
    assert full[0].bytes_read() == 64 * 1024 * 2 * 128 * 2 * 2  # K and V, float16
    int8 = next(c for c in full if c.quant_bit == 8)
    assert int8.bytes_read() == 32 * 2048 * 8 * 128 * 2 + 32 * 2048 * 8 * 16 * 2 * 2  # codes + float16 scales
    assert len(attention.cases(quick=True)) >= 4


def test_a_route_sets_its_variable_and_restores_the_environment(monkeypatch):
    monkeypatch.setenv("KVCACHE_OP_CUDA_MMA", "0")
    monkeypatch.delenv("KVCACHE_OP_CUDA_DECODE_KERNEL", raising=False)
    with attention.kernel_route("decode"):
        assert os.environ["KVCACHE_OP_CUDA_DECODE_KERNEL"] == "1"
        assert "KVCACHE_OP_CUDA_MMA" not in os.environ  # every other route variable unset inside
    assert os.environ["KVCACHE_OP_CUDA_MMA"] == "0" and "KVCACHE_OP_CUDA_DECODE_KERNEL" not in os.environ
    with attention.kernel_route("tile"):
        assert os.environ["KVCACHE_OP_CUDA_MMA"] == "0"


@pytest.mark.gpu
def test_quick_run_prints_and_writes_its_table(tmp_path, capsys):
    import torch

    assert attention.main(["--quick", "--repeats", "3", "--warmup", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    device = torch.cuda.get_device_name()
    assert device in out.splitlines()[0]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == len(attention.cases(quick=True))
    for row in rows:
        for key in TIMES:
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        if row["op"] == "mha":  # the same inputs as SDPA: float16 outputs close to each other
            assert row["max_abs_diff_vs_sdpa"] < 0.05, row
    md = (tmp_path / "results.md").read_text()
    assert device in md and "--quick" in md
    # two tables, a row per case in each: the figures, and where a call's time goes
    table = [line for line in md.splitlines() if line.startswith(("| mhca", "| mha"))]
    assert len(table) == 2 * len(rows)
    assert sum(line.startswith(("| mhca", "| mha")) for line in out.splitlines()) == 2 * len(rows)  # printed last
    for row in rows:
        assert row["host_ms"] > 0 and row["device_breakdown"], row


def test_the_profiling_driver_lists_the_cases_and_refuses_without_a_gpu(monkeypatch, capsys):
    """python -m kvcache_op.benchmarks.gpu.attention_profile (run under Nsight Compute by gpu_check.sh): --list
    names the benchmark's cases by index; an index past them, or a machine without a GPU, is one line and 2."""
    from kvcache_op.benchmarks.gpu import attention_profile

    assert attention_profile.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed == [f"{i}: {c.label()}" for i, c in enumerate(attention.cases(quick=False))]
    assert attention_profile.main(["--case", str(len(listed))]) == 2
    assert "--case must be below" in capsys.readouterr().err
    fake = types.SimpleNamespace(__version__="0.0-fake", cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert attention_profile.main(["--case", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attention profile: cannot run: ")


def test_kernel_names_tell_the_staged_kernels_two_forms_apart():
    staged = ("void kvcache::cuda::(anonymous namespace)::StagedDecodeKernel<__half, "
              "kvcache::cuda::(anonymous namespace)::QuantRows<8, true>, {}>(kvcache::cuda::AttnParams)")
    assert attention.short_name(staged.format("true")) == "StagedDecodeKernel, heads in registers"
    assert attention.short_name(staged.format("false")) == "StagedDecodeKernel"
    assert attention.short_name("void kvcache::cuda::TileKernel<__nv_bfloat16, kvcache::cuda::PackedRows>("
                                "kvcache::cuda::AttnParams)") == "TileKernel"
    assert attention.short_name("Memcpy HtoD (Pageable -> Device)") == "Memcpy HtoD (Pageable -> Device)"


def test_a_route_is_checked_against_the_kernels_that_ran():
    routed = dataclasses.replace(attention.cases(quick=True)[0], kernel="staged")
    assert attention.route_check(routed, {"StagedDecodeKernel": 0.08, "Memcpy HtoD": 0.01}) == {
        "ran": ["StagedDecodeKernel"], "route_ok": True}
    assert attention.route_check(routed, {"TileKernel": 0.09, "MergeKernel": 0.01}) == {
        "ran": ["TileKernel"], "route_ok": False}
    assert attention.route_check(routed, {"error": "the profiler cannot run"})["route_ok"] is None
    assert attention.route_check(routed, {})["route_ok"] is None  # it saw no device activity at all
    # the profiler ran and saw no attention kernel it knows (a kernel renamed, say): not the route's either
    assert attention.route_check(routed, {"Memcpy HtoD": 0.01}) == {"ran": [], "route_ok": False}
    default = attention.cases(quick=True)[0]
    assert attention.route_check(default, {"TileKernel": 0.09})["route_ok"] is None  # the library's choice


def _row(case, **changes):
    row = {"label": case.label(), "op": case.op, "bytes_read": case.bytes_read(), "op_ms": 0.2, "copy_ms": 0.1,
           "sdpa_ms": 0.05, "read_GBps": 1.0, "copy_GBps": 2.0, "vs_copy": 0.5, "copy_bandwidth_fraction": 0.25,
           "vs_sdpa": 0.25, "sdpa_backend": "default", "copy_target": 0.7, "sdpa_target": None,
           "max_abs_diff_vs_sdpa": None, "host_ms": 0.1, "device_breakdown": {"TileKernel": 0.09},
           "ran": ["TileKernel"], "route_ok": None}
    return {**row, **changes}


def _stand_in_torch(monkeypatch, context_lost: bool):
    """A torch module with what the benchmark's loop calls; ``context_lost``: its synchronize fails, as after an
    illegal address."""
    import contextlib

    def synchronize():
        if context_lost:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    fake_cuda = types.SimpleNamespace(get_device_name=lambda: "Stand-in GPU", Stream=lambda: None,
                                      stream=lambda _: contextlib.nullcontext(), empty_cache=lambda: None,
                                      synchronize=synchronize)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(__version__="0.0-fake", cuda=fake_cuda))
    monkeypatch.setattr(attention, "missing_requirements", lambda: [])


def test_a_failed_case_and_a_case_off_its_route_keep_their_rows_and_fail_the_run(monkeypatch, tmp_path, capsys):
    """One case raising (a route never run on this GPU) is its row's error, the cases after it are measured, the
    tables are written after every case, and the run exits 1; so does a row whose kernel was not its route's."""
    quick = attention.cases(quick=True)
    _stand_in_torch(monkeypatch, context_lost=False)
    written = []

    def measure(case, warmup, repeats):
        written.append(len(json.loads((tmp_path / "results.json").read_text())["rows"])
                       if (tmp_path / "results.json").exists() else 0)
        if case == quick[1]:
            raise RuntimeError("CUDA error: an | unknown error\nmore")
        return _row(case, route_ok=False, ran=["TileKernel"]) if case == quick[2] else _row(case)

    monkeypatch.setattr(attention, "measure", measure)
    assert attention.main(["--quick", "--out", str(tmp_path)]) == 1
    assert written == list(range(len(quick)))  # the tables rewritten after every case
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == len(quick)
    assert rows[1]["error"] == "RuntimeError: CUDA error: an | unknown error"
    md = (tmp_path / "results.md").read_text()
    assert f"| {quick[1].label()} | failed: RuntimeError: CUDA error: an \\| unknown error |" in md
    assert f"| {quick[2].label()} (but ran TileKernel) |" in md
    assert "2 case(s) failed or ran another kernel" in capsys.readouterr().err


def test_after_a_case_loses_the_cuda_context_the_rest_are_listed_as_not_run(monkeypatch, tmp_path):
    """An illegal address is sticky: every later call in the process fails with it, so the later cases are not run
    (and not each blamed for it)."""
    quick = attention.cases(quick=True)
    _stand_in_torch(monkeypatch, context_lost=True)
    measured = []

    def measure(case, warmup, repeats):
        measured.append(case)
        if case == quick[1]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return _row(case)

    monkeypatch.setattr(attention, "measure", measure)
    assert attention.main(["--quick", "--out", str(tmp_path)]) == 1
    assert measured == quick[:2]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r.get("error") for r in rows[2:]] == [f"not run: the CUDA context was lost in {quick[1].label()}"] * (
        len(quick) - 2)
