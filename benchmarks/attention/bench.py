"""Benchmark of MultiHeadAttention: the op vs the same attention built from standard ONNX ops over the packed
batch with a dense block-diagonal mask, both in ONNX Runtime's CPU EP, side by side in one run.

The baseline is what a graph without the op must do: Transpose, MatMul(Q, K^T) over all ``T x sum(KV)``
query/key pairs of the batch, Mul by the scale, Add a dense ``(T, sum(KV))`` mask (0 / -inf, block
diagonal, causal inside each block), Softmax, MatMul with V, Transpose. Per shape: warm-up, then two rounds that
each take the median of repeats of every method in turn; every method (the op and the baselines alike) keeps its
better round. The sessions' thread pools do not spin between runs (they take turns).

Peak memory is **measured**: each (shape, method) runs in a fresh subprocess that builds the inputs, resets
the kernel's peak-RSS counter (``/proc/self/clear_refs``), creates the session, runs it twice, and reports
``VmHWM - VmRSS before``: the extra resident memory the session and its run needed (the inputs, the dense
mask among them, and the output excluded; modules and the library are loaded before, by a tiny run). The bytes of the dense mask and of one ``(H, T, sum(KV))`` score tensor are reported
beside it, computed.

    python -m kvcache_op.benchmarks.attention.bench --out benchmarks/attention
"""

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys

import numpy as np

from ...arguments import OneLineParser, at_least, out_folder

from ..bound_session import NO_SPINNING, aligned_empty, bound_run
from ..environment import recorded_command
from ..timing import cpu_device, median_seconds


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    seqlen: int
    kvlen: int
    heads: int
    head_dim: int = 128
    dtype: str = "float32"

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen

    @property
    def kv_tokens(self) -> int:
        return self.batch * self.kvlen


SHAPES = [Shape("decode", 64, 1, 1024, 8), Shape("decode", 64, 1, 1024, 8, dtype="float16"),
          Shape("decode", 64, 1, 1024, 32, dtype="float16"),
          Shape("prefill", 4, 512, 512, 8), Shape("prefill", 4, 512, 512, 8, dtype="float16"),
          Shape("prefill", 4, 512, 512, 32, dtype="float16")]
#: --quick: the same mix, tiny (a smoke run of the tool, not a measurement).
QUICK_SHAPES = [Shape("decode", 4, 1, 32, 2, head_dim=16), Shape("prefill", 2, 16, 16, 2, head_dim=16, dtype="float16")]


