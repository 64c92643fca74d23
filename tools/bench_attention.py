"""Benchmark of MultiHeadAttention: the op vs the same attention built from standard ONNX ops over the packed
batch with a dense block-diagonal mask, both in ONNX Runtime's CPU EP, side by side in one run.

The baseline is what a graph without the op must do: Transpose, MatMul(Q, K^T) over all ``T x sum(KV)``
query/key pairs of the batch, Mul by the scale, Add a dense ``(T, sum(KV))`` mask (0 / -inf, block
diagonal, causal inside each block), Softmax, MatMul with V, Transpose. Per shape: warm-up, then the median
of repeats of each; the op is measured before and after the baseline and its better median is kept.

Peak memory is **measured**: each (shape, method) runs in a fresh subprocess that builds the inputs, resets
the kernel's peak-RSS counter (``/proc/self/clear_refs``), creates the session, runs it twice, and reports
``VmHWM - VmRSS before``: the extra resident memory the session and its run needed (the inputs, the dense
mask among them, and the output excluded; modules and the library are loaded before, by a tiny run). The bytes of the dense mask and of one ``(H, T, sum(KV))`` score tensor are reported
beside it, computed.

    python -m kvcache_op.tools.bench_attention --out benchmarks/attention
"""

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys

import numpy as np

from .bench_kvcache import cpu_device, median_seconds


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
    from ..manager.masks import block_diagonal_causal_mask

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


def bound_runner(model, feeds: dict, out_shape, dtype, threads: int):
    """A zero-overhead call: inputs and the output bound once as OrtValues, then run_with_iobinding.
    Returns (run, output array)."""
    import onnxruntime as ort

    from ..ort_ops import make_session

    session = make_session(model, intra_op_num_threads=threads)
    binding = session.io_binding()
    keep = []
    for info in session.get_inputs():
        value = ort.OrtValue.ortvalue_from_numpy(feeds[info.name])
        keep.append(value)
        binding.bind_ortvalue_input(info.name, value)
    out = np.empty(out_shape, dtype)
    binding.bind_output("attention_output", "cpu", 0, out.dtype, list(out.shape), out.ctypes.data)

    def run():
        session.run_with_iobinding(binding)

    run.keep = keep
    return run, out


def method_feeds(method: str, shape: Shape, inputs: dict) -> dict:
    """The inputs ``method`` ("op" or "dense") is given: the op's own, or query/key/value and the dense mask."""
    if method == "op":
        return inputs
    return {"query": inputs["query"], "key": inputs["key"], "value": inputs["value"], "mask": dense_mask(shape, inputs)}


