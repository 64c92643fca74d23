"""Benchmark of MultiHeadCacheAttention (the fused op reading the paged cache in place) against what a user
would otherwise run, side by side in one run, ONNX Runtime's CPU EP, every input and output bound once
(IOBinding) so only the kernels are timed:

- **split**: KeyValueCache (gathering a packed copy of every sequence's keys and values) then MultiHeadAttention,
  the pair the exporter wrote before the fused op;
- **GQA**: ONNX Runtime's own ``com.microsoft::GroupQueryAttention`` on the same shapes, its past key/value
  buffers (B, kv heads, capacity, head_dim) bound as its present outputs too (shared, written in place);
- **copy**: a plain copy of the bytes of cache the fused op reads (every sequence's keys and values), for the
  effective bandwidth: ``GB/s = those bytes / time``;
- **other build** (``--against LIBRARY``): the fused op from another build of the custom-op library, loaded in
  the same process beside this install's, for an A/B of a kernel change that the machine's noise cannot tilt
  (both run in every round); the table says whether the two builds' outputs were bit for bit equal.

Each step stores this step's tokens and attends over ``kvlen`` keys per sequence. Every call reads the same cache,
so one small enough for the last-level cache is read from there after the first call: B=1 kv16384 (16 MB) is,
on a 32 MB cache; B=1 kv65536 (64 MB) is read from memory, as a served model's step reads each layer's cache.
Methods run in interleaved rounds (the machine's noise lands on all alike), each round in an order of its own (seeded), their thread pools told not to spin after a run (a spinning
pool would take the cores from the next method); each figure is the median over rounds of per-round medians.

    python -m kvcache_op.benchmarks.attention.fused --out benchmarks/attention/fused
"""

import dataclasses
import json
import random
import statistics

import numpy as np

from ...arguments import MAX_PAGE_SIZE, OneLineParser, at_least, library_file, out_folder
from ..bound_session import NO_SPINNING, aligned_copy, aligned_empty, bound_run
from ..environment import recorded_command
from ..timing import cpu_device, kernel_build, median_seconds, ort_version

