"""The attention benchmark runs end to end (tiny shapes), writes its table and data, and its baseline — the
dense-mask attention from standard ONNX ops — computes the op's semantics."""

import json

import numpy as np
import pytest

from kvcache_op.cli import main
from kvcache_op.reference import attention_tolerance
from kvcache_op.benchmarks.attention import bench as bench_attention


def test_quick_run_writes_results_with_measured_memory(tmp_path, capsys):
    assert bench_attention.main(["--quick", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["rows"]) == len(bench_attention.QUICK_SHAPES)
    for row in data["rows"]:
        assert row["op_ms"] > 0 and row["dense_ms"] > 0 and row["batched_ms"] > 0 and row["speedup"] > 0
        assert all(row[f"{m}_peak_bytes"] is not None for m in bench_attention.METHODS)
        assert row["mask_bytes"] == row["batch"] ** 2 * row["seqlen"] * row["kvlen"] * (
            4 if row["dtype"] == "float32" else 2)
    text = (tmp_path / "results.md").read_text()
    assert "| vs dense |" in text and "| vs batched |" in text and "Summary: decode: the op is" in text
    assert "batched" in capsys.readouterr().out


def test_both_baselines_compute_the_ops_semantics():
    """Each baseline's output is within twice the spec's bound of the op's on the same inputs (decode and causal
    prefill), so the speed-ups compare equal work."""
    for shape in bench_attention.QUICK_SHAPES:
        inputs = bench_attention.make_inputs(shape)
        outputs = {}
        for method in bench_attention.METHODS:
            run, out = bench_attention.runner(method, shape, bench_attention.method_feeds(method, shape, inputs), 1)
            run()
            outputs[method] = out.astype(np.float64)
        tolerance = 2 * attention_tolerance(**inputs, num_heads=shape.heads, head_dim=shape.head_dim)
        for method in bench_attention.METHODS[1:]:
            assert np.all(np.abs(outputs["op"] - outputs[method]) <= tolerance), (shape, method)
        assert np.any(outputs["op"] != 0)


def test_dense_mask_is_block_diagonal_and_causal():
    shape = bench_attention.Shape("t", batch=2, seqlen=2, kvlen=3, heads=1, head_dim=4)
    mask = bench_attention.dense_mask(shape, bench_attention.make_inputs(shape))
    visible = (mask == 0).astype(int).tolist()
    # query rows: seq 0 at positions 1, 2; seq 1 at positions 1, 2; key columns: seq 0 keys 0-2, seq 1 keys 0-2
    assert visible == [[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]


def test_cli_dispatches_bench_attention(capsys):
    assert main(["bench", "attention", "--quick", "--repeats", "1", "--warmup", "0", "--no-memory"]) == 0
    assert "batched" in capsys.readouterr().out


def test_the_fused_op_benchmark_runs_and_its_baselines_compute_the_same_attention(tmp_path):
    """The fused-op benchmark (tiny shapes) writes its table and data; its split-pair and GroupQueryAttention
    baselines give the fused op's output on the same step (within twice the spec's bound), so the ratios compare
    equal work."""
    from kvcache_op import spec
    from kvcache_op.benchmarks.attention import fused
    from kvcache_op.benchmarks.bound_session import aligned_empty
    from kvcache_op.ort_ops import run_model
    from kvcache_op.reference import cache_attention_tolerance, multi_head_cache_attention

    assert fused.main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["results"]) == len(fused.QUICK_SHAPES)
    for row in data["results"]:
        assert all(t > 0 for t in row["seconds"].values()) and row["fused_vs_split"] > 0
    assert "| fused / split |" in (tmp_path / "README.md").read_text()
    command = "python -m kvcache_op.benchmarks.attention.fused --quick --out " + str(tmp_path)
    assert data["command"].endswith(command) and f"Command: `{data['command']}`" in (tmp_path / "README.md").read_text()

    shape = fused.QUICK_SHAPES[0]
    inputs, attributes = fused.make_call(shape)
    fresh = {k: (None if v is None else v.copy()) for k, v in inputs.items()}
    want = multi_head_cache_attention(**fresh, **attributes).astype(np.float64)
    bound = 2 * cache_attention_tolerance(**inputs, **attributes)
    split_inputs = {k: v.copy() for k, v in inputs.items() if v is not None}
    (split,) = run_model(fused.split_model(inputs, attributes), split_inputs)
    assert np.all(np.abs(split - want) <= bound)
    # GroupQueryAttention over the same keys: its past holds the cached positions, this step's key its last
    run = fused.gqa_run(shape, inputs)
    feeds_past = run.keep[2]
    b, k, d = shape.batch, shape.kvlen, shape.head_dim
    cached = fresh["cache"][:, 0]  # layout 0, one layer: (MaxT, 2, Hkv, D)
    for s in range(b):
        slots = fresh["cachestarts"][s, 0] + np.arange(k)
        for kv in range(2):
            feeds_past[kv][s, :, :k - 1, :] = cached[slots[:-1], kv].transpose(1, 0, 2)
    run()
    out = run.keep[1].reshape(inputs["query"].shape)
    assert np.all(np.abs(out - want) <= bound)


def test_results_name_the_cpu_model():
    from kvcache_op.benchmarks.timing import cpu_model

    intel = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\nflags\t\t: fpu avx2 avx512f\n"
    amd = "processor\t: 0\nmodel name\t: AMD EPYC 9R14 96-Core Processor\nflags\t\t: fpu avx2\n"
    assert cpu_model(intel) == "Intel(R) Xeon(R) Platinum 8488C, AVX-512"
    assert cpu_model(amd) == "AMD EPYC 9R14 96-Core Processor"
    # a hypervisor's bare brand name: the family and model tell two generations apart
    zen3 = "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2\n"
    zen5 = "processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f\n"
    assert cpu_model(zen3) == "AMD EPYC (family 25, model 1)"
    assert cpu_model(zen5) == "AMD EPYC (family 26, model 2), AVX-512"
    assert cpu_model("") != ""  # falls back to the machine type


def test_the_fused_benchmark_with_shared_pages_reads_sequence_0s_pages(tmp_path):
    """--shared-pages: decode shapes only, every sequence's page table sequence 0's but its own last page (where it
    stores), and the op still equals the reference on such a call."""
    from kvcache_op import spec
    from kvcache_op.benchmarks.attention import fused
    from kvcache_op.ort_ops import run_model
    from kvcache_op.reference import cache_attention_tolerance, multi_head_cache_attention

    assert fused.main(["--quick", "--shared-pages", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    decodes = [s for s in fused.QUICK_SHAPES if s.seqlen == 1]
    assert len(data["results"]) == len(decodes) and "shared-pages" in data["header"]
    inputs, attributes = fused.make_call(decodes[0], shared_pages=True)
    table = inputs["cachestarts"]
    assert (table[:, :-1] == table[0, :-1]).all() and len(set(table[:, -1].tolist())) == len(table)
    want = multi_head_cache_attention(**{k: (None if v is None else v.copy()) for k, v in inputs.items()}, **attributes)
    (got,) = run_model(spec.make_cache_attention_model(inputs, **attributes),
                       {k: v.copy() for k, v in inputs.items() if v is not None})
    assert np.all(np.abs(got.astype(np.float64) - want) <= 2 * cache_attention_tolerance(**inputs, **attributes))
    with pytest.raises(ValueError, match="decode shapes"):
        fused.make_call(fused.Shape(2, 8, 8, 4, 2, head_dim=16), shared_pages=True)


def test_the_fused_benchmark_sizes_pages_and_page_tables_as_asked(tmp_path):
    """--page-size and --table-context: pages of that many slots, page tables with room for that many positions
    (their columns past a sequence's pages -1), named in the header; the op still equals the reference on such a
    call."""
    from kvcache_op import spec
    from kvcache_op.benchmarks.attention import fused
    from kvcache_op.ort_ops import run_model
    from kvcache_op.reference import cache_attention_tolerance, multi_head_cache_attention

    assert fused.main(["--quick", "--page-size", "4", "--table-context", "1000", "--out", str(tmp_path)]) == 0
    header = json.loads((tmp_path / "results.json").read_text())["header"]
    assert "pages of 4 slots, page tables with room for 1000 positions" in header
    shape = fused.QUICK_SHAPES[0]
    inputs, attributes = fused.make_call(shape, page_size=4, table_context=1000)
    table, pages = inputs["cachestarts"], -(-shape.kvlen // 4)
    assert table.shape == (shape.batch, 250) and attributes["page_size"] == 4
    assert (table[:, pages:] == -1).all() and sorted(table[:, :pages].ravel() // 4) == list(range(shape.batch * pages))
    want = multi_head_cache_attention(**{k: (None if v is None else v.copy()) for k, v in inputs.items()}, **attributes)
    (got,) = run_model(spec.make_cache_attention_model(inputs, **attributes),
                       {k: v.copy() for k, v in inputs.items() if v is not None})
    assert np.all(np.abs(got.astype(np.float64) - want) <= 2 * cache_attention_tolerance(**inputs, **attributes))


def test_the_fused_benchmark_runs_each_round_in_an_order_of_its_own(monkeypatch):
    """A method's place in a round and the method before it tilt its time (one build run twice in a fixed order
    measured 1.00-1.10x apart), so the rounds do not repeat one order: every method runs once a round, and the
    rounds' orders differ."""
    from kvcache_op.benchmarks.attention import fused
    from kvcache_op.ort_ops import library_path

    calls = []
    real = fused.median_seconds

    def recording(run, warmup, repeats):
        calls.append(run)
        return real(run, warmup=0, repeats=1)

    monkeypatch.setattr(fused, "median_seconds", recording)
    rounds = 6
    fused.measure(fused.QUICK_SHAPES[0], rounds, 1, against=library_path())
    methods = len(calls) // rounds
    assert methods == 5 and len(calls) == rounds * methods  # fused, split, other build, GQA, copy
    orders = [tuple(id(run) for run in calls[r * methods:(r + 1) * methods]) for r in range(rounds)]
    assert all(len(set(order)) == methods for order in orders) and len({frozenset(o) for o in orders}) == 1
    assert len(set(orders)) > 1, "every round ran the methods in one order"
    assert len({order[0] for order in orders}) > 1, "one method always ran first"


def test_the_fused_benchmark_runs_another_build_beside_this_one(tmp_path, capsys):
    """--against LIBRARY: the other build's fused op runs in the same rounds, its time and ratio are in the table
    and data, and whether its outputs equal this build's bit for bit (the same build here, so they must)."""
    from kvcache_op.benchmarks.attention import fused
    from kvcache_op.ort_ops import library_path

    assert fused.main(["--quick", "--against", library_path(), "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert library_path() in data["header"]
    for row in data["results"]:
        assert row["seconds"]["against"] > 0 and row["fused_vs_against"] > 0
        assert row["equal_to_other_build"] is True
    table = (tmp_path / "README.md").read_text()
    assert "| fused / other build |" in table and table.count("bit for bit equal") == len(fused.QUICK_SHAPES)
    row = dict(data["results"][0], equal_to_other_build=False)
    assert "| differ |" in fused.report([row], "header")


@pytest.mark.parametrize("content", [None, b"not a shared library"])
def test_the_fused_benchmark_refuses_an_other_build_it_cannot_load(tmp_path, capsys, content):
    from kvcache_op.benchmarks.attention import fused

    path = tmp_path / "libother.so"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        fused.main(["--quick", "--against", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--against" in err and str(path) in err
