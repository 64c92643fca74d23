"""The command line: demo and conformance jobs (the kit's validate and fuzz: test_conformance_kit.py, test_fuzz_kit.py)."""

import subprocess
import sys

from kvcache_op.cli import main
from kvcache_op.slots_demo import run_slots_demo


def test_demo_runs_and_every_step_checks_out(capsys):
    assert run_slots_demo(backend="reference", steps=8) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and out.count(" ok") >= 20
    assert "req 1 finished" in out


def test_conformance_command_writes_cases(tmp_path, capsys):
    assert main(["conformance", "--out", str(tmp_path), "--case", "paged_layout0", "--case", "int4_layout1"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test_int4_layout1", "test_paged_layout0"]
    assert main(["validate", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split() == ["total", "2", "0", "0"]


def test_python_dash_m_entry_point():
    result = subprocess.run([sys.executable, "-m", "kvcache_op", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "demo" in result.stdout


def test_bench_subcommand_dispatches(tmp_path, capsys):
    assert main(["bench", "op", "--quick", "--repeats", "1", "--warmup", "0", "--reference-repeats", "1",
                 "--threads", "1"]) == 0
    assert "op/copy" in capsys.readouterr().out


def test_an_interrupted_command_says_so_in_one_line(monkeypatch, capsys):
    from kvcache_op import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_conformance", interrupted)
    assert main(["conformance", "--list"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "kvcache-op conformance: interrupted\n"


def test_slots_demo_on_ort_without_the_library_is_one_line(monkeypatch, capsys):
    from kvcache_op import ort_ops

    monkeypatch.setattr(ort_ops, "library_available", lambda: False)
    assert main(["slots-demo", "--backend", "ort"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcache-op slots-demo: error: --backend ort: the custom-op library is not built")
    assert err.count("\n") == 1


def test_bench_op_refuses_a_device_it_does_not_have(capsys):
    for argv, message in ((["bench", "op", "--device", "gpu"], "--device must be cpu or cuda, got 'gpu'"),
                          (["bench", "op", "--device=tpu"], "--device must be cpu or cuda, got 'tpu'"),
                          (["bench", "op", "--device"], "--device needs a value: cpu or cuda")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == f"kvcache-op bench op: error: {message}\n", err
