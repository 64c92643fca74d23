"""Bad command lines get one line on stderr and exit status 2, before any slow work; never a traceback."""

import time

import pytest

from kvcache_op import __version__
from kvcache_op.cli import main


def _one_line_error(capsys, argv) -> str:
    start = time.monotonic()
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    assert status == 2
    assert time.monotonic() - start < 20, "refused only after slow work"
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err + captured.out, captured
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["fuzz", "--examples", "0"], "--examples: must be >= 1, got 0"),
    (["fuzz", "--examples", "-5"], "--examples: must be >= 1, got -5"),
    (["fuzz", "--timeout", "0"], "--timeout: must be a finite number of seconds > 0"),
    (["demo", "--num-pages", "0"], "--num-pages: must be >= 1, got 0"),
    (["demo", "--page-size", "0"], "--page-size: must be >= 1, got 0"),
    (["demo", "--page-size", "100000000"], "--page-size: must be <= 4096, got 100000000"),
    (["export", "ckpt", "out.onnx", "--page-size", "1000000000000"], "--page-size: must be <= 4096"),
    (["serve", "m.onnx", "--port", "70000"], "--port: must be <= 65535, got 70000"),
    (["serve", "m.onnx", "--replicas", "100000"], "--replicas 100000: more than this machine's"),
    (["demo", "--new-tokens", "0"], "--new-tokens: must be >= 1, got 0"),
    (["demo", "--requests", "0"], "--requests: must be >= 1, got 0"),
    (["demo", "--requests", "many"], "--requests: 'many' is not an integer"),
    (["demo", "--provider", "NoSuchExecutionProvider"], "--provider NoSuchExecutionProvider: not in this onnxruntime"),
    (["slots-demo", "--steps", "0"], "--steps: must be >= 1, got 0"),
    (["conformance", "--out", "/proc/nope", "--case", "paged_layout0"], "cannot write /proc/nope"),
    (["no-such-command"], "invalid choice: 'no-such-command'"),
    (["fuzz", "--out", "/proc/nope"], "--out /proc/nope: cannot write in /proc"),
    (["demo", "--out", "/proc/nope"], "--out /proc/nope: cannot write in /proc"),
    (["demo", "--seed", "-1"], "--seed: must be >= 0, got -1"),
])
def test_bad_arguments_are_one_line(capsys, argv, message):
    assert message in _one_line_error(capsys, argv)


def test_an_out_path_that_is_a_file_is_refused_before_fuzzing(tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    line = _one_line_error(capsys, ["fuzz", "--out", str(tmp_path / "taken")])
    assert line.endswith(f"{tmp_path / 'taken'} exists and is not a folder")


def test_listing_a_folder_with_a_corrupt_model_names_it(tmp_path, capsys):
    assert main(["conformance", "--out", str(tmp_path), "--case", "paged_layout0", "--case", "int8_layout0",
                 "--quiet"]) == 0
    (tmp_path / "test_int8_layout0" / "model.onnx").write_bytes(b"not a model")
    capsys.readouterr()
    assert main(["validate", str(tmp_path), "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].split()[:3] == ["int8_layout0", "?", "unreadable:"]
    assert listed[1].split() == ["paged_layout0", "KeyValueCache", "valid"]
    assert main(["validate", str(tmp_path)]) == 1  # the unreadable case fails, the other passes
    out = capsys.readouterr().out
    assert "FAIL int8_layout0" in out and "ok   paged_layout0" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"kvcache-op {__version__}"


@pytest.mark.parametrize("argv, message", [
    (["bench", "op", "--repeats", "-1"], "--repeats: must be >= 1, got -1"),
    (["bench", "op", "--out", "/proc/nope"], "--out: cannot write in /proc"),
    (["bench", "manager", "--requests", "0"], "--requests: must be >= 1, got 0"),
    (["bench", "manager", "--page-size", "0"], "--page-size: must be >= 1, got 0"),
    (["bench", "attention", "--warmup", "-2"], "--warmup: must be >= 0, got -2"),
    (["bench", "op", "--no-such-option"], "unrecognized arguments: --no-such-option"),
])
def test_benchmark_arguments_are_checked_as_one_line(capsys, argv, message):
    line = _one_line_error(capsys, argv)
    assert message in line and line.startswith(f"kvcache-op bench {argv[1]}: "), line  # the subcommand named


def test_the_page_size_bound_is_the_exporters():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvcache_op.arguments import MAX_PAGE_SIZE
    from kvcache_op.hf.export import MAX_PAGE_SIZE as exporters

    assert MAX_PAGE_SIZE == exporters


def test_a_demo_provider_the_engine_cannot_keep_its_cache_on_is_refused_before_the_export(capsys):
    onnxruntime = pytest.importorskip("onnxruntime")
    others = [p for p in onnxruntime.get_available_providers()
              if p not in ("CPUExecutionProvider", "CUDAExecutionProvider")]
    if not others:
        pytest.skip("this onnxruntime has only the CPU and CUDA execution providers")
    assert main(["demo", "--provider", others[0], "--requests", "1"]) == 2
    captured = capsys.readouterr()
    assert "binds its cache on the CPU or CUDA execution provider" in captured.err
    assert captured.err.count("\n") == 1 and "exported" not in captured.out
