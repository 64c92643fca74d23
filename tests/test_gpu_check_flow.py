"""tools/gpu_check.sh's control flow, walked on this machine with a stand-in python (no GPU needed): a deadline that
cuts every step's limit and skips what no longer fits (the summary still written), a test step in which no test ran
counted as failed, a GPU probe that fails counted as failed (not as "no GPU"), unknown step names refused, and the
float16 serving benchmark and the sampler's in the summary, and the ONNX Runtime headers taken from their packed form."""

import io
import pathlib
import shutil
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The stand-in: answers the script's probes, "builds" by making the target folder, runs a "test step" as
# SIM_PYTEST_<step> says (sleep seconds and the summary line) and a benchmark by writing its table.
FAKE_PYTHON = r"""#!/usr/bin/env bash
case "$1" in
  -c)
    case "$2" in
      *sched_getaffinity*) echo 16 ;;
      *_gpu_unavailable_reason*) [ -n "${SIM_PROBE_FAILS:-}" ] && { echo "ImportError: library built wrong" >&2; exit 1; }
                                 echo "${SIM_GPU_REASON:-}" ;;
      *get_device_name*) echo "Stand-in GPU" ;;
      *glob*) echo "" ;;
      *) exit 0 ;;
    esac ;;
  -m)
    module=$2; shift 2
    case "$module" in
      pip) prev=""; for a in "$@"; do [ "$prev" = --target ] && mkdir -p "$a"; prev=$a; done
           sleep "${SIM_BUILD_SECONDS:-0}" ;;
      pytest)
        xml=""; for a in "$@"; do case "$a" in --junitxml=*) xml=${a#--junitxml=} ;; esac; done
        name=$(basename "$xml" .xml); var="SIM_PYTEST_${name//-/_}"; setting=${!var:-"0 3 passed in 1.0s"}
        echo "guard bytes: ${KVCACHE_OP_TEST_GUARD_BYTES:-unset}"
        [ -n "${SIM_IGNORE_TERM:-}" ] && trap '' TERM  # (sleep inherits it) a step only SIGKILL stops
        sleep "${setting%% *}"
        echo "${setting#* }" ;;
      kvcache_op.benchmarks.gpu.*|kvcache_op.benchmarks.serving.sampler)
        out=""; prev=""; for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done
        mkdir -p "$out"; [ -n "${SIM_NO_TABLE:-}" ] && exit 0; [ -n "${SIM_BENCH_EXIT:-}" ] && exit "$SIM_BENCH_EXIT"
        echo "| table of $module $* |" | tee "$out/results.md" > "$out/README.md" ;;
    esac ;;
  *) exec "$REAL_PYTHON" "$@" ;;
esac
"""


