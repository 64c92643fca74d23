"""Benchmark of the KeyValueCache op: bytes moved, GB/s, and ratios measured side by side in one run.

Per case (shape, paged or offset cache, quant_bit, layout): the ORT op (CPU EP, intra_op_num_threads 1 and 2),
``numpy.copyto`` of the same number of bytes (a copy of N bytes moves 2N: it reads N and writes N, so the
baseline copies half the op's traffic), the numpy reference, and (unquantized) the same step from ONNX
Runtime's built-in ops (:mod:`kvcache_op.tools.standard_ops_baseline`: ScatterND + Gather paged, TensorScatter +
Gather offset). Each case is measured in ``--rounds`` rounds that time the op, the copy and the baseline side
by side (each the median of ``--repeats`` calls after a warm-up); the table shows the medians over rounds.

    python -m kvcache_op.tools.bench_kvcache --out benchmarks/cpu

``--device cuda`` runs the CUDA benchmark instead (:mod:`kvcache_op.tools.bench_kvcache_cuda`).
"""

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np

from .bound_session import aligned_copy, aligned_empty, bound_run
from .standard_ops_baseline import (LAYOUTS, OFFSET_LAYOUTS, baseline_runner, offset_baseline_runner,
                                    tensor_scatter_available)


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    seqlen: int
    start_pos: int
    heads: int = 8
    head_dim: int = 128
    page_size: int = 64


SHAPES = [Shape("decode", 64, 1, 1023), Shape("prefill", 4, 512, 0)]
#: --quick: the same mix, tiny (a smoke run of the tool, not a measurement).
QUICK_SHAPES = [Shape("decode", 4, 1, 63, heads=2, head_dim=32, page_size=16),
                Shape("prefill", 2, 32, 0, heads=2, head_dim=32, page_size=16)]


