"""Benchmark of the cache manager, measured side by side in one process.

1. Prefix match + insert throughput (tokens/s) on one workload — requests sharing system prompts,
   with a pool small enough to force eviction — for the manager and for the seed's block-trie design.
2. Per-step cost of a ``--batch``-sequence decode step (schedule + commit) at ``--kvlen``: pages filled
   on the same step by every sequence (``sync``) or on different steps (``staggered``, as in a real
   batch); median and mean over ``--steps`` steps, median over ``--repeats`` rounds. Next to it, the op's
   own time for that batch (ORT CPU op when the library is built).
3. A mixed step (the decode batch plus requests fed whole prompts) against the decode batch's context
   length and against how many requests are prefilled: it should follow the second, not the first.
4. The prefix hit rate of a multi-turn chat workload under LRU pressure.

With ``--baseline DIR`` (a folder holding another revision's ``manager`` package, e.g. from
``git archive REV manager | tar -x -C DIR``) every manager measure is also taken for that manager, in
the same rounds, alternating which goes first.

    python -m kvcache_op.tools.bench_manager --baseline DIR --out benchmarks/manager
"""

import argparse
import json
import pathlib
import statistics
import sys

import numpy as np

from . import manager_workloads as work


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


def side_by_side(managers: dict, repeats: int, measure) -> dict:
    """name -> [measure(manager class) per round], the managers taking turns to go first."""
    results = {name: [] for name in managers}
    names = list(managers)
    for round_ in range(repeats):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            results[name].append(measure(managers[name]))
    return results


def decode_figures(managers, args, stagger: bool) -> dict:
    """name -> {"median_s", "mean_s"}: medians over rounds of each round's per-step median and mean."""
    rounds = side_by_side(managers, args.repeats, lambda cls: work.decode_step_seconds(
        cls, args.batch, args.kvlen, args.page_size, args.steps, stagger))
    return {name: {"median_s": statistics.median(statistics.median(t) for t in runs),
                   "mean_s": statistics.median(statistics.fmean(t) for t in runs)} for name, runs in rounds.items()}


