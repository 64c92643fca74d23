"""``kvcache-op validate`` as a kit for other people's backends: each planted bug fails the vectors, one
raising or crashing case does not stop the run, failures say what differs, and bad arguments get one line."""

import os
import pathlib
import re
import time

import numpy as np
import pytest

import planted_backends
from kvcache_op.cli import main
from processes import ended_within, running
from kvcache_op.ort_ops import library_path
from kvcache_op.validation import vectors
from kvcache_op.validation.outcome import copies
from kvcache_op.validation.adapters import CallableBackend
from kvcache_op.validation.ort_adapter import OrtBackend
from kvcache_op.validation.validate import validate, validate_folder

TESTS = pathlib.Path(__file__).parent


def _failed(report, op="KeyValueCache"):
    return {r.name for r in report.results if r.status == "FAIL" and r.op == op}


def test_the_correct_planted_backend_passes_every_kv_case(all_vectors):
    """The planted bugs are the only thing wrong with their backends."""
    report = validate(all_vectors, planted_backends.correct)
    assert _failed(report) == set() and report.count("ok") == 66 + 79  # valid + invalid KeyValueCache cases


#: bug -> cases it must fail (at least), and the kind of every case it fails
CAUGHT_BY = {
    "no_bounds_checks": ({"error_offset_beyond_max_t", "error_paged_sentinel_minus_one", "error_int8_offset_beyond_max_t",
                          "error_slot_stored_twice", "error_max_seqlen_too_small"}, "invalid"),
    "gqa_tiled": ({"gqa_repeat2", "gqa_repeat4_int8_paged", "decode_batch_int8_gqa"}, "valid"),
    "kvlen_ignored": ({"partial_load_kvlen_lt_end", "store_only_kvlen0"}, "valid"),
    "int4_nibbles_swapped": ({f"int4_layout{i}" for i in range(4)} | {"chunked_prefill_paged_int4"}, "valid"),
    "scale_not_rounded": ({"int8_scale_float16", "int4_scale_float16", "t1_bfloat16_int8_scale_float16"}, "valid"),
    "pages_assumed_aligned": ({"paged_unaligned_pages", "paged_unaligned_pages_int4_layout3"}, "valid"),
    "layer_ignored_in_layouts_0_and_2": ({"layers2_layer_idx1_layout0", "layers4_layer_idx3_paged_int8_layout2"},
                                         "valid"),
    "page_bounds_of_touched_slots_only": ({"error_paged_page_past_end_touched_inside"}, "invalid"),
    "aliasing_unchecked": ({"error_slot_stored_twice", "error_int4_slot_stored_twice",
                            "error_paged_page_repeated_in_one_table", "error_stored_slot_loaded_by_other_sequence",
                            "error_stored_slot_loaded_at_other_position"}, "invalid"),
}


@pytest.mark.parametrize("bug", planted_backends.BUGS)
def test_each_planted_bug_fails_the_vectors(all_vectors, bug):
    report = validate(all_vectors, getattr(planted_backends, bug))
    must, kind = CAUGHT_BY[bug]
    failed = _failed(report)
    assert must <= failed, must - failed
    assert {r.kind for r in report.results if r.status == "FAIL"} == {kind}


def test_no_bounds_checks_leaves_the_cache_changed_or_accepts_the_call(all_vectors):
    report = validate(all_vectors, planted_backends.no_bounds_checks, cases=["error_offset_beyond_max_t",
                                                                            "error_paged_sentinel_minus_one"])
    lines = {r.name: r.lines for r in report.results}
    assert lines["error_offset_beyond_max_t"][0].startswith("cache: ") and "changed although the call failed" in \
        lines["error_offset_beyond_max_t"][0]
    assert lines["error_paged_sentinel_minus_one"] == [
        "accepted an invalid call; expected an error (the reference: cachestarts[1, 0] = -1: page 0 of sequence 1 is "
        "used, so it needs 0 <= cachestarts[1, 0] and cachestarts[1, 0] + page_size (4) <= MaxT = 24)"]