# The stand-in compute-sanitizer: runs the command after its options, then ends as the tool does, with its own
# summary line (which holds the word "errors").
FAKE_SANITIZER = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift 2; done
"$@"
code=$?
echo "========= ERROR SUMMARY: 0 errors"
exit $code
"""


def run_check(tmp_path, script=ROOT / "tools/gpu_check.sh", **env) -> tuple:
    """(exit status, steps.tsv as {step: (verdict, detail)}, summary.md or '', seconds) of ``script`` run with the
    stand-in python under ``env``."""
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir(exist_ok=True)
    for name, text in (("python", FAKE_PYTHON), ("compute-sanitizer", FAKE_SANITIZER)):
        (bin_folder / name).write_text(text)
        (bin_folder / name).chmod(0o755)
    out = tmp_path / "out"
    began = time.monotonic()
    done = subprocess.run(["bash", str(script), str(out)], capture_output=True, text=True,
                          timeout=120, env={"PATH": f"{bin_folder}:/usr/bin:/bin", "PYTHON": str(bin_folder / "python"),
                                            "REAL_PYTHON": sys.executable,
                                            "GPU_CHECK_WORKERS": "1", **env})
    steps = {}
    if (out / "steps.tsv").is_file():
        for row in (out / "steps.tsv").read_text().splitlines():
            name, verdict, detail = row.split("\t")[:3]
            steps[name] = (verdict, detail)
    summary = (out / "summary.md").read_text() if (out / "summary.md").is_file() else ""
    return done.returncode, steps, summary, time.monotonic() - began, done.stderr


def test_every_step_runs_and_the_summary_holds_both_serving_benchmarks(tmp_path):
    """The sanitizer steps pass too, though the tool's last line says "errors": the verdict is pytest's line."""
    code, steps, summary, _, _ = run_check(tmp_path)
    assert code == 0 and all(verdict == "pass" for verdict, _ in steps.values()), steps
    assert steps["sanitizer-attention-racecheck"] == ("pass", "3 passed in 1.0s")
    assert {"gpu-tests", "sanitizer-attention-synccheck", "ort-cuda-ep", "serving-benchmark-float16",
            "sampler-benchmark"} <= set(steps)
    assert "## Serving benchmark, float16" in summary and "--dtype float16" in summary
    assert "## The sampling graph against the host's sampler" in summary and "serving.sampler" in summary


def test_a_deadline_cuts_the_step_running_and_skips_what_no_longer_fits(tmp_path):
    """With 14 s in all, 4 kept for the summary and steps of at least 3 s: the GPU tests, which would take 60 s, are
    stopped when the time is up; the steps after them are not started; the summary is written in time."""
    code, steps, summary, seconds, _ = run_check(
        tmp_path, GPU_CHECK_DEADLINE="14", GPU_CHECK_RESERVE="4", GPU_CHECK_MIN_STEP="3",
        SIM_PYTEST_gpu_tests="60 3 passed in 60.0s")
    assert seconds < 14 and code == 1
    assert steps["gpu-tests"][0] == "fail" and "timed out after" in steps["gpu-tests"][1]
    for later in ("gpu-attention-tests", "sanitizer-attention-synccheck", "attention-benchmark",
                  "serving-benchmark-float16", "sampler-benchmark"):
        assert steps[later] == ("skip", "no time left (GPU_CHECK_DEADLINE=14)"), later
    assert "| gpu-tests | fail |" in summary


def test_a_check_whose_steps_were_all_left_out_for_want_of_time_fails(tmp_path):
    """The build takes the time: no step after it fits, none fails, and the check still does not pass."""
    code, steps, summary, _, _ = run_check(tmp_path, GPU_CHECK_DEADLINE="8", GPU_CHECK_RESERVE="2",
                                           GPU_CHECK_MIN_STEP="3", SIM_BUILD_SECONDS="4")
    assert code == 1 and steps["build"][0] == "pass"
    assert steps["host-runner"] == steps["gpu-tests"] == ("skip", "no time left (GPU_CHECK_DEADLINE=8)")
    assert not [name for name, (verdict, _) in steps.items() if verdict == "fail"] and summary


def test_a_step_whose_own_limit_is_short_still_runs_when_there_is_time(tmp_path):
    code, steps, _, _, _ = run_check(tmp_path, GPU_CHECK_DEADLINE="500", GPU_CHECK_MIN_STEP="400",
                                     GPU_CHECK_ONLY="benchmark")
    assert code == 0 and steps["benchmark"][0] == "pass"


def test_a_test_step_in_which_no_test_ran_fails(tmp_path):
    code, steps, _, _, _ = run_check(tmp_path, GPU_CHECK_ONLY="gpu-attention-tests",
                                     SIM_PYTEST_gpu_attention_tests="0 28 skipped in 2.0s")
    assert code == 1 and steps["gpu-attention-tests"][0] == "fail"
    assert "no test ran on the GPU: 28 skipped" in steps["gpu-attention-tests"][1]


def test_a_gpu_probe_that_fails_is_a_failure_not_a_machine_without_a_gpu(tmp_path):
    code, steps, _, _, _ = run_check(tmp_path, SIM_PROBE_FAILS="1")
    assert code == 1 and steps["gpu-probe"][0] == "fail" and "ImportError: library built wrong" in steps["gpu-probe"][1]
    assert steps["gpu-tests"][0] == "skip"


def test_a_machine_without_a_gpu_skips_the_gpu_steps_and_passes(tmp_path):
    code, steps, _, _, _ = run_check(tmp_path, SIM_GPU_REASON="no CUDA device is visible")
    assert code == 0 and steps["gpu-tests"] == ("skip", "no CUDA device is visible")
    assert steps["host-runner"][0] == "pass"


@pytest.mark.parametrize("setting", ["GPU_CHECK_ONLY", "GPU_CHECK_SKIP"])
def test_a_step_name_the_check_does_not_have_is_refused(tmp_path, setting):
    code, steps, _, _, stderr = run_check(tmp_path, **{setting: "gpu-tests sanitizer-memchek"})
    assert code == 2 and not steps and "name sanitizer-memchek, which is no step of this check" in stderr


def checkout_with_packed_headers(tmp_path, members: dict) -> pathlib.Path:
    """A checkout holding the script, its summary writer and a .ort-headers.tar.xz of ``members`` (name: bytes), and
    no .ort-headers/ folder."""
    checkout = tmp_path / "checkout"
    (checkout / "tools").mkdir(parents=True)
    for tool in ("gpu_check.sh", "gpu_check_summary.py"):
        shutil.copy(ROOT / "tools" / tool, checkout / "tools" / tool)
    with tarfile.open(checkout / ".ort-headers.tar.xz", "w:xz") as archive:
        for name, data in members.items():
            entry = tarfile.TarInfo(f"./{name}")
            entry.size = len(data)
            archive.addfile(entry, io.BytesIO(data))
    return checkout / "tools/gpu_check.sh"


def test_the_packed_headers_are_unpacked_and_built_with(tmp_path):
    header = b"/* the C API */\n"
    script = checkout_with_packed_headers(tmp_path, {"onnxruntime_c_api.h": header, "onnxruntime_cxx_api.h": b""})
    # (the copied checkout has no tests: only the build step's verdict counts here)
    _, steps, _, _, _ = run_check(tmp_path, script=script, GPU_CHECK_ONLY="host-runner")
    unpacked = tmp_path / "out/ort-headers"
    assert steps["build"][0] == "pass" and steps["build"][1].endswith(f"headers: {unpacked}"), steps["build"]
    assert (unpacked / "onnxruntime_c_api.h").read_bytes() == header


def test_packed_headers_without_the_c_api_stop_the_check_before_the_build(tmp_path):
    script = checkout_with_packed_headers(tmp_path, {"onnxruntime_cxx_api.h": b""})
    code, steps, summary, _, _ = run_check(tmp_path, script=script)
    assert code == 1 and steps["build"][0] == "fail" and "onnxruntime_c_api.h" in steps["build"][1], steps
    assert set(steps) == {"build"} and "| build | fail |" in summary


def test_a_step_the_check_was_asked_for_that_did_not_run_fails_it(tmp_path):
    """A lease's command names the steps it came to prove: one skipped (here, no GPU seen) fails the check."""
    code, steps, summary, _, _ = run_check(tmp_path, GPU_CHECK_ONLY="gpu-tests ort-cuda-ep",
                                           SIM_GPU_REASON="no CUDA device is visible")
    assert code == 1 and steps["gpu-tests"] == ("skip", "no CUDA device is visible")
    assert steps["named-steps"] == ("fail", "named in GPU_CHECK_ONLY but skipped: gpu-tests ort-cuda-ep")
    assert "| named-steps | fail |" in summary


