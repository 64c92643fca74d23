"""The side-by-side timing tool: each variant runs under its own settings and build, in turns that rotate, the
environment is left as it was, and bad command lines are refused before any work."""

import argparse
import json
import os
import re
import shlex

import pytest

from kvcache_op.benchmarks.cpu import side_by_side
from kvcache_op.ort_ops import library_path
from repo_scripts import ROOT

SWITCH = "KVCACHE_OP_HEAD_PREFETCH"


def test_each_variant_runs_under_its_settings_in_rotating_turns_and_the_environment_is_restored(monkeypatch):
    monkeypatch.setenv(SWITCH, "before")
    monkeypatch.delenv("KVCACHE_OP_STORES", raising=False)
    seen = []
    variants = [side_by_side.Variant("a", {SWITCH: "l1"}), side_by_side.Variant("b", {SWITCH: None}),
                side_by_side.Variant("c", {"KVCACHE_OP_STORES": "cached"})]
    runners = {v.name: (lambda name=v.name: seen.append((name, os.environ.get(SWITCH),
                                                         os.environ.get("KVCACHE_OP_STORES"))))
               for v in variants}
    times = side_by_side.measure_rounds(runners, lambda: None, variants, rounds=3, warmup=0, repeats=1)
    assert seen == [("a", "l1", None), ("b", None, None), ("c", "before", "cached"),
                    ("b", None, None), ("c", "before", "cached"), ("a", "l1", None),
                    ("c", "before", "cached"), ("a", "l1", None), ("b", None, None)]
    assert all(len(t["op"]) == len(t["copy"]) == 3 for t in times.values())
    assert os.environ[SWITCH] == "before" and "KVCACHE_OP_STORES" not in os.environ


def test_a_variant_that_raises_leaves_the_environment_as_it_was(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)

    def fails():
        assert os.environ[SWITCH] == "l2"
        raise RuntimeError("the op failed")

    with pytest.raises(RuntimeError, match="the op failed"):
        side_by_side.measure_rounds({"x": fails}, lambda: None, [side_by_side.Variant("x", {SWITCH: "l2"})],
                                    rounds=1, warmup=0, repeats=1)
    assert SWITCH not in os.environ


def test_summaries_set_each_round_against_its_own_copy_and_the_first_variant():
    times = {"a": {"op": [2.0, 4.0, 3.0], "copy": [1.0, 1.0, 3.0]},
             "b": {"op": [1.0, 2.0, 6.0], "copy": [1.0, 4.0, 3.0]}}
    s = side_by_side.summarize(times, "a")
    assert s["a"]["vs_copy"] == pytest.approx(0.5) and s["a"]["vs_copy_range"] == pytest.approx([0.25, 1.0])
    assert s["b"]["vs_copy"] == pytest.approx(1.0) and s["b"]["vs_copy_range"] == pytest.approx([0.5, 2.0])
    assert s["b"]["time_vs_first"] == pytest.approx(0.5) and s["a"]["time_vs_first"] == pytest.approx(1.0)
    assert s["b"]["op_ms"] == pytest.approx(2000.0)


def test_a_variant_naming_a_build_gets_its_own_session_of_it(monkeypatch):
    built, ran = [], []

    def fake_runner(feeds, attrs, threads, offset, library=None):
        built.append(library)
        return lambda: ran.append((library, os.environ.get(SWITCH)))

    monkeypatch.setattr(side_by_side, "ort_runner", fake_runner)
    variants = [side_by_side.Variant("a", {}), side_by_side.Variant("b", {SWITCH: "l2"}),
                side_by_side.Variant("c", {}, "/some/build.so")]
    args = type("Args", (), {"threads": 1, "rounds": 1, "warmup": 0, "repeats": 1})
    case = side_by_side.Case(side_by_side.shape_named("decode", quick=True), 1, 0, 0)
    monkeypatch.delenv(SWITCH, raising=False)
    summary = side_by_side.run_case(case, variants, 0, args)
    assert built == [None, "/some/build.so"] and set(summary) == {"a", "b", "c"}
    # a and b share the loaded build's session, each under its own settings; c runs its build
    assert ran == [(None, None), (None, "l2"), ("/some/build.so", None)]