def mixed_figures(managers, args) -> dict:
    """name -> {"context": {kvlen: s}, "prefills": {count: s}} (medians over rounds)."""
    max_pages = -(-(max(args.mixed_kvlens) + 2 * args.page_size + args.steps) // args.page_size)
    out = {name: {"context": {}, "prefills": {}} for name in managers}
    for kvlen in args.mixed_kvlens:
        rounds = side_by_side(managers, args.repeats, lambda cls: work.mixed_step_seconds(
            cls, args.batch, kvlen, args.page_size, max_pages, args.mixed_prefills[1], args.prefill_len, args.steps))
        for name, values in rounds.items():
            out[name]["context"][kvlen] = statistics.median(values)
    for prefills in args.mixed_prefills:
        rounds = side_by_side(managers, args.repeats, lambda cls: work.mixed_step_seconds(
            cls, args.batch, args.kvlen, args.page_size, max_pages, prefills, args.prefill_len, args.steps))
        for name, values in rounds.items():
            out[name]["prefills"][prefills] = statistics.median(values)
    return out


def chart(path: pathlib.Path, names, decode, mixed, args) -> bool:
    """Decode step (sync/staggered, median and mean) and the mixed step's two scalings, per manager."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no chart written", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    cases = [(kind, stat) for kind in ("sync", "staggered") for stat in ("median_s", "mean_s")]
    x = np.arange(len(cases))
    for i, name in enumerate(names):
        axes[0].bar(x + (i - (len(names) - 1) / 2) * 0.4, [decode[k][name][s] * 1e3 for k, s in cases], 0.4, label=name)
    axes[0].set_xticks(x, [f"{k}\n{s[:-2]}" for k, s in cases])
    axes[0].set_yscale("log")
    axes[0].set_ylabel("ms per step (schedule + commit)")
    axes[0].set_title(f"decode step, {args.batch} sequences, kvlen {args.kvlen}")
    for key, ax, xlabel in (("context", axes[1], "decode batch's context length (tokens)"),
                            ("prefills", axes[2], f"requests prefilled in the step ({args.prefill_len} tokens each)")):
        for name in names:
            points = sorted(mixed[name][key].items())
            ax.plot([p for p, _ in points], [s * 1e3 for _, s in points], marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms per step")
        ax.set_yscale("log")
        ax.set_title(f"mixed step, {args.batch} decoding" + (f" + {args.mixed_prefills[1]} prefilled"
                                                             if key == "context" else f", kvlen {args.kvlen}"))
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(result: dict, names: list) -> str:
    ms = lambda s: f"{s * 1e3:.3f}"  # noqa: E731
    base = names[1] if len(names) > 1 else None
    ratio = lambda new, old: f"{old / new:.1f}x" if old else ""  # noqa: E731
    head = "| measure | " + " | ".join(names) + (" | speed-up |" if base else " |")
    rule = "| --- " * (len(names) + 1 + bool(base)) + "|"
    rows = []

    def row(label, values, fmt, higher_is_better=False):
        cells = [fmt(values[n]) for n in names]
        speedup = ""
        if base:
            speedup = ratio(values[base], values[names[0]]) if higher_is_better else ratio(values[names[0]], values[base])
        rows.append(f"| {label} | " + " | ".join(cells) + (f" | {speedup} |" if base else " |"))

    for kind in ("sync", "staggered"):
        for stat, label in (("median_s", "median"), ("mean_s", "mean")):
            row(f"decode step, {kind}, {label} ms", {n: result["decode"][kind][n][stat] for n in names}, ms)
    for kvlen in result["args"]["mixed_kvlens"]:
        row(f"mixed step, kvlen {kvlen}, {result['args']['mixed_prefills'][1]} prefilled, ms",
            {n: result["mixed"][n]["context"][str(kvlen)] for n in names}, ms)
    for prefills in result["args"]["mixed_prefills"]:
        row(f"mixed step, kvlen {result['args']['kvlen']}, {prefills} prefilled, ms",
            {n: result["mixed"][n]["prefills"][str(prefills)] for n in names}, ms)
    row("match+insert, M tokens/s", {n: result["match_insert"][n]["tokens_per_s"] / 1e6 for n in names},
        lambda v: f"{v:.2f}", higher_is_better=True)
    rows.append(f"| chat prefix hit rate | " + " | ".join(f"{result['chat'][n]['hit_rate']:.4f}" for n in names)
                + (" | |" if base else " |"))
    a = result["args"]
    lines = ["# Cache-manager benchmark", "", f"Command: `{result['command']}`", "",
             f"Machine: {result['machine']}. Every figure is a median over {a['repeats']} rounds; in each round "
             f"the managers run the same workload one after the other, taking turns to go first"
             + (f"; `{base}` is the manager of revision `{base}`, loaded from its sources" if base else "") + ".", "",
             head, rule, *rows, "",
             f"Decode step: {a['batch']} sequences at kvlen {a['kvlen']} (pages of {a['page_size']}), each fed one "
             f"token per step, schedule + commit timed; per round the median and the mean of {a['steps']} steps. "
             "`sync`: every sequence fills its page on the same step (one step in "
             f"{a['page_size']} publishes {a['batch']} pages and the next takes {a['batch']}); `staggered`: "
             f"sequence b starts at kvlen + b % {a['page_size']}, so every step publishes and takes "
             f"{a['batch'] // a['page_size']} pages.", "",
             f"Mixed step: the staggered decode batch plus requests admitted just before the step and fed their "
             f"whole {a['prefill_len']}-token prompt in it (admission and finish not timed); page tables "
             f"{result['mixed_max_pages']} pages wide throughout.", "",
             f"Match+insert: {a['requests']} requests x {a['prompt_len']} tokens, {a['shared']} shared in "
             f"{a['families']} families, {a['pages']} pages of {a['page_size']}: admit, prefill, finish one by one; "
             f"the seed block trie: {result['match_insert']['seed']['tokens_per_s'] / 1e6:.2f} M tokens/s; hit rate "
             f"{result['match_insert'][names[0]]['hit_rate']:.2f}, {result['match_insert'][names[0]]['evictions']} evictions.",
             "",
             f"Chat: {a['chat_conversations']} conversations x {a['chat_turns']} turns (a 64-token system prompt, "
             f"{a['chat_user_len']}-token user messages, {a['chat_reply_len']}-token replies decoded one token per step), "
             f"{a['chat_concurrent']} live at a time, {a['chat_pages']} pages of {a['page_size']}: "
             + "; ".join(f"`{n}` {result['chat'][n]['evictions']} evictions" for n in names) + "."]
    if result.get("op_s"):
        lines += ["", f"The op on the decode batch (ORT CPU, fp16, H=8, Dh=128): {result['op_s'] * 1e3:.3f} ms."]
    return "\n".join(lines) + "\n"


def machine() -> str:
    import os
    import platform

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, numpy {np.__version__}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--shared", type=int, default=512, help="shared system-prompt tokens")
    parser.add_argument("--families", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--pages", type=int, default=2048, help="pool size (the workload overflows it: eviction)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--kvlen", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64, help="decode steps per round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds")
    parser.add_argument("--mixed-kvlens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--mixed-prefills", type=int, nargs="+", default=[0, 4, 16, 64])
    parser.add_argument("--prefill-len", type=int, default=128)
    parser.add_argument("--chat-conversations", type=int, default=64)
    parser.add_argument("--chat-turns", type=int, default=6)
    parser.add_argument("--chat-user-len", type=int, default=48)
    parser.add_argument("--chat-reply-len", type=int, default=32)
    parser.add_argument("--chat-concurrent", type=int, default=16)
    parser.add_argument("--chat-pages", type=int, default=1024)
    parser.add_argument("--baseline", type=pathlib.Path, help="folder holding another revision's 'manager' package")
    parser.add_argument("--baseline-name", default="baseline", help="its name in the tables")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)
    if len(args.mixed_prefills) < 2:
        parser.error("--mixed-prefills needs at least two counts (the second is used for the context sweep)")
    command = "python -m kvcache_op.tools.bench_manager " + " ".join(argv if argv is not None else sys.argv[1:])
    from ..manager import KVCacheManager

    managers = {"manager": KVCacheManager}
    if args.baseline:
        managers[args.baseline_name] = work.load_manager_class(args.baseline)
    names = list(managers)

    prompts = work.shared_prefix_prompts(args.requests, args.prompt_len, args.shared, args.families)
    tokens = sum(len(p) for p in prompts)
    match = {}
    for name, rounds in side_by_side(managers, min(args.repeats, 3), lambda cls: work.match_insert_seconds(
            cls, prompts, args.pages, args.page_size)).items():
        seconds = statistics.median(s for s, _ in rounds)
        match[name] = {"seconds": seconds, "tokens_per_s": tokens / seconds, **rounds[0][1]}
    seed_s = statistics.median(work.seed_trie_seconds(prompts, args.pages, args.page_size)
                               for _ in range(min(args.repeats, 3)))
    match["seed"] = {"seconds": seed_s, "tokens_per_s": tokens / seed_s}
    print(f"match+insert: {tokens} tokens ({args.requests} requests of {args.prompt_len}, {args.shared} shared, "
          f"{args.pages} pages of {args.page_size})")
    for name in names + ["seed"]:
        print(f"  {name:12s} {match[name]['seconds'] * 1e3:9.1f} ms  {match[name]['tokens_per_s'] / 1e6:7.2f} M tokens/s")
    print(f"  manager / seed: {seed_s / match['manager']['seconds']:.1f}x")

    decode = {kind: decode_figures(managers, args, kind == "staggered") for kind in ("sync", "staggered")}
    for kind, figures in decode.items():
        for name in names:
            print(f"decode step ({kind}), {args.batch} sequences, kvlen {args.kvlen}: {name:12s} "
                  f"median {figures[name]['median_s'] * 1e3:.3f} ms, mean {figures[name]['mean_s'] * 1e3:.3f} ms")
    mixed = mixed_figures(managers, args)
    for name in names:
        print(f"mixed step, {name}: by context " + ", ".join(f"{k}: {v * 1e3:.3f} ms" for k, v in mixed[name]["context"].items())
              + "; by prefilled requests " + ", ".join(f"{k}: {v * 1e3:.3f} ms" for k, v in mixed[name]["prefills"].items()))
    chat = {name: work.chat_hit_rate(cls, args.chat_conversations, args.chat_turns, args.chat_user_len,
                                     args.chat_reply_len, args.chat_concurrent, args.chat_pages, args.page_size)
            for name, cls in managers.items()}
    for name in names:
        print(f"chat: {name:12s} hit rate {chat[name]['hit_rate']:.4f}, {chat[name]['evictions']} evictions")

    m = work.decode_batch(managers["manager"], args.batch, args.kvlen, args.page_size,
                          -(-(args.kvlen + args.page_size + 2) // args.page_size), stagger=False)
    plan = m.schedule({i: [7] for i in range(args.batch)})
    op_s = op_time_for(plan, 8, 128, args.page_size, args.repeats)
    if op_s:
        print(f"the op on that decode batch (ORT CPU, fp16, H=8, Dh=128): {op_s * 1e3:.3f} ms")

    result = {"command": command, "machine": machine(), "args": {k: v for k, v in vars(args).items()
                                                                  if k not in ("out", "baseline")},
              "names": names, "decode": decode, "mixed": mixed, "chat": chat, "match_insert": match, "op_s": op_s,
              "mixed_max_pages": -(-(max(args.mixed_kvlens) + 2 * args.page_size + args.steps) // args.page_size),
              # the keys of earlier versions of this file
              "manager_tokens_per_s": match["manager"]["tokens_per_s"], "seed_tokens_per_s": tokens / seed_s,
              "hit_rate": match["manager"]["hit_rate"], "evictions": match["manager"]["evictions"],
              "schedule_s": decode["sync"]["manager"]["median_s"]}
    result = json.loads(json.dumps(result))  # int keys become strings, as the file will have them
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
        (args.out / "results.md").write_text(markdown(result, names))
        chart(args.out / "chart.png", names, decode, mixed, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
