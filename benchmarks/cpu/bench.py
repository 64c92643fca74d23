"""Benchmark of the KeyValueCache op: bytes moved, GB/s, and ratios measured side by side in one run.

Per case (shape, paged or offset cache, quant_bit, layout): the ORT op (CPU EP, intra_op_num_threads 1 and 2),
``numpy.copyto`` of the same number of bytes (a copy of N bytes moves 2N: it reads N and writes N, so the
baseline copies half the op's traffic), the numpy reference, and (unquantized) the same step from ONNX
Runtime's built-in ops (:mod:`kvcache_op.benchmarks.cpu.standard_ops`: ScatterND + Gather paged, TensorScatter +
Gather offset). Each case is measured in ``--rounds`` rounds that time the op, the copy and the baseline side
by side (each the median of ``--repeats`` calls after a warm-up); the table shows the medians over rounds.

    python -m kvcache_op.benchmarks.cpu.bench --out benchmarks/cpu

The CUDA kernels have their own benchmark (:mod:`kvcache_op.benchmarks.gpu.bench`; ``kvcache-op bench op --device
cuda`` runs it).
"""

import argparse
import json
import pathlib
import sys

import numpy as np

from ...arguments import OneLineParser, at_least, out_folder

from ..bound_session import NO_SPINNING, aligned_empty
from ..chart import paired_bar_chart
from ..environment import recorded_command
from ..kv_shapes import SHAPES, QUICK_SHAPES, Shape, bytes_moved, case_attrs, make_inputs, ort_runner, plain_runner
from ..timing import cpu_device, kernel_build, median_seconds, ort_version
from .standard_ops import (LAYOUTS, OFFSET_LAYOUTS, baseline_runner, offset_baseline_runner,
                           tensor_scatter_available)


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
        return baseline_runner(inputs, shape.page_size, layout, threads, NO_SPINNING)[0] if layout in LAYOUTS else None
    if layout in OFFSET_LAYOUTS and tensor_scatter_available():
        return offset_baseline_runner(inputs, threads, NO_SPINNING)[0]
    return None