def runner(method: str, shape: Shape, feeds: dict, threads: int):
    """(run, output) of ``method`` on ``feeds`` (from :func:`method_feeds`)."""
    from .. import spec

    query = feeds["query"]
    model = (spec.make_attention_model(feeds, num_heads=shape.heads, head_dim=shape.head_dim) if method == "op"
             else dense_model(shape))
    return bound_runner(model, feeds, query.shape, query.dtype, threads)


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
    done = subprocess.run([sys.executable, "-m", "kvcache_op.tools.bench_attention", "--probe", method,
                           json.dumps(dataclasses.asdict(shape)), "--threads", str(threads)],
                          capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def bench(args) -> list:
    rows = []
    for shape in QUICK_SHAPES if args.quick else SHAPES:
        inputs = make_inputs(shape)
        op, op_out = runner("op", shape, method_feeds("op", shape, inputs), args.threads)
        dense, dense_out = runner("dense", shape, method_feeds("dense", shape, inputs), args.threads)
        op_s = median_seconds(op, args.warmup, args.repeats)
        dense_s = median_seconds(dense, args.warmup, args.repeats)
        op_s = min(op_s, median_seconds(op, 0, args.repeats))  # the op measured around the baseline
        element = np.dtype(shape.dtype).itemsize
        difference = float(np.max(np.abs(op_out.astype(np.float32) - dense_out.astype(np.float32))))
        row = {**dataclasses.asdict(shape), "threads": args.threads, "op_ms": op_s * 1e3, "dense_ms": dense_s * 1e3,
               "speedup": dense_s / op_s, "max_abs_difference": difference,
               "mask_bytes": shape.tokens * shape.kv_tokens * element,
               "score_tensor_bytes": shape.heads * shape.tokens * shape.kv_tokens * element,
               "op_peak_bytes": None, "dense_peak_bytes": None}
        del op, dense, op_out, dense_out, inputs
        if not args.no_memory:
            row["op_peak_bytes"] = measured_peak("op", shape, args.threads)
            row["dense_peak_bytes"] = measured_peak("dense", shape, args.threads)
        rows.append(row)
        print(f"{shape.name:8s} B={shape.batch} seqlen={shape.seqlen} kvlen={shape.kvlen} H={shape.heads} "
              f"{shape.dtype}: op {row['op_ms']:9.3f} ms | dense {row['dense_ms']:9.3f} ms | speed-up "
              f"{row['speedup']:6.1f}x | peak MiB op {_mib(row['op_peak_bytes'])} dense "
              f"{_mib(row['dense_peak_bytes'])} | max |op - dense| {difference:.2e}", flush=True)
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
             "MatMul, Mul, Add, Softmax, MatMul, Transpose), also in ONNX Runtime. Both with the same "
             "intra_op_num_threads, inputs and output bound once (IOBinding); times are medians of repeats "
             "measured side by side in one run.", "",
             "Peak memory is measured: the extra resident memory (peak RSS, `VmHWM`, after resetting it, minus RSS "
             "before the session) of creating the session and running it, in a fresh process per cell, inputs "
             "(the dense mask among them) and output excluded. `mask` and `scores` are computed: the dense mask the baseline needs as an "
             "input, and one (H, T, sum KV) score tensor of its intermediates.", "",
             "| shape | dtype | H | threads | op ms | dense ms | speed-up | op peak MiB | dense peak MiB | mask MiB | "
             "scores MiB | max abs(op - dense) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['name']} B={r['batch']} seqlen={r['seqlen']} kvlen={r['kvlen']} | {r['dtype']} | "
                     f"{r['heads']} | {r['threads']} | {r['op_ms']:.2f} | {r['dense_ms']:.2f} | {r['speedup']:.1f}x | "
                     f"{_mib(r['op_peak_bytes'])} | {_mib(r['dense_peak_bytes'])} | {r['mask_bytes'] / 2**20:.1f} | "
                     f"{r['score_tensor_bytes'] / 2**20:.1f} | {r['max_abs_difference']:.1e} |")
    lines += ["", summary(rows)]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def summary(rows) -> str:
    """One paragraph: the speed-up range and the largest peak memory of each method, per shape kind."""
    parts = []
    for name in dict.fromkeys(r["name"] for r in rows):
        group = [r for r in rows if r["name"] == name]
        speedups = [r["speedup"] for r in group]
        part = f"{name}: the op is {min(speedups):.1f}x to {max(speedups):.1f}x faster"
        peaks = [(r["op_peak_bytes"], r["dense_peak_bytes"]) for r in group if r["op_peak_bytes"] is not None]
        if peaks:
            part += (f", with at most {max(p[0] for p in peaks) / 2**20:.1f} MiB of peak memory against "
                     f"{max(p[1] for p in peaks) / 2**20:.0f} MiB for the dense baseline")
        parts.append(part)
    return "Summary: " + "; ".join(parts) + "."


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="intra_op_num_threads of both sessions")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=pathlib.Path, help="folder for results.md/json")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: checks the tool runs, measures nothing")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--probe", nargs=2, metavar=("METHOD", "SHAPE_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:  # one memory measurement, in this fresh process
        print(probe_memory(args.probe[0], Shape(**json.loads(args.probe[1])), args.threads))
        return 0
    command = "python -m kvcache_op.tools.bench_attention " + " ".join(argv)
    rows = bench(args)
    if args.out:
        write_results(rows, args.out, command, cpu_device())
        print(f"wrote {args.out}/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
