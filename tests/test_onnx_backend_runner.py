"""The vectors run by ONNX's own backend-test machinery (onnx.backend.test's Runner) with the kit's Backend:
every case passes with the reference, and the runner still sees the cache after the call and the calls that
must fail."""

import io
import unittest

import planted_backends
from kvcache_op.validation import vectors
from kvcache_op.validation.onnx_backend import Backend, ConformanceRunner


def run(backend, directory):
    """(tests run, {test name: last line of its failure}, skipped) of the runner's suite."""
    runner = ConformanceRunner(backend, directory, __name__)
    result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(runner.test_suite)
    failed = {test.id().rsplit(".", 1)[-1]: trace.strip().splitlines()[-1] for test, trace in result.failures + result.errors}
    return result.testsRun, failed, len(result.skipped)


def validate_lines(directory, backend, name):
    """What ``kvcache-op validate`` says about one case."""
    from kvcache_op.validation.validate import compare_case

    return compare_case(directory / vectors.folder_name(name), backend)


def test_every_case_passes_with_the_reference(all_vectors):
    ran, failed, skipped = run(Backend, all_vectors)
    assert failed == {}
    assert ran == 2 * len(vectors.ALL_CASES) and skipped == len(vectors.ALL_CASES)  # the _cuda twins are skipped


def test_a_cache_only_bug_fails_through_the_runner(all_vectors):
    """The outputs are right; only the cache after the call differs (output 2 of the models)."""
    ran, failed, _ = run(Backend.using(planted_backends.clobbers_last_slot), all_vectors)
    assert "test_offset_layout0_cpu" in failed and "test_int8_layout1_cpu" in failed
    assert set(failed) <= {vectors.folder_name(n) + "_cpu" for n in vectors.CASES}  # valid KV cases only
    lines = validate_lines(all_vectors, planted_backends.clobbers_last_slot, "offset_layout0")
    assert [line.split(":")[0] for line in lines] == ["cache"]


def test_an_accepted_invalid_call_and_a_wrong_output_fail_through_the_runner(all_vectors):
    _, failed, _ = run(Backend.using(planted_backends.no_bounds_checks), all_vectors)
    assert "AssertionError: the backend accepted an invalid call; expected an error (the reference: cachestarts[1, 0]" \
        in failed["test_error_paged_sentinel_minus_one_cpu"]
    _, failed, _ = run(Backend.using(planted_backends.gqa_tiled), all_vectors)
    assert {"test_gqa_repeat2_cpu", "test_decode_batch_int8_gqa_cpu"} <= set(failed)


def test_a_backend_writing_a_read_only_input_fails_through_the_runner(all_vectors):
    """The runner compares outputs and the cache only: a start_pos written by the backend is caught by the Backend,
    as validate catches it."""
    _, failed, _ = run(Backend.using(planted_backends.shifts_start_pos), all_vectors)
    assert "test_offset_layout0_cpu" in failed and "test_paged_layout0_cpu" in failed
    assert failed["test_offset_layout0_cpu"].startswith(
        "AssertionError: start_pos: the backend changed this read-only input"), failed["test_offset_layout0_cpu"]


def test_ops_the_backend_lacks_are_skipped_and_the_declared_device_runs(all_vectors, tmp_path):
    vectors.write_conformance(tmp_path / "some", ["mha_batch0", "offset_layout0"], progress=None)
    ran, failed, skipped = run(Backend.using(planted_backends.correct, device="CUDA"), tmp_path / "some")
    assert (ran, failed, skipped) == (4, {}, 3)  # both _cpu tests, and the attention case's _cuda test