def make_inputs(shape: Shape, seed: int = 0) -> dict:
    """The op's inputs: every sequence decodes (``decoding_batches = B``) when seqlen is 1, else a causal
    prefill of its whole prompt."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(shape.dtype)

    def data(rows):
        return rng.standard_normal((rows, shape.heads, shape.head_dim), dtype=np.float32).astype(dtype, copy=False)

    return {
        "query": data(shape.tokens), "key": data(shape.kv_tokens), "value": data(shape.kv_tokens),
        "seqstarts": np.arange(shape.batch + 1, dtype=np.int64) * shape.seqlen,
        "kvstarts": np.arange(shape.batch + 1, dtype=np.int64) * shape.kvlen,
        "decoding_batches": np.array(shape.batch if shape.seqlen == 1 else 0, np.int64),
        "max_seqlen": np.array(shape.seqlen, np.int64), "max_kvlen": np.array(shape.kvlen, np.int64),
    }


def dense_mask(shape: Shape, inputs: dict) -> np.ndarray:
    """The additive ``(T, sum(KV))`` mask of the baseline: 0 where the op's semantics let a query see a key
    (same sequence, key position <= query position), -inf elsewhere."""
    from ...manager.masks import block_diagonal_causal_mask

    query_positions = np.tile(np.arange(shape.seqlen) + (shape.kvlen - shape.seqlen), shape.batch)
    key_positions = np.tile(np.arange(shape.kvlen), shape.batch)
    visible = block_diagonal_causal_mask(inputs["seqstarts"], inputs["kvstarts"], query_positions, key_positions)
    return np.where(visible, 0.0, -np.inf).astype(shape.dtype)


def dense_model(shape: Shape):
    """The attention of the packed batch from standard ONNX ops (opset 21)."""
    import onnx
    from onnx import helper

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(shape.dtype))
    scale = onnx.numpy_helper.from_array(np.array(1 / np.sqrt(shape.head_dim), shape.dtype), "scale")
    nodes = [
        helper.make_node("Transpose", ["query"], ["q"], perm=[1, 0, 2]),  # (H, T, Dh)
        helper.make_node("Transpose", ["key"], ["kt"], perm=[1, 2, 0]),  # (H, Dh, KV)
        helper.make_node("Transpose", ["value"], ["v"], perm=[1, 0, 2]),  # (H, KV, Dh)
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),  # (H, T, KV)
        helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
        helper.make_node("Add", ["scaled", "mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["o"]),  # (H, T, Dh)
        helper.make_node("Transpose", ["o"], ["attention_output"], perm=[1, 0, 2]),
    ]
    data = ["t", shape.heads, shape.head_dim]
    inputs = [helper.make_tensor_value_info("query", elem, data),
              helper.make_tensor_value_info("key", elem, ["kv", shape.heads, shape.head_dim]),
              helper.make_tensor_value_info("value", elem, ["kv", shape.heads, shape.head_dim]),
              helper.make_tensor_value_info("mask", elem, ["t", "kv"])]
    graph = helper.make_graph(nodes, "dense_attention", inputs,
                              [helper.make_tensor_value_info("attention_output", elem, data)], initializer=[scale])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def batched_mask(shape: Shape) -> np.ndarray:
    """The ``(seqlen, kvlen)`` causal mask every sequence shares when all have the same lengths (queries at the
    last ``seqlen`` positions): what the batched baseline adds to its scores."""
    query_positions = np.arange(shape.seqlen)[:, None] + (shape.kvlen - shape.seqlen)
    return np.where(np.arange(shape.kvlen)[None, :] <= query_positions, 0.0, -np.inf).astype(shape.dtype)


def batched_model(shape: Shape):
    """Per-sequence attention from standard ONNX ops (opset 21) with the batch as a leading axis: what a user
    can write when every sequence has the same seqlen and kvlen (as in these shapes; a dynamic batch in
    serving has no such luck, and then only the dense mask is left)."""
    import onnx
    from onnx import helper

    b, s, k, h, d = shape.batch, shape.seqlen, shape.kvlen, shape.heads, shape.head_dim
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(shape.dtype))
    constants = [onnx.numpy_helper.from_array(np.array(1 / np.sqrt(d), shape.dtype), "scale"),
                 onnx.numpy_helper.from_array(np.array([b, s, h, d], np.int64), "q_shape"),
                 onnx.numpy_helper.from_array(np.array([b, k, h, d], np.int64), "kv_shape"),
                 onnx.numpy_helper.from_array(np.array([b * s, h, d], np.int64), "out_shape")]
    nodes = [
        helper.make_node("Reshape", ["query", "q_shape"], ["q4"]),
        helper.make_node("Transpose", ["q4"], ["q"], perm=[0, 2, 1, 3]),  # (B, H, S, Dh)
        helper.make_node("Reshape", ["key", "kv_shape"], ["k4"]),
        helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),  # (B, H, Dh, K)
        helper.make_node("Reshape", ["value", "kv_shape"], ["v4"]),
        helper.make_node("Transpose", ["v4"], ["v"], perm=[0, 2, 1, 3]),  # (B, H, K, Dh)
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),  # (B, H, S, K)
        helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
        helper.make_node("Add", ["scaled", "mask"], ["masked"]),  # (S, K) broadcast
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["o"]),  # (B, H, S, Dh)
        helper.make_node("Transpose", ["o"], ["o4"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["o4", "out_shape"], ["attention_output"]),
    ]
    inputs = [helper.make_tensor_value_info("query", elem, [b * s, h, d]),
              helper.make_tensor_value_info("key", elem, [b * k, h, d]),
              helper.make_tensor_value_info("value", elem, [b * k, h, d]),
              helper.make_tensor_value_info("mask", elem, [s, k])]
    graph = helper.make_graph(nodes, "batched_attention", inputs,
                              [helper.make_tensor_value_info("attention_output", elem, [b * s, h, d])],
                              initializer=constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


#: The methods measured: the op, and what a user would otherwise run.
METHODS = ("op", "dense", "batched")


def method_feeds(method: str, shape: Shape, inputs: dict) -> dict:
    """The inputs ``method`` is given: the op's own, or query/key/value and the dense mask ("dense") or the
    per-sequence mask ("batched")."""
    if method == "op":
        return inputs
    mask = dense_mask(shape, inputs) if method == "dense" else batched_mask(shape)
    return {"query": inputs["query"], "key": inputs["key"], "value": inputs["value"], "mask": mask}


def runner(method: str, shape: Shape, feeds: dict, threads: int):
    """(run, output) of ``method`` on ``feeds`` (from :func:`method_feeds`)."""
    from ... import spec

    query = feeds["query"]
    model = {"op": lambda: spec.make_attention_model(feeds, num_heads=shape.heads, head_dim=shape.head_dim),
             "dense": lambda: dense_model(shape), "batched": lambda: batched_model(shape)}[method]()
    out = aligned_empty(query.shape, query.dtype)
    return bound_run(model, feeds, {"attention_output": out}, threads, NO_SPINNING), out


def _proc_status_kib(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def probe_memory(method: str, shape: Shape, threads: int) -> int:
    """Extra peak resident bytes of creating and running ``method`` once more than the inputs (this process)."""
    feeds = method_feeds(method, shape, make_inputs(shape))  # inputs, the dense mask included, come first
    tiny = QUICK_SHAPES[0]
    runner(method, tiny, method_feeds(method, tiny, make_inputs(tiny)), threads)[0]()  # imports, library loaded
    before = _proc_status_kib("VmRSS")
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    run, out = runner(method, shape, feeds, threads)
    run()
    run()
    return (_proc_status_kib("VmHWM") - before) * 1024 - out.nbytes


def measured_peak(method: str, shape: Shape, threads: int) -> int:
    """:func:`probe_memory` in a fresh interpreter, so no allocator state is shared between measurements."""
    done = subprocess.run([sys.executable, "-m", "kvcache_op.benchmarks.attention.bench", "--probe", method,
                           json.dumps(dataclasses.asdict(shape)), "--threads", str(threads)],
                          capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def bench(args) -> list:
    rows = []
    for shape in QUICK_SHAPES if args.quick else SHAPES:
        inputs = make_inputs(shape)
        runs = {m: runner(m, shape, method_feeds(m, shape, inputs), args.threads) for m in METHODS}
        # Two rounds, each method measured around the others; every method keeps its better median.
        seconds = {m: median_seconds(runs[m][0], args.warmup, args.repeats) for m in METHODS}
        seconds = {m: min(seconds[m], median_seconds(runs[m][0], 0, args.repeats)) for m in METHODS}
        element = np.dtype(shape.dtype).itemsize
        op_out = runs["op"][1].astype(np.float32)
        difference = max(float(np.max(np.abs(op_out - runs[m][1].astype(np.float32)))) for m in METHODS[1:])
        row = {**dataclasses.asdict(shape), "threads": args.threads,
               **{f"{m}_ms": seconds[m] * 1e3 for m in METHODS},
               "speedup": seconds["dense"] / seconds["op"], "speedup_batched": seconds["batched"] / seconds["op"],
               "max_abs_difference": difference, "mask_bytes": shape.tokens * shape.kv_tokens * element,
               "score_tensor_bytes": shape.heads * shape.tokens * shape.kv_tokens * element,
               **{f"{m}_peak_bytes": None for m in METHODS}}
        del runs, op_out, inputs
        if not args.no_memory:
            for m in METHODS:
                row[f"{m}_peak_bytes"] = measured_peak(m, shape, args.threads)
        rows.append(row)
        print(f"{shape.name:8s} B={shape.batch} seqlen={shape.seqlen} kvlen={shape.kvlen} H={shape.heads} "
              f"{shape.dtype}: op {row['op_ms']:9.3f} ms | dense {row['dense_ms']:9.3f} ms ({row['speedup']:.1f}x) | "
              f"batched {row['batched_ms']:9.3f} ms ({row['speedup_batched']:.2f}x) | peak MiB op "
              f"{_mib(row['op_peak_bytes'])} dense {_mib(row['dense_peak_bytes'])} batched "
              f"{_mib(row['batched_peak_bytes'])} | max |difference| {difference:.2e}", flush=True)
    return rows


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def write_results(rows, out: pathlib.Path, command: str, device: str) -> None:
    """Writes results.json and results.md (table + command + how memory was measured)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": command, "device": device, "rows": rows}, indent=1))
    lines = [f"# MultiHeadAttention benchmark ({device})", "", f"Command: `{command}`", "",
             "`op`: opmx.dynamic_batching::MultiHeadAttention in ONNX Runtime's CPU EP. `dense`: the same attention "
             "from standard ONNX ops over the packed batch with a dense block-diagonal causal mask (Transpose, "
             "MatMul, Mul, Add, Softmax, MatMul, Transpose) — what a dynamic batch of any lengths needs without "
             "the op. `batched`: standard ops with the batch as a leading axis and one shared (seqlen, kvlen) "
             "mask — possible only because every sequence of these shapes has the same lengths. All in ONNX "
             "Runtime with the same intra_op_num_threads, inputs and output bound once (IOBinding); times are "
             "medians of repeats, two rounds with the methods side by side, each method's better median kept.",
             "",
             "Peak memory is measured: the extra resident memory (peak RSS, `VmHWM`, after resetting it, minus RSS "
             "before the session) of creating the session and running it, in a fresh process per cell, inputs "
             "(the masks among them) and output excluded. `mask` and `scores` are computed: the dense mask the "
             "dense baseline needs as an input, and one (H, T, sum KV) score tensor of its intermediates.", "",
             "| shape | dtype | H | threads | op ms | dense ms | vs dense | batched ms | vs batched | op peak MiB | "
             "dense peak MiB | batched peak MiB | mask MiB | scores MiB | max abs difference |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['name']} B={r['batch']} seqlen={r['seqlen']} kvlen={r['kvlen']} | {r['dtype']} | "
                     f"{r['heads']} | {r['threads']} | {r['op_ms']:.2f} | {r['dense_ms']:.2f} | {r['speedup']:.1f}x | "
                     f"{r['batched_ms']:.2f} | {r['speedup_batched']:.2f}x | {_mib(r['op_peak_bytes'])} | "
                     f"{_mib(r['dense_peak_bytes'])} | {_mib(r['batched_peak_bytes'])} | "
                     f"{r['mask_bytes'] / 2**20:.1f} | {r['score_tensor_bytes'] / 2**20:.1f} | "
                     f"{r['max_abs_difference']:.1e} |")
    lines += ["", summary(rows)]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def summary(rows) -> str:
    """One paragraph: the speed-up ranges and the largest peak memory of each method, per shape kind."""
    parts = []
    for name in dict.fromkeys(r["name"] for r in rows):
        group = [r for r in rows if r["name"] == name]
        dense = [r["speedup"] for r in group]
        batched = [r["speedup_batched"] for r in group]
        part = (f"{name}: the op is {min(dense):.1f}x to {max(dense):.1f}x faster than the dense-mask baseline and "
                f"{min(batched):.2f}x to {max(batched):.2f}x the speed of the equal-length batched one")
        if group[0]["op_peak_bytes"] is not None:
            peak = {m: max(r[f"{m}_peak_bytes"] for r in group) / 2**20 for m in METHODS}
            part += (f", with at most {peak['op']:.1f} MiB of peak memory against {peak['dense']:.0f} MiB (dense) "
                     f"and {peak['batched']:.0f} MiB (batched)")
        parts.append(part)
    return "Summary: " + "; ".join(parts) + "."


def main(argv=None, prog: str = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=at_least(1), default=2, help="intra_op_num_threads of both sessions")
    parser.add_argument("--warmup", type=at_least(0), default=2)
    parser.add_argument("--repeats", type=at_least(1), default=7)
    parser.add_argument("--out", type=out_folder, help="folder for results.md/json")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: checks the tool runs, measures nothing")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--probe", nargs=2, metavar=("METHOD", "SHAPE_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:  # one memory measurement, in this fresh process
        print(probe_memory(args.probe[0], Shape(**json.loads(args.probe[1])), args.threads))
        return 0
    command = recorded_command("kvcache_op.benchmarks.attention.bench", argv)
    rows = bench(args)
    if args.out:
        write_results(rows, args.out, command, cpu_device())
        print(f"wrote {args.out}/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
