"""The CUDA benchmark's parts that need no GPU: its refusal without one, its arguments, its cases and the
bytes it counts."""

import sys
import types

import pytest

from kvcache_op.benchmarks import kv_shapes
from kvcache_op.benchmarks.cpu import bench as cpu_bench
from kvcache_op.benchmarks.gpu import bench as bench_kvcache_cuda
from kvcache_op.cli import main as cli_main


def bench_op(argv) -> int:
    """``kvcache-op bench op ARGV``: the CPU benchmark, or the CUDA one with ``--device cuda``."""
    return cli_main(["bench", "op", *argv])


def _refusal(capsys, argv, main=bench_op) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing measured, nothing printed as if it had been
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err
    assert lines[0].startswith("CUDA benchmark: cannot run: ")
    return lines[0]


def test_without_torch_it_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    assert "torch is not installed" in _refusal(capsys, ["--device", "cuda", "--quick"])


def test_without_a_gpu_it_says_so(monkeypatch, capsys):
    fake = types.SimpleNamespace(__version__="0.0-fake", cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fake)
    line = _refusal(capsys, ["--device", "cuda"])
    assert "torch 0.0-fake sees no CUDA GPU" in line and "not installed" not in line


def test_without_cuda_kernels_it_says_so(monkeypatch, capsys):
    from kvcache_op.capi import c_api

    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(c_api, "has_cuda", lambda path=None: False)
    line = _refusal(capsys, [], main=bench_kvcache_cuda.main)
    assert "built without its CUDA kernels" in line and "torch is not installed" in line


def test_without_the_library_it_says_so(monkeypatch, capsys):
    import kvcache_op.ort_ops as ort_ops

    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(ort_ops, "library_available", lambda: False)
    assert "library is not built" in _refusal(capsys, ["--device", "cuda"])


def test_arguments():
    args = bench_kvcache_cuda.build_parser().parse_args(["--quick", "--out", "d", "--repeats", "5"])
    assert (args.quick, str(args.out), args.repeats, args.warmup) == (True, "d", 5, 3)
    defaults = bench_kvcache_cuda.build_parser().parse_args([])
    assert (defaults.repeats, defaults.quick, defaults.out) == (20, False, None)
    with pytest.raises(SystemExit):
        bench_kvcache_cuda.build_parser().parse_args(["--threads", "2"])  # a CPU-only option
    with pytest.raises(SystemExit):
        cpu_bench.main(["--device", "cuda"])  # the CPU benchmark measures the CPU only
    assert bench_op(["--device", "tpu"]) == 2  # one line, said by the command (tests/test_cli.py)


def test_cuda_help_is_the_cuda_tools(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_op(["--device", "cuda", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "CUDA benchmark" in text and "--threads" not in text


def test_bad_repeat_counts_are_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_op(["--device", "cuda", "--repeats", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--repeats: must be >= 1, got 0" in err[0]


def test_cases_cover_the_asked_shapes():
    full = bench_kvcache_cuda.cases(quick=False)
    decode = {(c.dtype, c.quant_bit, c.layout, c.shape.page_size) for c in full if c.shape.name == "decode"}
    assert decode == {(t, q, layout, page) for t in ("float16", "bfloat16") for q in (0, 8) for layout in (0, 3)
                      for page in (16, 128)}
    assert all((c.shape.batch, c.shape.start_pos + c.shape.seqlen, c.shape.heads, c.shape.head_dim)
               == (256, 2048, 8, 128) for c in full if c.shape.name == "decode")
    prefill = [c for c in full if c.shape.name == "prefill"]
    assert {(c.dtype, c.quant_bit, c.layout, c.shape.page_size) for c in prefill} == {
        ("float16", 0, 0, 128), ("float16", 8, 0, 128)}
    assert all((c.shape.batch, c.shape.seqlen, c.shape.start_pos) == (8, 2048, 0) for c in prefill)
    assert len(full) == 18
    quick = bench_kvcache_cuda.cases(quick=True)
    assert len(quick) == 10 and max(c.shape.batch * c.shape.heads * c.shape.head_dim for c in quick) <= 256


def test_case_bytes_by_hand():
    # decode, B=2, kvlen 4 (start_pos 3, seqlen 1), H=2, Dh=16, bfloat16 (2 bytes), quant 8, float16 scales:
    # a row is 32 elements (64 B); a cache row 32 B of codes + 4 scales x 2 B = 40 B.
    shape = kv_shapes.Shape("t", batch=2, seqlen=1, start_pos=3, heads=2, head_dim=16, page_size=4)
    case = bench_kvcache_cuda.Case(shape, "bfloat16", 8, 3)
    # store: K and V, 2 new tokens, 64 B read + 40 B written; gather: K and V, 8 tokens, 40 B read + 64 B written
    assert bench_kvcache_cuda.case_bytes(case) == (2 * 2 * (64 + 40), 2 * 8 * (40 + 64))
    assert sum(bench_kvcache_cuda.case_bytes(case)) == kv_shapes.bytes_moved(shape, 8)  # the CPU tool's count


def test_decode_case_bytes():
    decode = next(c for c in bench_kvcache_cuda.cases(quick=False) if c.shape.name == "decode" and c.quant_bit == 0)
    row = 8 * 128 * 2  # bytes of one token's heads, float16
    assert bench_kvcache_cuda.case_bytes(decode) == (2 * 256 * 2 * row, 2 * 256 * 2048 * 2 * row)