def test_a_backend_raising_on_one_case_fails_only_that_case(all_vectors):
    report = validate(all_vectors, planted_backends.raises_on_layers3)
    failed = {r.name: r.lines for r in report.results if r.status == "FAIL"}
    assert set(failed) == {"layers3_layer_idx2", "layers3_layer_idx1_paged_layout3"}
    assert failed["layers3_layer_idx2"] == ["raised RuntimeError: this backend does not support three layers"]
    assert report.count("ok") == len(report.results) - 2 - report.count("skip")


def test_a_crashing_backend_fails_only_the_case_it_crashed_on(all_vectors, monkeypatch):
    """module:function backends run in a worker process: the crash is that case's failure, and the next
    cases run in a fresh worker."""
    monkeypatch.chdir(TESTS)  # the backend module is importable from the current directory
    names = ["paged_layout0", "page_size1", "page_size_default128", "int8_layout0", "error_offset_beyond_max_t"]
    report = validate(all_vectors, "planted_backends:crashes_on_page_size1", cases=names)
    status = {r.name: r.status for r in report.results}
    assert status == {**dict.fromkeys(names, "ok"), "page_size1": "FAIL"}
    crash = next(r for r in report.results if r.name == "page_size1").lines
    assert len(crash) == 1 and crash[0].startswith("the backend crashed: its process killed by signal SIGABRT")
    assert "planted_backends.py" in crash[0]  # where it crashed


def test_a_worker_ended_with_status_0_mid_call_fails_the_case_saying_so(all_vectors, monkeypatch):
    """A compiled library may end the process with status 0 (its ``_exit``, which no Python code can trap): the
    worker's exit is a crash of that case, named as an exit with its status, not as a signal."""
    monkeypatch.chdir(TESTS)
    report = validate(all_vectors, "planted_backends:libc_exits_on_layers3", cases=["layers3_layer_idx2", "batch0"])
    assert [(r.name, r.status) for r in report.results] == [("layers3_layer_idx2", "FAIL"), ("batch0", "ok")]
    (line,) = report.results[0].lines
    assert line.startswith("the backend crashed: its process exited with status 0"), line


def test_a_hanging_call_times_out_and_the_run_goes_on(all_vectors, monkeypatch):
    """The timeout also bounds each start of the worker (a fresh Python importing numpy, onnx and the kit, twice
    here): 8 s leaves a loaded machine room for that, and is still far below the planted hang's 600 s."""
    monkeypatch.chdir(TESTS)
    names = ["layers3_layer_idx2", "offset_layout0"]
    report = validate(all_vectors, "planted_backends:hangs_on_layers3", cases=names, timeout=8)
    assert [(r.name, r.status) for r in report.results] == [("layers3_layer_idx2", "FAIL"), ("offset_layout0", "ok")]
    assert report.results[0].lines == ["the backend did not return within 8 s (its process was killed)"]


def test_a_backend_that_forks_then_crashes_is_a_crash_at_once_and_its_child_is_stopped(all_vectors, monkeypatch,
                                                                                       tmp_path):
    """The forked child holds the answer pipe open: the crash is reported as the abort at once, not as a hang at
    the timeout (300 s by default), and the child is stopped with the worker."""
    monkeypatch.chdir(TESTS)
    monkeypatch.setenv("KVCACHE_TEST_CHILD_PID", str(tmp_path / "child"))
    start = time.monotonic()
    report = validate(all_vectors, "planted_backends:forks_then_crashes_on_layers3",
                      cases=["layers3_layer_idx2", "offset_layout0"], timeout=120)
    assert time.monotonic() - start < 60
    assert [(r.name, r.status) for r in report.results] == [("layers3_layer_idx2", "FAIL"), ("offset_layout0", "ok")]
    assert report.results[0].lines[0].startswith("the backend crashed: its process killed by signal SIGABRT")
    assert ended_within(int((tmp_path / "child").read_text()), 10)


def test_what_a_backend_forked_is_stopped_with_its_worker_at_the_end(all_vectors, monkeypatch, tmp_path):
    monkeypatch.chdir(TESTS)
    monkeypatch.setenv("KVCACHE_TEST_CHILD_PID", str(tmp_path / "child"))
    report = validate(all_vectors, "planted_backends:forks_on_layers3", cases=["layers3_layer_idx2"], timeout=120)
    assert [(r.name, r.status) for r in report.results] == [("layers3_layer_idx2", "ok")]
    assert ended_within(int((tmp_path / "child").read_text()), 10)