PAGE_SIZE = 128


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seqlen: int  # tokens stored this step per sequence (1: decode)
    kvlen: int   # keys attended per sequence, this step's included
    heads: int
    kv_heads: int
    head_dim: int = 128
    dtype: str = "float32"
    quant_bit: int = 0
    layout: int = 0
    threads: int = 1

    @property
    def label(self) -> str:
        kind = "decode" if self.seqlen == 1 else f"prefill seq{self.seqlen}"
        cache = f"int{self.quant_bit} cache" if self.quant_bit else f"{self.dtype} cache"
        return (f"{kind} B={self.batch} kv{self.kvlen} {self.heads}/{self.kv_heads} heads D{self.head_dim} "
                f"{self.dtype} ({cache}, layout {self.layout}), {self.threads} thread{'s' * (self.threads > 1)}")

    @property
    def cache_read_bytes(self) -> int:
        """Bytes of cache the fused op reads: keys and values of every sequence (codes and scales)."""
        rows = 2 * self.batch * self.kvlen * self.kv_heads
        if self.quant_bit:
            return rows * (self.head_dim * self.quant_bit // 8 + (self.head_dim // 8) * 4)
        return rows * self.head_dim * np.dtype(self.dtype).itemsize


def _shapes(threads_both=True):
    shapes = []
    for threads in (1, 2):
        shapes += [Shape(64, 1, 1024, 8, 2, threads=threads), Shape(64, 1, 1024, 8, 2, dtype="float16", threads=threads),
                   Shape(64, 1, 1024, 8, 2, layout=3, threads=threads),
                   Shape(32, 1, 2048, 32, 8, threads=threads), Shape(32, 1, 2048, 32, 8, dtype="float16", threads=threads),
                   Shape(64, 1, 1024, 8, 2, dtype="float16", quant_bit=8, threads=threads),
                   Shape(1, 1, 16384, 8, 2, dtype="float16", threads=threads),
                   Shape(1, 1, 65536, 8, 2, dtype="float16", threads=threads),
                   Shape(4, 512, 512, 8, 2, threads=threads), Shape(4, 512, 512, 8, 2, dtype="float16", threads=threads)]
    return shapes


SHAPES = _shapes()
#: --quick: a smoke run of the tool (tiny; not a measurement).
QUICK_SHAPES = [Shape(4, 1, 64, 4, 2, head_dim=16), Shape(2, 8, 8, 4, 2, head_dim=16, dtype="float16", quant_bit=8)]


def make_call(shape: Shape, seed: int = 0, shared_pages: bool = False, page_size: int = PAGE_SIZE,
              table_context: int = 0) -> tuple:
    """(inputs, attributes) of one MultiHeadCacheAttention step: sequence b owns pages [b P, (b + 1) P) of a
    paged cache of ``page_size`` slots a page; its first kvlen - seqlen positions are already stored (random), this
    step stores seqlen more. ``shared_pages`` (decode shapes): every sequence reads sequence 0's pages but its own
    last one, where it stores: the same arithmetic over a working set the caches hold (what the step costs without
    waiting on memory). ``table_context``: each page table has room for that many positions (its columns past the
    sequence's pages -1), as a runtime sizes the tables for the longest context its model allows."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(shape.dtype)
    b, s, k = shape.batch, shape.seqlen, shape.kvlen
    pages = -(-k // page_size)
    max_t = b * pages * page_size
    dims = {0: (max_t, 1, 2, shape.kv_heads), 1: (1, max_t, 2, shape.kv_heads), 2: (1, 2, max_t, shape.kv_heads),
            3: (1, 2, shape.kv_heads, max_t)}[shape.layout]  # reference/layout.py's axis orders, one layer

    def data(*lead):
        return rng.standard_normal((*lead, shape.head_dim), dtype=np.float32).astype(dtype, copy=False)

    if shape.quant_bit:
        cache = aligned_copy(rng.integers(-127, 128, (*dims, shape.head_dim), dtype=np.int8))
        scale = aligned_copy(rng.uniform(0.001, 0.02, (*dims, shape.head_dim // 8)).astype(np.float32))
    else:
        cache, scale = aligned_copy(data(*dims)), None
    inputs = {
        "query": aligned_copy(data(b * s, shape.heads)), "current_key": aligned_copy(data(b * s, shape.kv_heads)),
        "current_value": aligned_copy(data(b * s, shape.kv_heads)),
        "seqstarts": np.arange(b + 1, dtype=np.int64) * s, "kvstarts": np.arange(b + 1, dtype=np.int64) * k,
        "cachestarts": np.full((b, max(pages, -(-table_context // page_size))), -1, np.int64),
        "start_pos": np.full(b, k - s, np.int64), "decoding_batches": np.array(b if s == 1 else 0, np.int64),
        "max_seqlen": np.array(s, np.int64), "max_kvlen": np.array(k, np.int64), "cache": cache, "scale": scale,
    }
    inputs["cachestarts"][:, :pages] = (np.arange(b * pages, dtype=np.int64) * page_size).reshape(b, pages)
    if shared_pages:
        if s != 1:
            raise ValueError("shared pages are for decode shapes: a prefill stores into every page it reads")
        inputs["cachestarts"][:, :pages - 1] = inputs["cachestarts"][0, :pages - 1]
    attributes = dict(num_heads=shape.heads, head_dim=shape.head_dim, num_kv_heads=shape.kv_heads, cache_mode=1,
                      page_size=page_size, cache_layout=shape.layout, quant_bit=shape.quant_bit)
    return inputs, attributes


def split_model(inputs: dict, attributes: dict):
    """KeyValueCache (num_repeat 1) then MultiHeadAttention over what it gathers: the split pair."""
    from onnx import helper

    from ... import spec
    from ...spec.mha_schema import attention_node_attributes

    fused = spec.make_cache_attention_model(inputs, **attributes)
    cache_keys = ("num_layer", "layer_idx", "quant_bit", "quant_group", "cache_mode", "cache_layout", "page_size")
    with_scale = inputs.get("scale") is not None
    kv = spec.model.make_node(with_scale, outputs=["key", "value"],
                              **{k: attributes[k] for k in cache_keys if k in attributes})
    attention = {k: v for k, v in attributes.items() if k not in cache_keys}
    mha = helper.make_node("MultiHeadAttention", ["query", "key", "value", "seqstarts", "kvstarts", "decoding_batches",
                                                  "max_seqlen", "max_kvlen"], ["output"], domain=spec.DOMAIN,
                           **attention_node_attributes(attention))
    graph = helper.make_graph([kv, mha], "split", list(fused.graph.input), list(fused.graph.output))
    return helper.make_model(graph, opset_imports=list(fused.opset_import), ir_version=fused.ir_version)


def gqa_model(shape: Shape, capacity: int):
    """ONNX Runtime's GroupQueryAttention for (B, S, heads * D) queries over a (B, kv heads, capacity, D) past."""
    from onnx import TensorProto, helper

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(shape.dtype))
    b, s, d = shape.batch, shape.seqlen, shape.head_dim
    node = helper.make_node("GroupQueryAttention", ["query", "key", "value", "past_key", "past_value", "seqlens_k",
                                                    "total_sequence_length"], ["output", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=shape.heads, kv_num_heads=shape.kv_heads)
    past = [b, shape.kv_heads, capacity, d]
    inputs = [helper.make_tensor_value_info("query", elem, [b, s, shape.heads * d]),
              helper.make_tensor_value_info("key", elem, [b, s, shape.kv_heads * d]),
              helper.make_tensor_value_info("value", elem, [b, s, shape.kv_heads * d]),
              helper.make_tensor_value_info("past_key", elem, past), helper.make_tensor_value_info("past_value", elem, past),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [b]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info("output", elem, [b, s, shape.heads * d]),
               helper.make_tensor_value_info("present_key", elem, past),
               helper.make_tensor_value_info("present_value", elem, past)]
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def gqa_run(shape: Shape, inputs: dict):
    """The GQA step's bound run: the same query, keys and values; its past (the cached keys) bound as its
    present outputs too, so it is written in place. ``run.keep[1]``: the output; ``run.keep[2]``: the past."""
    b, s, k, d = shape.batch, shape.seqlen, shape.kvlen, shape.head_dim
    capacity = -(-k // PAGE_SIZE) * PAGE_SIZE
    rng = np.random.default_rng(1)
    past = [aligned_copy(rng.standard_normal((b, shape.kv_heads, capacity, d), dtype=np.float32).astype(shape.dtype))
            for _ in range(2)]
    feeds = {"query": inputs["query"].reshape(b, s, -1), "key": inputs["current_key"].reshape(b, s, -1),
             "value": inputs["current_value"].reshape(b, s, -1), "past_key": past[0], "past_value": past[1],
             "seqlens_k": np.full(b, k - 1, np.int32), "total_sequence_length": np.array(k, np.int32)}
    out = aligned_empty((b, s, shape.heads * d), shape.dtype)
    run = bound_run(gqa_model(shape, capacity), feeds,
                    {"output": out, "present_key": past[0], "present_value": past[1]}, shape.threads, NO_SPINNING)
    run.keep = (run.keep, out, past)
    return run


def measure(shape: Shape, rounds: int, repeats: int, shared_pages: bool = False, against: str | None = None,
            page_size: int = PAGE_SIZE, table_context: int = 0) -> dict:
    """Seconds per step of each method (medians) and the derived ratios (``shared_pages``, ``page_size``,
    ``table_context``: see make_call; ``against``: the path of another build of the library, whose fused op runs
    as one more method)."""
    from ... import spec

    inputs, attributes = make_call(shape, shared_pages=shared_pages, page_size=page_size,
                                   table_context=table_context)
    feeds = {k: v for k, v in inputs.items() if v is not None}
    out = aligned_empty(inputs["query"].shape, inputs["query"].dtype)
    fused_model = spec.make_cache_attention_model(inputs, **attributes)
    runs = {"fused": bound_run(fused_model, feeds, {"output": out}, shape.threads, NO_SPINNING),
            "split": bound_run(split_model(inputs, attributes), feeds, {"output": out}, shape.threads, NO_SPINNING)}
    equal_to_other_build = None
    if against:
        # One call of each build on the same step (each stores the same keys at the same slots, so the cache the
        # second reads is the one the first read), outputs compared bit for bit.
        other_out = aligned_empty(out.shape, out.dtype)
        runs["against"] = bound_run(fused_model, feeds, {"output": other_out}, shape.threads, NO_SPINNING, against)
        runs["fused"]()
        runs["against"]()
        equal_to_other_build = bool(np.array_equal(out.view(np.uint8), other_out.view(np.uint8)))
    if not shape.quant_bit:  # GroupQueryAttention has no quantized cache
        runs["gqa"] = gqa_run(shape, inputs)
    source = aligned_empty((shape.cache_read_bytes,), np.uint8)
    source[:] = 1
    target = aligned_empty(source.shape, np.uint8)
    runs["copy"] = lambda: np.copyto(target, source)
    times = {name: [] for name in runs}
    order = random.Random(0)
    for _ in range(rounds):
        # Each round in an order of its own: a method's place in a round, and the method before it, tilt its time
        # (two runs of one build, always the first after the copy and the third after the split pair, measured
        # 1.00-1.10x apart; starting each round one method later, 1.02x).
        for name in order.sample(list(runs), len(runs)):
            times[name].append(median_seconds(runs[name], warmup=1, repeats=repeats))
    seconds = {name: statistics.median(t) for name, t in times.items()}
    result = {"shape": dataclasses.asdict(shape), "label": shape.label, "seconds": seconds,
              "fused_vs_split": seconds["fused"] / seconds["split"], "cache_GBps": shape.cache_read_bytes / seconds["fused"] / 1e9,
              "copy_GBps": shape.cache_read_bytes / seconds["copy"] / 1e9,
              "fused_vs_copy_bandwidth": seconds["copy"] / seconds["fused"]}
    if "gqa" in seconds:
        result["fused_vs_gqa"] = seconds["fused"] / seconds["gqa"]
    if against:
        result["fused_vs_against"] = seconds["fused"] / seconds["against"]
        result["equal_to_other_build"] = equal_to_other_build
    return result


def report(results: list, header: str) -> str:
    """A markdown table of the results: time ratios (below 1: the fused op is faster) and bandwidths."""
    other = any("fused_vs_against" in r for r in results)
    lines = [header, "", "cache GB/s: the cache bytes the fused op reads over its time; copy GB/s: the same bytes over the "
             "time a one-thread plain copy of them takes (it reads them and writes them: this is its read rate, half "
             "the bytes it moves); of copy: copy time / fused time.", "", "| shape | fused ms | split ms | GQA ms | fused / split | fused / GQA | cache GB/s | copy GB/s | "
             "of copy |" + (" other build ms | fused / other build | outputs |" if other else ""),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: | --- |" if other else "")]
    for r in results:
        s = r["seconds"]
        gqa = f"{s['gqa'] * 1e3:.2f}" if "gqa" in s else "—"
        vs_gqa = f"{r['fused_vs_gqa']:.2f}x" if "fused_vs_gqa" in r else "—"
        line = (f"| {r['label']} | {s['fused'] * 1e3:.2f} | {s['split'] * 1e3:.2f} | {gqa} | "
                f"{r['fused_vs_split']:.2f}x | {vs_gqa} | {r['cache_GBps']:.1f} | {r['copy_GBps']:.1f} | "
                f"{r['fused_vs_copy_bandwidth']:.2f}x |")
        if other:
            line += (f" {s['against'] * 1e3:.2f} | {r['fused_vs_against']:.3f}x | "
                     f"{'bit for bit equal' if r['equal_to_other_build'] else 'differ'} |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m kvcache_op.benchmarks.attention.fused", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=out_folder, help="folder for results.json and README.md (default: print only)")
    parser.add_argument("--rounds", type=at_least(1), default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--repeats", type=at_least(1), default=5, help="timed calls per method per round (default 5)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one round: a smoke run, not a measurement")
    parser.add_argument("--match", default="", help="only shapes whose label contains this text")
    parser.add_argument("--shared-pages", action="store_true",
                        help="decode shapes only, every sequence reading sequence 0's pages: the same arithmetic over "
                             "a working set the caches hold (what a step costs when it does not wait on memory)")
    parser.add_argument("--against", type=library_file, metavar="LIBRARY",
                        help="another build of the custom-op library (a libkvcache_op_ort.so): its fused op runs in "
                             "the same rounds as this install's, for an A/B of a kernel change")
    parser.add_argument("--page-size", type=at_least(1, MAX_PAGE_SIZE), default=PAGE_SIZE,
                        help=f"slots a cache page holds (default {PAGE_SIZE})")
    parser.add_argument("--table-context", type=at_least(0), default=0, metavar="POSITIONS",
                        help="page tables with room for this many positions, their columns past a sequence's pages "
                             "-1, as a runtime sizes them for its model's longest context (default: just the pages "
                             "used)")
    args = parser.parse_args(argv)
    if args.against:
        from ...ort_ops import session_options

        try:  # a file that is no build of the library is refused here, in one line, before any measuring
            session_options(1, args.against)
        except Exception as error:  # noqa: BLE001 - ONNX Runtime raises its own Fail class
            parser.error(f"argument --against: cannot load {args.against}: {str(error).splitlines()[-1]}")
    shapes = [s for s in (QUICK_SHAPES if args.quick else SHAPES) if args.match in s.label and
              (s.seqlen == 1 or not args.shared_pages)]
    if not shapes:
        parser.error(f"no {'decode ' if args.shared_pages else ''}shape's label contains {args.match!r}"
                     + (" (--shared-pages measures decode shapes only)" if args.shared_pages else ""))
    rounds, repeats = (1, 2) if args.quick else (args.rounds, args.repeats)
    results = []
    for i, shape in enumerate(shapes, 1):
        print(f"[{i}/{len(shapes)}] {shape.label}", flush=True)
        results.append(measure(shape, rounds, repeats, args.shared_pages, args.against, args.page_size,
                               args.table_context))
        r = results[-1]
        print(f"    fused/split {r['fused_vs_split']:.2f}x" +
              (f", fused/GQA {r['fused_vs_gqa']:.2f}x" if "fused_vs_gqa" in r else "") +
              f", {r['fused_vs_copy_bandwidth']:.2f}x copy bandwidth" +
              (f", fused/other build {r['fused_vs_against']:.3f}x" if args.against else ""), flush=True)
    header = (f"MultiHeadCacheAttention vs the split pair and GroupQueryAttention — {cpu_device()}, onnxruntime "
              f"{ort_version()}{kernel_build()}; medians of {rounds} rounds x {repeats} calls; pages of "
              f"{args.page_size} slots"
              + (f", page tables with room for {args.table_context} positions" if args.table_context else "")
              + ("; every sequence reading sequence 0's pages (--shared-pages: a working set the caches hold)"
                 if args.shared_pages else "")
              + (f"; other build: {args.against}" if args.against else ""))
    command = recorded_command("kvcache_op.benchmarks.attention.fused", argv)
    text = report(results, header)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"command": command, "header": header,
                                                           "results": results}, indent=1) + "\n")
        (args.out / "README.md").write_text(f"Command: `{command}`\n\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
