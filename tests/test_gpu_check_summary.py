"""tools/gpu_check.sh's summary: counts from the junit reports, every step's verdict and reason."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_summary_lists_counts_verdicts_and_skip_reasons(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "device.txt").write_text("NVIDIA H100 80GB HBM3\n")
    (tmp_path / "steps.tsv").write_text("host-runner\tpass\t3 passed\t41\nsanitizer-memcheck\tfail\texit 86\t7\n"
                                        "benchmark\tskip\tno CUDA device is visible\t\n")
    (tmp_path / "seconds.txt").write_text("63\n")
    (tmp_path / "logs" / "host-runner.xml").write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1"/></testsuites>')
    out = subprocess.run([sys.executable, str(ROOT / "tools/gpu_check_summary.py"), str(tmp_path)], check=True,
                         capture_output=True, text=True).stdout
    summary = (tmp_path / "summary.md").read_text()
    assert out.strip() == summary.strip()
    assert "Device: NVIDIA H100 80GB HBM3" in summary
    assert "| host-runner | pass | 3 passed, 1 failed, 1 skipped | 3 passed | 41 |" in summary
    assert "| sanitizer-memcheck | fail |  | exit 86 | 7 |" in summary
    assert "| benchmark | skip |  | no CUDA device is visible |  |" in summary
    assert "The check took 63 s from its start to this summary." in summary


def test_summary_gives_each_sanitizer_steps_own_verdict_lines(tmp_path):
    """The tool's summary lines from each sanitizer step's log (the step's verdict is pytest's; these say what the tool
    itself saw), and "none" where it printed none: it never attached."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "steps.tsv").write_text("sanitizer-memcheck\tpass\t3 passed\t9\n")
    (tmp_path / "logs/sanitizer-memcheck.log").write_text(
        "3 passed in 8.0s\n========= ERROR SUMMARY: 0 errors\n========= ERROR SUMMARY: 0 errors\n")
    (tmp_path / "logs/sanitizer-attention-racecheck.log").write_text(
        "========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)\n")
    (tmp_path / "logs/sanitizer-initcheck.log").write_text("3 passed in 8.0s\n")
    subprocess.run([sys.executable, str(ROOT / "tools/gpu_check_summary.py"), str(tmp_path)], check=True,
                   capture_output=True)
    summary = (tmp_path / "summary.md").read_text()
    assert "| sanitizer-memcheck | ERROR SUMMARY: 0 errors (x2) |" in summary
    assert ("| sanitizer-attention-racecheck | RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings) |"
            in summary)
    assert "| sanitizer-initcheck | none |" in summary


def test_gpu_check_needs_an_output_folder():
    done = subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh")], capture_output=True, text=True)
    assert done.returncode != 0 and "usage: tools/gpu_check.sh OUTDIR" in done.stderr


def _which_steps_run(tmp_path, **env) -> dict:
    """gpu_check.sh's own step() and skipped() functions, run on a few step names under ``env``."""
    script = (ROOT / "tools/gpu_check.sh").read_text()
    functions = script[script.index("step() {"):script.index("# Runs pytest")]
    probe = functions + 'for s in host-runner gpu-tests attention-benchmark; do skipped "$s" || echo "$s runs"; done'
    steps = tmp_path / "steps.tsv"
    steps.write_text("")
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True,
                          env={"PATH": "/usr/bin:/bin", "STEPS": str(steps), "START": "0", **env})
    runs = {line.split()[0] for line in done.stdout.splitlines() if line.endswith(" runs")}
    skipped = {line.split("\t")[0]: line.split("\t")[2] for line in steps.read_text().splitlines()}
    return {"runs": runs, "skipped": skipped}


def test_gpu_check_skip_and_only_choose_the_steps(tmp_path):
    assert _which_steps_run(tmp_path)["runs"] == {"host-runner", "gpu-tests", "attention-benchmark"}
    chosen = _which_steps_run(tmp_path, GPU_CHECK_ONLY="gpu-tests attention-benchmark",
                              GPU_CHECK_SKIP="attention-benchmark")
    assert chosen["runs"] == {"gpu-tests"}
    assert chosen["skipped"] == {"host-runner": "not named in GPU_CHECK_ONLY",
                                 "attention-benchmark": "named in GPU_CHECK_SKIP"}


def _workers(tmp_path, *modes, fake_xdist=False, **env) -> list:
    """The pytest-xdist arguments gpu_check.sh's ``xdist_args MODE`` gives the test steps, one line per mode
    (``fake_xdist``: with an importable stand-in for pytest-xdist), or its exit status and error."""
    if fake_xdist:
        (tmp_path / "fake" / "xdist").mkdir(parents=True, exist_ok=True)
        (tmp_path / "fake" / "xdist" / "__init__.py").write_text("")
        env["PYTHONPATH"] = str(tmp_path / "fake")
    script = (ROOT / "tools/gpu_check.sh").read_text()
    setup = script[script.index("PREFIX=()"):script.index("# Runs a benchmark")]
    probe = setup + "".join(f'echo "$(xdist_args {mode})"\n' for mode in modes)
    done = subprocess.run(["bash", "-c", f"PY={sys.executable}\n" + probe], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", **env})
    return done.stdout.splitlines() if done.returncode == 0 else [f"exit {done.returncode}: {done.stderr.strip()}"]


def test_gpu_check_runs_test_steps_in_the_workers_asked_for(tmp_path):
    assert _workers(tmp_path, "load", "loadfile", GPU_CHECK_WORKERS="3", fake_xdist=True) == [
        "-n 3 --dist load", "-n 3 --dist loadfile"]
    assert _workers(tmp_path, "load", GPU_CHECK_WORKERS="1") == [""]
    # by default: four workers on a machine of 8 cores or more that has pytest-xdist, else one process
    import importlib.util
    import os

    xdist = importlib.util.find_spec("xdist") is not None
    many = xdist and len(os.sched_getaffinity(0)) >= 8
    assert _workers(tmp_path, "load") == ["-n 4 --dist load" if many else ""]
    # a value that is no count of processes, or workers without pytest-xdist: a clear error, not one process
    assert _workers(tmp_path, "load", GPU_CHECK_WORKERS="four") == [
        "exit 2: GPU_CHECK_WORKERS=four: a number of processes (1 or more) was expected"]
    if not xdist:
        assert _workers(tmp_path, "load", GPU_CHECK_WORKERS="2") == [
            f"exit 2: GPU_CHECK_WORKERS=2 needs pytest-xdist, which {sys.executable} cannot import (or set "
            "GPU_CHECK_WORKERS=1)"]