def test_an_interrupt_while_a_call_runs_stops_the_worker_at_once(all_vectors, monkeypatch):
    """The worker runs in a session of its own, so Ctrl-C does not reach it: the kit stops it at once, and none is
    left running."""
    from kvcache_op.validation import isolated
    from kvcache_op.validation.backends import load_backend

    monkeypatch.chdir(TESTS)
    backend = load_backend("planted_backends:hangs_on_layers3", timeout=120)
    pid = backend._process.pid
    case = vectors.read_case(all_vectors / vectors.folder_name("layers3_layer_idx2"))

    def interrupted(fd, deadline=None, alive=None):
        time.sleep(0.5)  # the worker is in the hung call
        raise KeyboardInterrupt

    monkeypatch.setattr(isolated, "receive", interrupted)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        backend.run(case.op, copies(case.inputs), case.attributes)
    assert time.monotonic() - start < 5 and backend._process is None and not running(pid)


def test_failure_lines_name_tensor_index_values_count_and_the_code_and_scale(all_vectors):
    """Checked against the backend's own outcome: first differing index, both values, how many differ, and
    the code and scale of the slot a differing output is loaded from."""
    folder = all_vectors / vectors.folder_name("int4_layout2")
    case = vectors.read_case(folder)
    got = CallableBackend({"KeyValueCache": planted_backends.int4_nibbles_swapped}, "x").run(
        "KeyValueCache", copies(case.inputs), case.attributes)
    report = validate(all_vectors, planted_backends.int4_nibbles_swapped, cases=["int4_layout2"])
    lines = report.results[0].lines
    assert [line.split(":")[0] for line in lines] == ["key", "value", "cache"]  # scales are right
    key, want = got.outputs["key"], case.expected.outputs["key"]
    differ = key.view(np.uint16) != want.view(np.uint16)
    first = np.unravel_index(int(np.flatnonzero(differ)[0]), differ.shape)
    assert lines[0].startswith(f"key: {int(differ.sum())} of {differ.size} elements differ; first at "
                               f"[{', '.join(map(str, first))}]: got {float(key[first])!r} (0x{int(key.view(np.uint16)[first]):04x}), "
                               f"expected {float(want[first])!r}")
    assert "; loaded from cache slot " in lines[0] and "code got " in lines[0] and "scale got " in lines[0]
    codes = got.after["cache"].astype(np.int8) != case.expected.after["cache"].astype(np.int8)
    index = np.unravel_index(int(np.flatnonzero(codes)[0]), codes.shape)
    assert lines[2].startswith(f"cache: {int(codes.sum())} of {codes.size} elements differ; first at "
                               f"[{', '.join(map(str, index))}]: got {int(got.after['cache'][index])}, "
                               f"expected {int(case.expected.after['cache'][index])}; scale of its group: got ")


def test_printed_report_ends_with_the_summary_table(all_vectors):
    lines = []
    assert validate_folder(all_vectors, planted_backends.gqa_tiled, progress=lines.append,
                           cases=["gqa_*", "offset_layout0", "mha_batch0"]) == 1
    assert lines[0].splitlines()[0] == "FAIL gqa_repeat2"
    table = lines[lines.index("") + 1:]
    assert table[0].split() == ["op", "calls", "passed", "failed", "skipped"]
    # with one kv head, tiling is repeating: gqa_repeat3_heads1 passes
    assert [row.split() for row in table[1:4]] == [["KeyValueCache", "valid", "2", "2", "0"],
                                                   ["MultiHeadAttention", "valid", "0", "0", "1"],
                                                   ["total", "2", "2", "1"]]
    assert table[4] == "failed: gqa_repeat2, gqa_repeat4_int8_paged"
    assert table[5] == "skipped: the backend provides no multi_head_attention"


def test_a_run_whose_every_case_was_skipped_has_not_passed(all_vectors):
    """report.passed means something was checked: a backend with none of the selected cases' ops skips them all
    and has not passed."""
    report = validate(all_vectors, planted_backends.correct, cases=["mha_*"])
    assert report.results and report.count("skip") == len(report.results)
    assert not report.passed