def test_what_an_earlier_check_left_in_the_folder_is_not_read_as_this_ones(tmp_path):
    """A rerun into the same folder in which a step is skipped: its earlier report and table are gone, not summarized
    beside this run's verdict."""
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / ".gpu_check").write_text("")  # an earlier check's folder
    (out / "logs/gpu-attention-tests.xml").write_text('<testsuite tests="337" failures="0" errors="0" skipped="0"/>')
    (out / "attention-bench").mkdir()
    (out / "attention-bench/results.md").write_text("| an earlier run's row |\n")
    code, steps, summary, _, _ = run_check(tmp_path, GPU_CHECK_SKIP="gpu-attention-tests attention-benchmark")
    assert code == 0 and steps["gpu-attention-tests"][0] == steps["attention-benchmark"][0] == "skip"
    assert "337 passed" not in summary and "an earlier run's row" not in summary
    assert not (out / "logs/gpu-attention-tests.xml").exists()


def test_a_benchmark_that_writes_no_table_fails(tmp_path):
    code, steps, _, _, _ = run_check(tmp_path, GPU_CHECK_ONLY="attention-benchmark", SIM_NO_TABLE="1")
    assert code == 1 and steps["attention-benchmark"][0] == "fail"
    assert "no attention-bench/results.md written" in steps["attention-benchmark"][1]