def make_indices(shape: Shape, rng, cache_mode: int = 1) -> dict:
    """The six index inputs of one call. Paged (cache_mode 1): every sequence owns its pages, in a page table
    shuffled by ``rng``; ``cachestarts`` holds each page's first slot, so the cache needs
    ``cachestarts.size * page_size`` slots. Offset (cache_mode 0): sequence b owns the ``MaxS`` slots from
    ``b * MaxS`` (MaxS: kvlen rounded up to a page), so the cache needs ``batch * MaxS`` slots."""
    kvlen = shape.start_pos + shape.seqlen
    pages_per_seq = -(-kvlen // shape.page_size)
    if cache_mode == 1:
        pages = shape.batch * pages_per_seq
        table = rng.permutation(pages).reshape(shape.batch, pages_per_seq).astype(np.int64) * shape.page_size
    else:
        table = np.arange(shape.batch, dtype=np.int64) * pages_per_seq * shape.page_size
    return {
        "seqstarts": np.arange(shape.batch + 1, dtype=np.int64) * shape.seqlen,
        "kvstarts": np.arange(shape.batch + 1, dtype=np.int64) * kvlen,
        "cachestarts": table,
        "start_pos": np.full(shape.batch, shape.start_pos, np.int64),
        "max_seqlen": np.array(shape.seqlen, np.int64),
        "max_kvlen": np.array(kvlen, np.int64),
    }


def make_inputs(shape: Shape, quant_bit: int, layout: int, seed: int = 0, cache_mode: int = 1):
    """Inputs of one call (:func:`make_indices`), float16 values, int8 codes with float16 scales; the tensors
    start on cache lines, as ONNX Runtime places its own buffers."""
    from ..reference import cache_shape

    rng = np.random.default_rng(seed)
    indices = make_indices(shape, rng, cache_mode)
    tokens = shape.batch * shape.seqlen
    cache_dtype = np.int8 if quant_bit else np.float16
    max_t = indices["cachestarts"].size * shape.page_size if cache_mode == 1 else (
        shape.batch * -(-(shape.start_pos + shape.seqlen) // shape.page_size) * shape.page_size)
    current_key = rng.standard_normal((tokens, shape.heads, shape.head_dim)).astype(np.float16)
    current_value = rng.standard_normal((tokens, shape.heads, shape.head_dim)).astype(np.float16)
    inputs = {
        "current_key": aligned_copy(current_key),
        "current_value": aligned_copy(current_value),
        **indices,
        "cache": aligned_copy(rng.integers(-127, 128, cache_shape(layout, 1, max_t, shape.heads, shape.head_dim)
                                           ).astype(cache_dtype)),
        "scale": None,
    }
    if quant_bit:
        inputs["scale"] = aligned_copy(rng.uniform(0.001, 0.02, cache_shape(layout, 1, max_t, shape.heads,
                                                                              shape.head_dim // 8)).astype(np.float16))
    return inputs


def bytes_moved_parts(shape: Shape, quant_bit: int, value_bytes: int = 2, scale_bytes: int = 2,
                      quant_group: int = 8) -> tuple:
    """(store, gather): bytes read plus bytes written by the two halves of one call (num_repeat 1), keys and
    values. Store reads the new rows and writes their cache rows (and scales); gather reads the cache rows
    (and scales) of every gathered token and writes the output rows. Index inputs are not counted.
    ``value_bytes``: element size of current_key and the outputs; the cache holds that type unquantized,
    one byte per element with quant_bit 8."""
    tokens = shape.batch * shape.seqlen
    kv_tokens = shape.batch * (shape.start_pos + shape.seqlen)
    row = shape.heads * shape.head_dim
    cache_row = row * (1 if quant_bit else value_bytes) + (row // quant_group * scale_bytes if quant_bit else 0)
    return 2 * tokens * (row * value_bytes + cache_row), 2 * kv_tokens * (cache_row + row * value_bytes)


def bytes_moved(shape: Shape, quant_bit: int) -> int:
    """Bytes read plus bytes written by one call (stores and gathers, keys and values; float16 values,
    float16 scales in groups of 8): the sum of :func:`bytes_moved_parts`."""
    return sum(bytes_moved_parts(shape, quant_bit))


def median_seconds(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def case_attrs(shape: Shape, quant_bit: int, layout: int, cache_mode: int) -> dict:
    """The op's attributes in one benchmark case (groups of 8 where quantized)."""
    return dict(quant_bit=quant_bit, quant_group=8, cache_mode=cache_mode, cache_layout=layout,
                page_size=shape.page_size)


def ort_runner(inputs, attrs, threads):
    """A zero-overhead call of the op: inputs and outputs bound once, then run_with_iobinding."""
    from .. import spec

    kv_tokens = int(inputs["kvstarts"][-1])
    out_shape = (kv_tokens, inputs["current_key"].shape[1], inputs["current_key"].shape[2])
    outputs = {name: aligned_empty(out_shape, np.float16) for name in ("key", "value")}
    return bound_run(spec.make_model(inputs, **attrs), inputs, outputs, threads)


#: (cache_mode, layouts) measured: paged in every layout; offset in layout 0 (the one TensorScatter's
#: batch-major cache matches) and layout 3.
MODES = ((1, (0, 1, 2, 3)), (0, (0, 3)))
MODE_NAMES = {0: "offset", 1: "paged"}


def standard_runner(inputs, shape: Shape, cache_mode: int, quant_bit: int, layout: int, threads: int):
    """The same step from ONNX Runtime's built-in ops (:mod:`.standard_ops_baseline`), or None where there is
    none: quantized caches (standard ops cannot quantize as the spec does), layouts it does not cover, and
    offset mode on an ONNX Runtime without TensorScatter."""
    if quant_bit:
        return None
    if cache_mode == 1:
        return baseline_runner(inputs, shape.page_size, layout, threads)[0] if layout in LAYOUTS else None
    if layout in OFFSET_LAYOUTS and tensor_scatter_available():
        return offset_baseline_runner(inputs, threads)[0]
    return None


def measure_rounds(run, copy, standard, args) -> dict:
    """``args.rounds`` rounds, each timing side by side: the op, the copy, and the standard-ops baseline with
    the op again after it (the faster of the round's two op figures counts); each figure is the median of
    ``args.repeats`` calls after ``args.warmup``."""
    rounds = {"op": [], "copy": [], "standard": []}
    for _ in range(args.rounds):
        op_s = median_seconds(run, args.warmup, args.repeats)
        rounds["copy"].append(median_seconds(copy, args.warmup, args.repeats))
        if standard is not None:
            rounds["standard"].append(median_seconds(standard, args.warmup, args.repeats))
            op_s = min(op_s, median_seconds(run, 0, args.repeats))
        rounds["op"].append(op_s)
    return rounds


def summary(shape: Shape, cache_mode: int, quant_bit: int, layout: int, threads: int, rounds: dict,
            reference_s: float) -> dict:
    """One table row: medians over the rounds (times), and the median and range of the per-round ratios."""
    moved = bytes_moved(shape, quant_bit)
    op, copy, standard = (np.array(rounds[k]) for k in ("op", "copy", "standard"))
    vs_copy = copy / op
    row = {
        "shape": shape.name, "cache_mode": MODE_NAMES[cache_mode], "B": shape.batch, "seqlen": shape.seqlen,
        "kvlen": shape.start_pos + shape.seqlen, "H": shape.heads, "Dh": shape.head_dim, "page_size": shape.page_size,
        "quant_bit": quant_bit, "layout": layout, "threads": threads, "rounds": len(op), "bytes_moved": moved,
        "op_ms": float(np.median(op)) * 1e3, "copy_ms": float(np.median(copy)) * 1e3,
        "reference_ms": reference_s * 1e3, "op_GBps": moved / float(np.median(op)) / 1e9,
        "copy_GBps": moved / float(np.median(copy)) / 1e9, "vs_copy": float(np.median(vs_copy)),
        "vs_copy_range": [float(vs_copy.min()), float(vs_copy.max())],
        "vs_reference": reference_s / float(np.median(op)), "standard_ms": None, "vs_standard": None,
        "op_ms_rounds": [t * 1e3 for t in op], "copy_ms_rounds": [t * 1e3 for t in copy],
    }
    if standard.size:
        row.update(standard_ms=float(np.median(standard)) * 1e3, vs_standard=float(np.median(standard / op)),
                   standard_ms_rounds=[t * 1e3 for t in standard])
    return row


def bench_cpu(args) -> list:
    from ..reference import key_value_cache

    if not tensor_scatter_available():
        print(f"onnxruntime {ort_version()} has no TensorScatter: offset-mode rows have no standard-ops baseline",
              flush=True)
    rows = []
    for shape in QUICK_SHAPES if args.quick else SHAPES:
        for cache_mode, layouts in MODES:
            for quant_bit in (0, 8):
                for layout in layouts:
                    attrs = case_attrs(shape, quant_bit, layout, cache_mode)
                    inputs = make_inputs(shape, quant_bit, layout, cache_mode=cache_mode)
                    moved = bytes_moved(shape, quant_bit)
                    src = aligned_empty(moved // 2, np.uint8)
                    src.fill(1)
                    dst = aligned_empty(moved // 2, np.uint8)
                    feeds = {k: v for k, v in inputs.items() if v is not None}
                    ref_s = median_seconds(lambda: key_value_cache(**inputs, **attrs), 1, args.reference_repeats)
                    for threads in args.threads:
                        standard = standard_runner(inputs, shape, cache_mode, quant_bit, layout, threads)
                        rounds = measure_rounds(ort_runner(feeds, attrs, threads), lambda: np.copyto(dst, src),
                                                standard, args)
                        del standard
                        row = summary(shape, cache_mode, quant_bit, layout, threads, rounds, ref_s)
                        rows.append(row)
                        print(f"{shape.name:8s} {row['cache_mode']:6s} q{quant_bit} layout{layout} threads={threads}: "
                              f"{moved / 1e6:8.1f} MB op {row['op_ms']:8.3f} ms {row['op_GBps']:6.2f} GB/s | copy "
                              f"{row['copy_GBps']:6.2f} GB/s | op/copy {row['vs_copy']:5.2f}x "
                              f"({row['vs_copy_range'][0]:.2f}-{row['vs_copy_range'][1]:.2f}) | vs reference "
                              f"{row['vs_reference']:6.1f}x"
                              + ("" if row["vs_standard"] is None else f" | vs standard ops {row['vs_standard']:5.1f}x"),
                              flush=True)
    return rows


def ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def write_results(rows, out: pathlib.Path, command: str, device: str) -> None:
    """Writes results.json, results.md (table + command) and, with matplotlib, chart.png."""
    out.mkdir(parents=True, exist_ok=True)
    scatter = tensor_scatter_available()
    (out / "results.json").write_text(json.dumps({"command": command, "device": device, "onnxruntime": ort_version(),
                                                  "tensor_scatter": scatter, "rows": rows}, indent=1))
    rounds = rows[0]["rounds"] if rows else 0
    offset_note = ("offset mode (layout 0, one layer): TensorScatter at `start_pos`, run in place (its output bound "
                   "to the cache's memory), then the same Gathers" if scatter else
                   f"offset mode: none, onnxruntime {ort_version()} has no TensorScatter")
    lines = [f"# KeyValueCache benchmark ({device})", "", f"Command: `{command}`", "",
             f"onnxruntime {ort_version()}. Bytes moved = bytes read + bytes written by the op. Each figure is the "
             f"median of {rounds} rounds; a round times the op, a plain copy of half as many bytes (a copy reads and "
             "writes each) and the standard-ops step side by side, each the median of its repeats. `op / copy` is "
             "the median of the rounds' copy time over op time, with its range over the rounds. `standard ops`: "
             "the same step composed from ONNX Runtime's built-in ops (kvcache_op.tools.standard_ops_baseline), "
             "unquantized only: paged mode (layouts 0, 3): ScatterND into a copy of the cache, Gather of every "
             f"loaded slot; {offset_note}. `op speed-up` is the median of the rounds' standard-ops time over op "
             "time. Every array (inputs, outputs, the copy's) starts on a 64-byte cache line, where ONNX Runtime's "
             "CPU allocator places its own buffers.", "",
             "| shape | cache | quant | layout | threads | MB moved | op ms | op GB/s | copy GB/s | op / copy (range) | "
             "vs reference | standard ops ms | op speed-up |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        standard = ("n/a | n/a" if r.get("standard_ms") is None
                    else f"{r['standard_ms']:.3f} | {r['vs_standard']:.1f}x")
        low, high = r["vs_copy_range"]
        lines.append(f"| {r['shape']} B={r['B']} seqlen={r['seqlen']} kvlen={r['kvlen']} | {r['cache_mode']} | "
                     f"{r['quant_bit']} | {r['layout']} | {r['threads']} | {r['bytes_moved'] / 1e6:.1f} | "
                     f"{r['op_ms']:.3f} | {r['op_GBps']:.2f} | {r['copy_GBps']:.2f} | {r['vs_copy']:.2f}x "
                     f"({low:.2f}-{high:.2f}) | {r['vs_reference']:.1f}x | {standard} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    from .bench_chart import paired_bar_chart

    labels = [f"{r['shape']} {r['cache_mode']}\nq{r['quant_bit']} L{r['layout']} t{r['threads']}" for r in rows]
    paired_bar_chart(out / "chart.png", labels, ("KeyValueCache op", [r["op_GBps"] for r in rows]),
                     ("plain copy, same bytes", [r["copy_GBps"] for r in rows]), "GB/s (read + written)",
                     f"KeyValueCache vs copy bandwidth — {device}")


def cpu_device() -> str:
    """The machine in words, for a results table: processor and usable cores."""
    return f"CPU {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores"


def kernel_build() -> str:
    """", <name> kernel build": the KeyValueCache CPU kernel build that runs (empty for a library from before its
    builds were named)."""
    from ..ort_ops import c_api

    try:
        return f", {c_api.cpu_kernel()} kernel build"
    except AttributeError:
        return ""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pick = argparse.ArgumentParser(add_help=False)
    pick.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    if pick.parse_known_args(argv)[0].device == "cuda":  # its own options and help
        from .bench_kvcache_cuda import main as cuda_main

        return cuda_main(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu, or cuda: the CUDA kernels on a GPU with torch (--device cuda --help)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="intra_op_num_threads values")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per measurement (their median counts)")
    parser.add_argument("--rounds", type=int, default=5, help="measurements per case (the table shows their median)")
    parser.add_argument("--reference-repeats", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, help="folder for results.md/json and chart.png")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: checks the tool runs, measures nothing")
    args = parser.parse_args(argv)
    # Settings that change what runs: another build of the library, BLAS threads competing for the cores.
    env = " ".join(f"{k}={os.environ[k]}" for k in ("KVCACHE_OP_LIBRARY", "KVCACHE_OP_CPU_KERNEL", "OPENBLAS_NUM_THREADS") if k in os.environ)
    command = (env + " " if env else "") + "python -m kvcache_op.tools.bench_kvcache " + " ".join(argv)
    rows = bench_cpu(args)
    if args.out:
        write_results(rows, args.out, command, cpu_device() + kernel_build())
        print(f"wrote {args.out}/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
