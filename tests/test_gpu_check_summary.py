"""tools/gpu_check.sh's summary: counts from the junit reports, every step's verdict and reason."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_summary_lists_counts_verdicts_and_skip_reasons(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "device.txt").write_text("NVIDIA H100 80GB HBM3\n")
    (tmp_path / "steps.tsv").write_text("host-runner\tpass\t3 passed\nsanitizer-memcheck\tfail\texit 86\n"
                                        "benchmark\tskip\tno CUDA device is visible\n")
    (tmp_path / "logs" / "host-runner.xml").write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1"/></testsuites>')
    out = subprocess.run([sys.executable, str(ROOT / "tools/gpu_check_summary.py"), str(tmp_path)], check=True,
                         capture_output=True, text=True).stdout
    summary = (tmp_path / "summary.md").read_text()
    assert out.strip() == summary.strip()
    assert "Device: NVIDIA H100 80GB HBM3" in summary
    assert "| host-runner | pass | 3 passed, 1 failed, 1 skipped | 3 passed |" in summary
    assert "| sanitizer-memcheck | fail |  | exit 86 |" in summary
    assert "| benchmark | skip |  | no CUDA device is visible |" in summary


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