def test_every_op_of_a_module_object_backend_is_validated(all_vectors, monkeypatch):
    monkeypatch.chdir(TESTS)
    report = validate(all_vectors, "planted_backends:ALL_OPS", isolate=False)
    assert report.count("FAIL") == report.count("skip") == 0 and len(report.results) == len(vectors.ALL_CASES)


def test_ort_backend_with_an_explicit_library_and_provider(all_vectors):
    """IOBinding on the caller's memory (int4 and bfloat16 included), every op, valid and invalid calls."""
    names = ["int4_*", "t1_bfloat16*", "rotary_*", "error_paged_*", "mha_gqa_group4_bfloat16", "mha_error_key_*"]
    report = validate(all_vectors, "ort", cases=names, isolate=False, ort_library=library_path(),
                      provider="CPUExecutionProvider")
    assert report.count("ok") == len(report.results) > 50


def test_ort_backend_device_path_copies_the_in_place_results_back(all_vectors):
    """With inputs in separate OrtValues (what a device provider gets), the cache and scale the op wrote
    are copied back; without the copy they would be stale and the cases would fail."""
    backend = OrtBackend()
    backend.copy_inputs = True
    names = ["int8_layout0", "int4_layout1", "t1_bfloat16", "rotary_int8_layout1", "error_int8_offset_beyond_max_t"]
    assert validate(all_vectors, backend, cases=names).count("ok") == len(names)
    backend._copy_back = lambda *args: None  # the same run without the copy back: the checks see it
    assert validate(all_vectors, backend, cases=names).count("FAIL") == 4


def test_ort_backend_in_its_worker_process(all_vectors):
    report = validate(all_vectors, "ort", cases=["paged_layout3", "error_slot_stored_twice", "rotary_error_slot_twice"])
    assert [r.status for r in report.results] == ["ok"] * 3