def test_a_step_that_ignores_its_limit_is_killed_and_the_summary_still_written(tmp_path):
    """A step that ignores SIGTERM (a hung kernel's process, say) gets SIGKILL 15 s later, within the reserve: the
    check ends by its deadline with its summary, not cut off by an outer timeout."""
    code, steps, summary, seconds, _ = run_check(
        tmp_path, GPU_CHECK_DEADLINE="30", GPU_CHECK_RESERVE="19", GPU_CHECK_MIN_STEP="3", GPU_CHECK_ONLY="gpu-tests",
        SIM_PYTEST_gpu_tests="90 3 passed in 90.0s", SIM_IGNORE_TERM="1")
    assert code == 1 and seconds < 30, seconds
    assert steps["gpu-tests"][0] == "fail" and "timed out after" in steps["gpu-tests"][1]
    assert "| gpu-tests | fail |" in summary


def test_the_sanitizer_steps_run_the_tests_without_their_guard_bytes(tmp_path):
    """Under compute-sanitizer a read of a buffer's guard would lie inside its allocation, unseen: the sanitizer
    steps set the tests' guards to 0 bytes; the other steps keep them (they check no write lands outside)."""
    code, _, _, _, _ = run_check(tmp_path, GPU_CHECK_ONLY="gpu-tests sanitizer-memcheck sanitizer-attention-racecheck")
    logs = tmp_path / "out/logs"
    assert code == 0
    assert "guard bytes: unset" in (logs / "gpu-tests.log").read_text()
    for name in ("sanitizer-memcheck", "sanitizer-attention-racecheck"):
        assert "guard bytes: 0" in (logs / f"{name}.log").read_text(), name


def test_a_folder_no_earlier_check_wrote_is_refused_and_left_as_it_is(tmp_path):
    """The cleanup removes common names (logs, bench): only in a folder the check made, or an empty one."""
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "logs/mine.txt").write_text("a user's file")
    code, steps, _, _, stderr = run_check(tmp_path)
    assert code == 2 and not steps and "holds files and no .gpu_check mark" in stderr
    assert (out / "logs/mine.txt").read_text() == "a user's file"


def test_a_step_killed_before_its_limit_is_not_said_to_have_timed_out(tmp_path):
    """Exit 137 before the limit is the out-of-memory killer's, not the limit's SIGKILL."""
    code, steps, _, _, _ = run_check(tmp_path, GPU_CHECK_ONLY="attention-benchmark", SIM_BENCH_EXIT="137")
    assert code == 1 and steps["attention-benchmark"] == (
        "fail", "killed before its limit (SIGKILL: out of memory?): see logs/attention-benchmark.log")