def test_a_quick_run_times_every_case_offset_and_variant_and_records_them(tmp_path, capsys):
    out = tmp_path / "new folder" / "ab.json"
    assert side_by_side.main(["--quick", "--case", "decode:paged:8:3", "--case", "prefill:offset:0:0",
                              "--variant", f"l1:{SWITCH}=l1", "--variant", f"l2:{SWITCH}=l2",
                              "--variant", f"build:library={library_path()}", "--offsets", "0,16",
                              "--rounds", "2", "--repeats", "1", "--warmup", "0", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["case"], r["output_offset"]) for r in data["results"]] == [
        ("decode:paged:8:3", 0), ("decode:paged:8:3", 16), ("prefill:offset:0:0", 0), ("prefill:offset:0:0", 16)]
    for r in data["results"]:
        assert set(r["variants"]) == {"l1", "l2", "build"}
        for v in r["variants"].values():
            low, high = v["vs_copy_range"]
            assert 0 < low <= v["vs_copy"] <= high and len(v["op_ms_rounds"]) == 2 and v["op_ms"] > 0
    assert data["variants"]["build"]["library"] == library_path() and data["variants"]["l2"]["env"] == {SWITCH: "l2"}
    # each variant's build and choices are recorded as they were under its own settings
    assert all("kernel build" in v["build"] for v in data["variants"].values())
    assert data["variants"]["l1"]["build"].endswith("prefetch into l1")
    assert data["variants"]["l2"]["build"].endswith("prefetch into l2")
    printed = capsys.readouterr().out
    assert "decode:paged:8:3 off16:" in printed and "of l1's" in printed
    assert f"  l2: {SWITCH}=l2: " in printed and f"  l1: {SWITCH}=l1: " in printed
    assert shlex.split(data["command"])[-2:] == ["--json", str(out)]  # its folder's name has a space: quoted


def test_decode_in_n_heads_keeps_the_decode_steps_bytes():
    shape = side_by_side.shape_named("decode-16h")
    assert (shape.batch, shape.heads, shape.head_dim, shape.seqlen, shape.start_pos) == (32, 16, 128, 1, 1023)
    with pytest.raises(ValueError, match="decode-<N>h"):
        side_by_side.shape_named("decode-7h")


def test_the_chunk_in_n_heads_keeps_its_batch_and_tokens():
    shape = side_by_side.shape_named("chunk-32h")
    assert (shape.batch, shape.heads, shape.head_dim, shape.seqlen, shape.start_pos) == (4, 32, 128, 256, 768)
    for bad in ("chunk-0h", "chunk-65h"):
        with pytest.raises(ValueError, match="chunk-<N>h with N from 1 to 64"):
            side_by_side.shape_named(bad)


@pytest.mark.parametrize("argv, message", [
    (["--case", "decode:paged:8"], "is not SHAPE:MODE:QUANT_BIT:LAYOUT"),
    (["--case", "decode:ring:8:0"], "the mode is paged or offset"),
    (["--case", "decode:paged:3:0"], "quant_bit is 0 or 8"),
    (["--case", "decode:paged:4:0"], "quant_bit is 0 or 8"),
    (["--case", "decode:paged:8:4"], "the layout is 0, 1, 2 or 3"),
    (["--case", "nope:paged:8:0"], "no shape 'nope'"),
    (["--variant", "a:library=/no/such/build.so"], "is not a file"),
    (["--variant", "a:NOEQUALS"], "is not ENV=VALUE or library=PATH"),
    (["--variant", "a:X=1,X=2"], "sets X twice"),
    (["--variant", f"a:library={library_path()},library={library_path()}"], "sets library twice"),
    (["--variant", "a:library=" + __file__], "is not a kvcache-op library"),
    (["--variant", "a:KVCACHE_OP_LIBRARY=/x.so"], "names its build as library=PATH"),
    (["--json", "/"], "is a folder"),
    (["--json", "/tmp/kvcache-op-no-such-folder/"], "is a folder"),
    (["--variant", "a", "--variant", "a"], "names must differ"),
    (["--offsets", "0,17"], "even number of bytes below 64"),
    (["--offsets", "x"], "not a comma-separated list"),
    (["--json", "/proc/no/such/folder/ab.json"], "--json"),
])
def test_bad_command_lines_are_refused_in_one_line_before_any_work(argv, message, capsys):
    base = {"--case": ["--case", "decode:paged:8:0"], "--variant": ["--variant", "a"]}
    for option, default in base.items():
        if option not in argv:
            argv = argv + default
    with pytest.raises(SystemExit) as exit_:
        side_by_side.main(["--quick"] + argv)
    assert exit_.value.code == 2
    err = capsys.readouterr()
    assert message in err.err and err.err.count("\n") == 1 and err.out == ""