def copy_runner(moved: int):
    """``run()`` of a plain copy that moves ``moved`` bytes: it reads and writes ``moved // 2`` (its ``nbytes``),
    between 64-byte-aligned buffers like the op's."""
    src = aligned_empty(moved // 2, np.uint8)
    src.fill(1)
    dst = aligned_empty(moved // 2, np.uint8)

    def run():
        np.copyto(dst, src)

    run.nbytes = dst.nbytes
    return run


def measure_rounds(run, copy, standard, args, plain=None) -> dict:
    """``args.rounds`` rounds, each timing side by side: the op, the copy, the op through a plain
    ``session.run`` (outputs allocated by ONNX Runtime), and the standard-ops baseline; each figure is the median
    of ``args.repeats`` calls after ``args.warmup``, each timed once a round (none is given a second chance the
    others are not)."""
    rounds = {"op": [], "copy": [], "standard": [], "plain": []}
    for _ in range(args.rounds):
        rounds["op"].append(median_seconds(run, args.warmup, args.repeats))
        rounds["copy"].append(median_seconds(copy, args.warmup, args.repeats))
        if plain is not None:
            rounds["plain"].append(median_seconds(plain, args.warmup, args.repeats))
        if standard is not None:
            rounds["standard"].append(median_seconds(standard, args.warmup, args.repeats))
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
    plain = np.array(rounds.get("plain", []))
    if plain.size:
        row.update(plain_ms=float(np.median(plain)) * 1e3, plain_vs_copy=float(np.median(copy / plain)),
                   plain_ms_rounds=[t * 1e3 for t in plain])
    if standard.size:
        row.update(standard_ms=float(np.median(standard)) * 1e3, vs_standard=float(np.median(standard / op)),
                   standard_ms_rounds=[t * 1e3 for t in standard])
    return row


def bench_cpu(args) -> list:
    from ...reference import key_value_cache

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
                    copy = copy_runner(moved)
                    feeds = {k: v for k, v in inputs.items() if v is not None}
                    ref_s = median_seconds(lambda: key_value_cache(**inputs, **attrs), 1, args.reference_repeats)
                    for threads in args.threads:
                        standard = standard_runner(inputs, shape, cache_mode, quant_bit, layout, threads)
                        # Three sessions take turns: none may keep its pool spinning through the others' runs.
                        rounds = measure_rounds(ort_runner(feeds, attrs, threads, args.output_offset,
                                                           config=NO_SPINNING),
                                                copy,
                                                standard, args, plain_runner(feeds, attrs, threads, NO_SPINNING))
                        del standard
                        row = summary(shape, cache_mode, quant_bit, layout, threads, rounds, ref_s)
                        rows.append(row)
                        print(f"{shape.name:8s} {row['cache_mode']:6s} q{quant_bit} layout{layout} threads={threads}: "
                              f"{moved / 1e6:8.1f} MB op {row['op_ms']:8.3f} ms {row['op_GBps']:6.2f} GB/s | copy "
                              f"{row['copy_GBps']:6.2f} GB/s | op/copy {row['vs_copy']:5.2f}x "
                              f"({row['vs_copy_range'][0]:.2f}-{row['vs_copy_range'][1]:.2f}) | plain run "
                              f"{row['plain_ms']:8.3f} ms {row['plain_vs_copy']:5.2f}x | vs reference "
                              f"{row['vs_reference']:6.1f}x"
                              + ("" if row["vs_standard"] is None else f" | vs standard ops {row['vs_standard']:5.1f}x"),
                              flush=True)
    return rows


def write_results(rows, out: pathlib.Path, command: str, device: str, output_offset: int = 0,
                  quick: bool = False) -> None:
    """Writes results.json, results.md (table + command; a ``quick`` run's title says it measured nothing) and,
    with matplotlib, chart.png."""
    out.mkdir(parents=True, exist_ok=True)
    scatter = tensor_scatter_available()
    (out / "results.json").write_text(json.dumps({"command": command, "device": device, "onnxruntime": ort_version(),
                                                  "tensor_scatter": scatter, "output_offset": output_offset,
                                                  "rows": rows}, indent=1))
    rounds = rows[0]["rounds"] if rows else 0
    offset_note = ("offset mode (layout 0, one layer): TensorScatter at `start_pos`, run in place (its output bound "
                   "to the cache's memory), then the same Gathers" if scatter else
                   f"offset mode: none, onnxruntime {ort_version()} has no TensorScatter")
    smoke = " — --quick: a smoke run of tiny shapes, not a measurement" if quick else ""
    lines = [f"# KeyValueCache benchmark ({device}){smoke}", "", f"Command: `{command}`", "",
             f"onnxruntime {ort_version()}. Bytes moved = bytes read + bytes written by the op. Each figure is the "
             f"median of {rounds} rounds; a round times the op, a plain copy of half as many bytes (a copy reads and "
             "writes each; on one thread, in the two-thread rows too, so there `op / copy` is two threads against "
             "one) and the standard-ops step side by side, each once, the median of its repeats. `op / copy` is "
             "the median of the rounds' copy time over op time, with its range over the rounds. `standard ops`: "
             "the same step composed from ONNX Runtime's built-in ops (kvcache_op.benchmarks.cpu.standard_ops), "
             "unquantized only: paged mode (layouts 0, 3): ScatterND run in place (its output bound to the cache's "
             "memory), then each output one "
             f"Gather of the cache read as rows (the rows computed on the host); {offset_note}. `op speed-up` is the median of the rounds' standard-ops time over op "
             "time. Every array (inputs, outputs, the copy's) starts on a 64-byte cache line, where ONNX Runtime's "
             "CPU allocator places its own buffers" + (f", but the op's bound outputs, which start {output_offset} "
             "bytes past one (as numpy's large arrays do)" if output_offset else "") + "; the op's outputs are "
             "bound once (IOBinding). `plain run`: the "
             "same call through `session.run`, ONNX Runtime allocating the outputs afresh each call, and its "
             "ratio to the copy.", "",
             "| shape | cache | quant | layout | threads | MB moved | op ms | op GB/s | copy GB/s | op / copy (range) | "
             "plain run ms | plain / copy | vs reference | standard ops ms | op speed-up |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        standard = ("n/a | n/a" if r.get("standard_ms") is None
                    else f"{r['standard_ms']:.3f} | {r['vs_standard']:.1f}x")
        low, high = r["vs_copy_range"]
        lines.append(f"| {r['shape']} B={r['B']} seqlen={r['seqlen']} kvlen={r['kvlen']} | {r['cache_mode']} | "
                     f"{r['quant_bit']} | {r['layout']} | {r['threads']} | {r['bytes_moved'] / 1e6:.1f} | "
                     f"{r['op_ms']:.3f} | {r['op_GBps']:.2f} | {r['copy_GBps']:.2f} | {r['vs_copy']:.2f}x "
                     f"({low:.2f}-{high:.2f}) | {r['plain_ms']:.3f} | {r['plain_vs_copy']:.2f}x | "
                     f"{r['vs_reference']:.1f}x | {standard} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    labels = [f"{r['shape']} {r['cache_mode']}\nq{r['quant_bit']} L{r['layout']} t{r['threads']}" for r in rows]
    paired_bar_chart(out / "chart.png", labels, ("KeyValueCache op", [r["op_GBps"] for r in rows]),
                     ("plain copy, same bytes", [r["copy_GBps"] for r in rows]), "GB/s (read + written)",
                     f"KeyValueCache vs copy bandwidth — {device}")


def main(argv=None, prog: str = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=at_least(1), nargs="+", default=[1, 2], help="intra_op_num_threads values")
    parser.add_argument("--warmup", type=at_least(0), default=2)
    parser.add_argument("--repeats", type=at_least(1), default=7, help="timed calls per measurement (their median counts)")
    parser.add_argument("--rounds", type=at_least(1), default=5, help="measurements per case (the table shows their median)")
    parser.add_argument("--reference-repeats", type=at_least(1), default=3)
    parser.add_argument("--out", type=out_folder, help="folder for results.md/json and chart.png")
    parser.add_argument("--output-offset", type=int, choices=(0, 16), default=0,
                        help="bytes past a cache line where the bound outputs start: 0 as ONNX Runtime allocates "
                             "them, 16 as numpy's large arrays start (the kernel must run as fast at either)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: checks the tool runs, measures nothing")
    args = parser.parse_args(argv)
    command = recorded_command("kvcache_op.benchmarks.cpu.bench", argv)
    rows = bench_cpu(args)
    if args.out:
        write_results(rows, args.out, command, cpu_device() + kernel_build(), args.output_offset, args.quick)
        print(f"wrote {args.out}/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
