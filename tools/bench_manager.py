"""Benchmark of the cache manager, measured side by side in one process.

1. Prefix match + insert throughput (tokens/s) on one workload — requests sharing system prompts,
   with a pool small enough to force eviction — for the manager and for the seed's block-trie design.
2. Per-step overhead of building a 256-sequence decode batch, next to the op's own time for that batch
   (ORT CPU op when the library is built).

    python -m kvcache_op.tools.bench_manager --out benchmarks/manager
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

import numpy as np


def workload(requests: int, prompt_len: int, shared: int, families: int, seed: int = 0):
    """Prompts: one of ``families`` shared prefixes of ``shared`` tokens, then unique tokens."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 32000, shared).tolist() for _ in range(families)]
    return [prefixes[i % families] + rng.integers(0, 32000, prompt_len - shared).tolist() for i in range(requests)]


def run_manager(prompts, num_pages, page_size):
    """Admit, prefill (match + insert + allocation) and finish each request in turn."""
    from ..manager import KVCacheManager

    m = KVCacheManager(num_pages, page_size, max_pages=-(-len(prompts[0]) // page_size))
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        hit = m.add_request(i, prompt)
        m.commit(m.schedule({i: prompt[hit:]}))
        m.finish(i)
    return time.perf_counter() - start, m.metrics()


def run_seed(prompts, num_pages, page_size):
    from .block_trie_seed import BlockTrie

    trie = BlockTrie(num_pages, page_size)
    start = time.perf_counter()
    for prompt in prompts:
        blocks = trie.allocate(prompt)
        trie.free(prompt, blocks)
    return time.perf_counter() - start


def decode_step_overhead(batch: int, kvlen: int, page_size: int, repeats: int):
    """Median seconds of one ``batch``-sequence decode step of KVCacheManager (schedule + commit)."""
    from ..manager import KVCacheManager

    pages_per_seq = -(-(kvlen + repeats + 2) // page_size)
    m = KVCacheManager(batch * pages_per_seq + 1, page_size, pages_per_seq)
    for i in range(batch):
        prompt = [i + 1] * kvlen
        m.add_request(i, prompt)
        m.commit(m.schedule({i: prompt}))
    times = []
    for _ in range(repeats):
        feeds = {i: [7] for i in range(batch)}
        start = time.perf_counter()
        plan = m.schedule(feeds)
        m.commit(plan)
        times.append(time.perf_counter() - start)
    return statistics.median(times), plan


def op_time_for(plan, heads, head_dim, page_size, repeats):
    """Median seconds of the ORT CPU op on the plan's batch (fp16, paged, layout 0), or None."""
    from ..ort_ops import library_available

    if not library_available():
        return None
    from ..reference import cache_shape
    from .bench_kvcache import median_seconds, ort_runner

    tokens = int(plan.seqstarts[-1])
    max_t = (int(plan.cachestarts.max()) + page_size)
    rng = np.random.default_rng(0)
    feeds = {"current_key": rng.standard_normal((tokens, heads, head_dim)).astype(np.float16),
             "current_value": rng.standard_normal((tokens, heads, head_dim)).astype(np.float16),
             **plan.op_inputs(), "cache": np.zeros(cache_shape(0, 1, max_t, heads, head_dim), np.float16)}
    run = ort_runner(feeds, dict(cache_mode=1, page_size=page_size), threads=0)
    return median_seconds(run, 2, repeats)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--shared", type=int, default=512, help="shared system-prompt tokens")
    parser.add_argument("--families", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--pages", type=int, default=32768, help="pool size (the workload overflows it: eviction)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--kvlen", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)
    command = "python -m kvcache_op.tools.bench_manager " + " ".join(argv if argv is not None else sys.argv[1:])

    prompts = workload(args.requests, args.prompt_len, args.shared, args.families)
    tokens = sum(len(p) for p in prompts)
    manager_s, metrics = min((run_manager(prompts, args.pages, args.page_size) for _ in range(3)), key=lambda r: r[0])
    seed_s = min(run_seed(prompts, args.pages, args.page_size) for _ in range(3))
    print(f"match+insert: {tokens} tokens ({args.requests} requests of {args.prompt_len}, {args.shared} shared, "
          f"{args.pages} pages of {args.page_size})")
    print(f"  manager   {manager_s * 1e3:9.1f} ms  {tokens / manager_s / 1e6:7.2f} M tokens/s  "
          f"(hit rate {metrics['hit_rate']:.2f}, evictions {metrics['evictions']})")
    print(f"  seed trie {seed_s * 1e3:9.1f} ms  {tokens / seed_s / 1e6:7.2f} M tokens/s")
    print(f"  manager / seed: {seed_s / manager_s:.1f}x")
    step_s, plan = decode_step_overhead(args.batch, args.kvlen, args.page_size, args.repeats)
    op_s = op_time_for(plan, 8, 128, args.page_size, args.repeats)
    print(f"decode step of {args.batch} sequences (kvlen {args.kvlen}): schedule+commit {step_s * 1e3:.3f} ms"
          + (f", op (ORT CPU, fp16, H=8, Dh=128) {op_s * 1e3:.3f} ms, overhead {step_s / op_s:.2%} of the op"
             if op_s else ", op not measured (library not built)"))
    result = {"command": command, "tokens": tokens, "manager_s": manager_s, "seed_s": seed_s,
              "manager_tokens_per_s": tokens / manager_s, "seed_tokens_per_s": tokens / seed_s,
              "speedup_vs_seed": seed_s / manager_s, "hit_rate": metrics["hit_rate"], "evictions": metrics["evictions"],
              "decode_batch": args.batch, "decode_kvlen": args.kvlen, "schedule_s": step_s, "op_s": op_s}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
        lines = ["# Cache-manager benchmark", "", f"Command: `{command}`", "",
                 "| measure | manager | seed block trie | ratio |", "| --- | --- | --- | --- |",
                 f"| match+insert, M tokens/s | {tokens / manager_s / 1e6:.2f} | {tokens / seed_s / 1e6:.2f} | "
                 f"{seed_s / manager_s:.1f}x |", "",
                 f"Workload: {args.requests} requests x {args.prompt_len} tokens, {args.shared} shared in "
                 f"{args.families} families, {args.pages} pages of {args.page_size}; hit rate {metrics['hit_rate']:.2f}, "
                 f"{metrics['evictions']} evictions.", "",
                 f"Decode step of {args.batch} sequences (kvlen {args.kvlen}): schedule+commit {step_s * 1e3:.3f} ms"
                 + (f"; the op on that batch (ORT CPU, fp16, H=8, Dh=128): {op_s * 1e3:.3f} ms "
                    f"(overhead {step_s / op_s:.2%})." if op_s else ".")]
        (args.out / "results.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