@pytest.mark.parametrize("setting, message", [
    ("KVCACHE_OP_STREAMED_HEADS=banana", "takes a whole number >= 1"),
    ("KVCACHE_OP_STREAMED_HEADS=0", "takes a whole number >= 1"),
    ("KVCACHE_OP_GATHER_TILE=-1", "takes a whole number >= 0"),
    ("KVCACHE_OP_HEAD_PREFETCH=l3", "takes l2 or l1"),
    ("KVCACHE_OP_STORES=streamed", "takes side-by-side or stream or cached"),
    ("KVCACHE_OP_HEAD_PREFTCH=l2", "is not a switch of this build's CPU kernels"),
])
def test_a_setting_the_kernels_would_ignore_is_refused(setting, message):
    """The kernels run their default for a value they do not know: a variant setting one would time the default
    under another name."""
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        side_by_side.parse_variant(f"v:{setting}")


def test_settings_the_kernels_take_are_accepted_and_another_build_may_set_its_own():
    for setting in ("KVCACHE_OP_STREAMED_HEADS=8", "KVCACHE_OP_GATHER_TILE=0", "KVCACHE_OP_HEAD_PREFETCH=l1",
                    "KVCACHE_OP_STORES=", "OPENBLAS_NUM_THREADS=1"):
        assert side_by_side.parse_variant(f"v:{setting}").env
    other = side_by_side.parse_variant(f"v:KVCACHE_OP_NEW_SWITCH=on,library={library_path()}")
    assert other.env == {"KVCACHE_OP_NEW_SWITCH": "on"}


def test_the_switch_table_names_every_switch_the_cpu_kernels_read():
    """The table the settings are checked against is the kernels' own: every variable the dispatch reads."""
    source = (ROOT / "cpu" / "kv_cpu_dispatch.cc").read_text()
    read = set(re.findall(r'(?:getenv|EnvSwitch|EnvInteger)\("(KVCACHE_OP_[A-Z_]+)"', source))
    assert read == set(side_by_side.CPU_SWITCHES)


def test_the_cuda_switch_table_names_every_switch_the_cuda_routes_read():
    from kvcache_op.benchmarks.environment import CUDA_SWITCHES

    source = (ROOT / "cuda" / "kv_cuda_run.cc").read_text()
    assert set(re.findall(r'EnvIs\("(KVCACHE_OP_[A-Z_]+)"', source)) == set(CUDA_SWITCHES)


def test_a_recorded_command_holds_the_switches_in_force_and_nothing_else(monkeypatch):
    """The kernels' switches and BLAS threads are recorded; a build setting is not (it changes nothing that runs),
    nor a secret such as the server's API key."""
    from kvcache_op.benchmarks.environment import recorded_command

    for key, value in {"KVCACHE_OP_STORES": "stream", "KVCACHE_OP_CUDA_MMA": "0", "OPENBLAS_NUM_THREADS": "1",
                       "KVCACHE_OP_API_KEY": "sk-secret", "KVCACHE_OP_CUDA": "1",
                       "KVCACHE_OP_ORT_INCLUDE_DIR": "/headers"}.items():
        monkeypatch.setenv(key, value)
    line = recorded_command("kvcache_op.benchmarks.x", ["--out", "a b"])
    assert line.startswith("KVCACHE_OP_CUDA_MMA=0 KVCACHE_OP_STORES=stream OPENBLAS_NUM_THREADS=1 python -m ")
    assert "sk-secret" not in line and "KVCACHE_OP_CUDA=" not in line and "/headers" not in line
    assert line.endswith("--out 'a b'")
