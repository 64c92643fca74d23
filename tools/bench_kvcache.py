"""Benchmark of the KeyValueCache op: bytes moved, GB/s, and ratios measured side by side in one run.

Per shape: the ORT op (CPU EP, intra_op_num_threads 1 and 2), ``numpy.copyto`` of the same number of
bytes (a copy of N bytes moves 2N: it reads N and writes N, so the baseline copies half the op's
traffic), the numpy reference, and (unquantized) the same step from ONNX Runtime's built-in ops
(:mod:`kvcache_op.tools.standard_ops_baseline`). Warm-up, then the median of repeats.

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

from .bound_session import bound_run
from .standard_ops_baseline import LAYOUTS, baseline_runner


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


def make_indices(shape: Shape, rng) -> dict:
    """The six index inputs of one paged call (cache_mode 1): every sequence owns its pages, in a page table
    shuffled by ``rng``; ``cachestarts`` holds each page's first slot, so the cache needs
    ``cachestarts.size * page_size`` slots."""
    kvlen = shape.start_pos + shape.seqlen
    pages_per_seq = -(-kvlen // shape.page_size)
    pages = shape.batch * pages_per_seq
    table = rng.permutation(pages).reshape(shape.batch, pages_per_seq).astype(np.int64) * shape.page_size
    return {
        "seqstarts": np.arange(shape.batch + 1, dtype=np.int64) * shape.seqlen,
        "kvstarts": np.arange(shape.batch + 1, dtype=np.int64) * kvlen,
        "cachestarts": table,
        "start_pos": np.full(shape.batch, shape.start_pos, np.int64),
        "max_seqlen": np.array(shape.seqlen, np.int64),
        "max_kvlen": np.array(kvlen, np.int64),
    }


def make_inputs(shape: Shape, quant_bit: int, layout: int, seed: int = 0):
    """Inputs of one call: every sequence owns its pages, in a shuffled page table."""
    from ..reference import cache_shape

    rng = np.random.default_rng(seed)
    indices = make_indices(shape, rng)
    tokens = shape.batch * shape.seqlen
    cache_dtype = np.int8 if quant_bit else np.float16
    max_t = indices["cachestarts"].size * shape.page_size
    current_key = rng.standard_normal((tokens, shape.heads, shape.head_dim)).astype(np.float16)
    current_value = rng.standard_normal((tokens, shape.heads, shape.head_dim)).astype(np.float16)
    inputs = {
        "current_key": current_key,
        "current_value": current_value,
        **indices,
        "cache": rng.integers(-127, 128, cache_shape(layout, 1, max_t, shape.heads, shape.head_dim)).astype(cache_dtype),
        "scale": None,
    }
    if quant_bit:
        inputs["scale"] = rng.uniform(0.001, 0.02, cache_shape(layout, 1, max_t, shape.heads, shape.head_dim // 8)
                                      ).astype(np.float16)
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


def ort_runner(inputs, attrs, threads):
    """A zero-overhead call of the op: inputs and outputs bound once, then run_with_iobinding."""
    from .. import spec

    kv_tokens = int(inputs["kvstarts"][-1])
    out_shape = (kv_tokens, inputs["current_key"].shape[1], inputs["current_key"].shape[2])
    outputs = {name: np.empty(out_shape, np.float16) for name in ("key", "value")}
    return bound_run(spec.make_model(inputs, **attrs), inputs, outputs, threads)


def bench_cpu(args) -> list:
    from ..reference import key_value_cache

    rows = []
    for shape in QUICK_SHAPES if args.quick else SHAPES:
        for quant_bit in (0, 8):
            for layout in (0, 3):
                attrs = dict(quant_bit=quant_bit, quant_group=8, cache_mode=1, cache_layout=layout,
                             page_size=shape.page_size)
                inputs = make_inputs(shape, quant_bit, layout)
                moved = bytes_moved(shape, quant_bit)
                src = np.ones(moved // 2, np.uint8)
                dst = np.empty_like(src)
                copy_s = median_seconds(lambda: np.copyto(dst, src), args.warmup, args.repeats)
                feeds = {k: v for k, v in inputs.items() if v is not None}
                ref_s = median_seconds(lambda: key_value_cache(**inputs, **attrs), 1, args.reference_repeats)
                for threads in args.threads:
                    run = ort_runner(feeds, attrs, threads)
                    op_s = median_seconds(run, args.warmup, args.repeats)
                    copy_again = median_seconds(lambda: np.copyto(dst, src), args.warmup, args.repeats)
                    copy_best = min(copy_s, copy_again)  # the copy measured around the op, same run
                    standard_s = None
                    if quant_bit == 0 and layout in LAYOUTS:  # standard ops cannot quantize as the spec does
                        standard, _ = baseline_runner(inputs, shape.page_size, layout, threads)
                        standard_s = median_seconds(standard, args.warmup, args.repeats)
                        del standard
                        op_s = min(op_s, median_seconds(run, 0, args.repeats))  # the op around the baseline
                    row = {
                        "shape": shape.name, "B": shape.batch, "seqlen": shape.seqlen,
                        "kvlen": shape.start_pos + shape.seqlen, "H": shape.heads, "Dh": shape.head_dim,
                        "page_size": shape.page_size, "quant_bit": quant_bit, "layout": layout, "threads": threads,
                        "bytes_moved": moved, "op_ms": op_s * 1e3, "copy_ms": copy_best * 1e3,
                        "reference_ms": ref_s * 1e3, "op_GBps": moved / op_s / 1e9,
                        "copy_GBps": moved / copy_best / 1e9, "vs_copy": copy_best / op_s, "vs_reference": ref_s / op_s,
                        "standard_ms": None if standard_s is None else standard_s * 1e3,
                        "vs_standard": None if standard_s is None else standard_s / op_s,
                    }
                    rows.append(row)
                    print(f"{shape.name:8s} q{quant_bit} layout{layout} threads={threads}: {moved / 1e6:8.1f} MB "
                          f"op {row['op_ms']:8.3f} ms {row['op_GBps']:6.2f} GB/s | copy {row['copy_GBps']:6.2f} GB/s "
                          f"| op/copy {row['vs_copy']:5.2f}x | vs reference {row['vs_reference']:6.1f}x"
                          + ("" if standard_s is None else f" | vs standard ops {row['vs_standard']:5.1f}x"), flush=True)
    return rows


def write_results(rows, out: pathlib.Path, command: str, device: str) -> None:
    """Writes results.json, results.md (table + command) and, with matplotlib, chart.png."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": command, "device": device, "rows": rows}, indent=1))
    lines = [f"# KeyValueCache benchmark ({device})", "", f"Command: `{command}`", "",
             "Bytes moved = bytes read + bytes written by the op. The copy baseline copies half as many bytes "
             "(a copy reads and writes each), measured in the same run. `standard ops`: the same step composed "
             "from ONNX Runtime's built-in ops (ScatterND into the cache, Gather of every loaded slot; "
             "kvcache_op.tools.standard_ops_baseline), unquantized only, measured in the same run; `op speed-up` is "
             "its time over the op's.", "",
             "| shape | quant | layout | threads | MB moved | op ms | op GB/s | copy GB/s | op / copy | vs reference | "
             "standard ops ms | op speed-up |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        standard = ("n/a | n/a" if r.get("standard_ms") is None
                    else f"{r['standard_ms']:.3f} | {r['vs_standard']:.1f}x")
        lines.append(f"| {r['shape']} B={r['B']} seqlen={r['seqlen']} kvlen={r['kvlen']} | {r['quant_bit']} | "
                     f"{r['layout']} | {r['threads']} | {r['bytes_moved'] / 1e6:.1f} | {r['op_ms']:.3f} | "
                     f"{r['op_GBps']:.2f} | {r['copy_GBps']:.2f} | {r['vs_copy']:.2f}x | {r['vs_reference']:.1f}x | "
                     f"{standard} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    from .bench_chart import paired_bar_chart

    labels = [f"{r['shape']}\nq{r['quant_bit']} L{r['layout']} t{r['threads']}" for r in rows]
    paired_bar_chart(out / "chart.png", labels, ("KeyValueCache op", [r["op_GBps"] for r in rows]),
                     ("plain copy, same bytes", [r["copy_GBps"] for r in rows]), "GB/s (read + written)",
                     f"KeyValueCache vs copy bandwidth — {device}")


def cpu_device() -> str:
    """The machine in words, for a results table: processor and usable cores."""
    return f"CPU {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores"


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
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--reference-repeats", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, help="folder for results.md/json and chart.png")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: checks the tool runs, measures nothing")
    args = parser.parse_args(argv)
    command = "python -m kvcache_op.tools.bench_kvcache " + " ".join(argv)
    rows = bench_cpu(args)
    if args.out:
        write_results(rows, args.out, command, cpu_device())
        print(f"wrote {args.out}/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