def _cli(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_list_and_case_filter(all_vectors, capsys):
    status, out, _ = _cli(capsys, "validate", str(all_vectors), "--list", "--case", "rotary_error_slot_*")
    assert status == 0 and [line.split() for line in out.splitlines()] == [
        ["rotary_error_slot_negative", "KeyCacheRotaryShift", "invalid"],
        ["rotary_error_slot_past_max_t", "KeyCacheRotaryShift", "invalid"],
        ["rotary_error_slot_twice", "KeyCacheRotaryShift", "invalid"]]
    status, out, _ = _cli(capsys, "validate", str(all_vectors), "--case", "test_offset_layout1", "--case", "batch0")
    assert status == 0 and [line.split()[:2] for line in out.splitlines()[:2]] == [["ok", "offset_layout1"], ["ok", "batch0"]]


def test_cli_tolerance_spec_passes_ppl_arithmetic(all_vectors, capsys, monkeypatch):
    monkeypatch.chdir(TESTS)
    args = ("validate", str(all_vectors), "--backend", "planted_backends:ppl_style", "--in-process", "--case", "int8_*")
    assert _cli(capsys, *args)[0] == 1
    assert _cli(capsys, *args, "--tolerance", "spec")[0] == 0


@pytest.mark.parametrize("argv, message", [
    (["--case", "no_such_case"], "no case named 'no_such_case' in "),
    (["--backend", "ort", "--ort-library", "/no/such/library.so"], "--ort-library /no/such/library.so: no such file"),
    (["--backend", "ort", "--ort-library", __file__, "--in-process"], "cannot load it"),
    (["--backend", "ort", "--provider", "NoSuchExecutionProvider", "--in-process"],
     "--provider NoSuchExecutionProvider is not available"),
    (["--backend", "ort", "--provider-option", "device_id"], "expected KEY=VALUE"),
    (["--backend", "no_such_module:f", "--in-process"], "cannot import module 'no_such_module'"),
    (["--backend", "planted_backends:no_such_function"], "'planted_backends' has no attribute 'no_such_function'"),
    (["--backend", "planted_backends", "--in-process"], "expected reference, ort or module:function"),
    (["--backend", "planted_backends:ppl_style", "--in-process", "--timeout", "1"], "--timeout needs the backend in "
                                                                                    "a worker process"),
    (["--timeout", "1"], "--timeout needs the backend in a worker process"),  # the reference runs in this process
    (["--provider", "CPUExecutionProvider"], "apply to --backend ort only"),
    (["--provider-option", "device_id=0"], "apply to --backend ort only"),
    (["--backend", "planted_backends:ppl_style", "--ort-library", __file__], "apply to --backend ort only"),
])
def test_cli_bad_arguments_get_one_line(all_vectors, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(TESTS)
    status, out, err = _cli(capsys, "validate", str(all_vectors), *argv)
    assert status == 2 and out == "" and len(err.splitlines()) == 1 and message in err, err


def test_cli_a_bare_library_file_name_means_the_file_in_the_current_folder(all_vectors, capsys, monkeypatch, tmp_path):
    """A loader given a bare name searches its own path: the name is made absolute first."""
    import shutil

    from kvcache_op.ort_ops import library_path

    shutil.copy(library_path(), tmp_path / "mylib.so")
    monkeypatch.chdir(tmp_path)
    status, out, err = _cli(capsys, "validate", str(all_vectors), "--backend", "ort", "--ort-library", "mylib.so",
                            "--in-process", "--case", "paged_layout0")
    assert status == 0 and err == "" and out.startswith("ok"), err


def test_cli_a_backend_module_in_the_current_folder_is_imported_though_it_is_on_no_import_path(
        all_vectors, capsys, monkeypatch, tmp_path):
    """The installed ``kvcache-op`` script's import path has neither the current folder nor this folder (pytest's
    and ``python -m``'s have); ``--backend my_backend:run`` still finds ``my_backend.py`` where the user stands."""
    import sys

    (tmp_path / "my_backend_in_cwd.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nfrom planted_backends import correct as run\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_backend_in_cwd", raising=False)
    status, out, err = _cli(capsys, "validate", str(all_vectors), "--backend", "my_backend_in_cwd:run", "--in-process",
                            "--case", "paged_layout0")
    assert status == 0 and err == "" and out.startswith("ok"), err


def test_cli_conformance_list_takes_its_cases_and_refuses_an_out_folder(tmp_path, capsys):
    status, out, _ = _cli(capsys, "conformance", "--list", "--case", "paged_layout0", "--case", "batch0")
    assert status == 0 and [line.split()[0] for line in out.splitlines()] == ["paged_layout0", "batch0"]
    status, _, err = _cli(capsys, "conformance", "--list", "--case", "nope")
    assert status == 2 and "unknown conformance case(s) ['nope']" in err
    status, _, err = _cli(capsys, "conformance", "--list", "--out", str(tmp_path))
    assert status == 2 and "give one" in err and not os.listdir(tmp_path)


def test_cli_missing_folder_and_unknown_conformance_case(tmp_path, capsys):
    status, _, err = _cli(capsys, "validate", str(tmp_path / "nowhere"))
    assert status == 2 and err.count("\n") == 1 and "no such folder" in err
    status, _, err = _cli(capsys, "conformance", "--out", str(tmp_path), "--case", "nope")
    assert status == 2 and err.count("\n") == 1 and "unknown conformance case(s) ['nope']" in err
    assert not os.listdir(tmp_path)


def test_readme_kit_example_runs():
    text = (TESTS.parent / "README.md").read_text()
    block = re.search(r"## Validating a backend: the conformance kit\n.*?```python\n(.*?)```", text, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {"__name__": "readme_kit_example"})


def test_validate_tells_backend_objects_function_holders_and_callables_apart():
    """A backend object has both ``run`` and ``ops`` (used as it is); an object holding the reference's function
    names runs those ops, even when it is also callable; a bare callable is KeyValueCache; anything else, an object
    with only one of ``run`` and ``ops`` included, is refused."""
    import types

    from kvcache_op.validation.validate import as_backend

    class Both:
        def __call__(self, **inputs):
            raise AssertionError("not called")

        def multi_head_attention(self, **inputs):
            raise AssertionError("not called")

    assert as_backend(Both()).ops == {"MultiHeadAttention"}
    assert as_backend(planted_backends.correct).ops == {"KeyValueCache"}
    backend = CallableBackend({"KeyValueCache": planted_backends.correct}, "correct")
    assert as_backend(backend) is backend
    for half in (types.SimpleNamespace(run=backend.run), types.SimpleNamespace(ops=backend.ops), object()):
        with pytest.raises(TypeError, match="not a backend"):
            as_backend(half)


def test_a_worker_backend_writes_the_callers_arrays_in_place(monkeypatch):
    """A backend in a worker process writes into copies there; ``run`` puts what it left into the caller's own
    ``cache`` and ``scale`` arrays (what the op promises: in place), and the outcome holds those arrays."""
    from kvcache_op.validation import load_backend
    from kvcache_op.validation.outcome import reference_outcome

    monkeypatch.chdir(TESTS)
    case = vectors.ALL_CASES["int8_layout0"]()
    expected = reference_outcome(case.op, case.inputs, case.attributes)
    inputs = copies(case.inputs)
    backend = load_backend("planted_backends:correct")
    try:
        outcome = backend.run(case.op, inputs, case.attributes)
    finally:
        backend.close()
    assert outcome.error is None and not outcome.crashed
    for name in ("cache", "scale"):
        assert outcome.after[name] is inputs[name], name
        assert inputs[name].tobytes() == expected.after[name].tobytes(), name
        assert inputs[name].tobytes() != case.inputs[name].tobytes(), name  # the call did write it


def _lines(report):
    return [line for r in report.results if r.status == "FAIL" for line in r.lines]


def test_an_output_sharing_memory_with_an_input_fails():
    """The values are right, but the caller's next store into the cache would change key: the spec gives each output
    its own memory."""
    from kvcache_op.validation.cases import Seq, build

    case = build("one", [Seq(2, 3)], heads=2, head_dim=8, t1="float16")
    outcome = CallableBackend({"KeyValueCache": planted_backends.key_viewing_the_cache}, "planted").run(
        "KeyValueCache", copies(case.inputs), case.attributes)
    assert outcome.changed_inputs == ("key: the backend's output shares memory with input cache; the spec gives each "
                                      "output its own memory",)
    assert CallableBackend({"KeyValueCache": planted_backends.correct}, "correct").run(
        "KeyValueCache", copies(case.inputs), case.attributes).changed_inputs == ()


def test_a_backend_writing_an_earlier_calls_cache_fails(all_vectors):
    report = validate(all_vectors, planted_backends.writes_into_an_earlier_cache)
    assert len(_failed(report)) > 10
    assert all("changed the cache of an earlier call" in line for line in _lines(report))


def test_a_backend_reusing_its_output_buffers_fails():
    """Two calls of one shape: the second returns the first's output buffers, which the caller still holds (and may
    write: the kit's own tests do, and that is no finding)."""
    from kvcache_op.validation.cases import Seq, build

    backend = CallableBackend({"KeyValueCache": planted_backends.reuses_its_output_buffers}, "planted")
    first, second = (build(name, [Seq(2, 3), Seq(0, 1)], heads=2, head_dim=8, t1="float32") for name in "ab")
    assert backend.run("KeyValueCache", copies(first.inputs), first.attributes).changed_inputs == ()
    assert backend.run("KeyValueCache", copies(second.inputs), second.attributes).changed_inputs == (
        "key: the backend returned memory that an earlier call's output key still holds",
        "value: the backend returned memory that an earlier call's output value still holds")


def test_outputs_may_share_memory_only_where_the_specs_allow():
    """Outputs may not overlap each other nor the inputs an op writes or reads while writing; KeyCacheRotaryShift's
    slots_out may be its slots input (only the cache and scale are written)."""
    from kvcache_op.validation.outcome import shared_memory

    buffer, cache = np.zeros((4, 2, 8), np.float32), np.zeros((8, 1, 2, 2, 8), np.float32)
    assert shared_memory("KeyValueCache", {"cache": cache}, {"key": buffer, "value": buffer[1:]}) == (
        "key: the backend's output shares memory with output value; the spec gives each output its own memory",)
    slots = np.arange(3)
    assert shared_memory("KeyCacheRotaryShift", {"cache": cache, "slots": slots}, {"slots_out": slots}) == ()
    assert shared_memory("KeyCacheRotaryShift", {"cache": cache}, {"slots_out": cache.reshape(-1)[:3]}) == (
        "slots_out: the backend's output shares memory with input cache; the spec gives each output its own memory",)
    assert shared_memory("MultiHeadAttention", {"query": buffer}, {"attention_output": buffer}) == ()
