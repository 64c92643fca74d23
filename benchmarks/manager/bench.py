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

    python -m kvcache_op.benchmarks.manager.bench --baseline DIR --out benchmarks/manager
"""

import argparse
import json
import os
import pathlib
import statistics
import sys

import numpy as np

from ...arguments import OneLineParser, at_least, out_folder

from ..environment import recorded_command
from . import workloads as work

ARRAYS = "manager, schedule_decode"


def op_time_for(plan, heads, head_dim, page_size, repeats):
    """Median seconds of the ORT CPU op on the plan's batch (fp16, paged, layout 0), or None."""
    from ...ort_ops import library_available

    if not library_available():
        return None
    from ...reference import cache_shape
    from ..kv_shapes import ort_runner
    from ..timing import median_seconds

    tokens = int(plan.seqstarts[-1])
    max_t = (int(plan.cachestarts.max()) + page_size)
    rng = np.random.default_rng(0)
    feeds = {"current_key": rng.standard_normal((tokens, heads, head_dim)).astype(np.float16),
             "current_value": rng.standard_normal((tokens, heads, head_dim)).astype(np.float16),
             **plan.op_inputs(), "cache": np.zeros(cache_shape(0, 1, max_t, heads, head_dim), np.float16)}
    run = ort_runner(feeds, dict(cache_mode=1, page_size=page_size), threads=0)
    return median_seconds(run, 2, repeats)


def side_by_side(managers: dict, repeats: int, measure) -> dict:
    """name -> [measure(managers[name], name) per round]: each round runs every entry once, in turn,
    forwards in even rounds and backwards in odd ones."""
    results = {name: [] for name in managers}
    names = list(managers)
    for round_ in range(repeats):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            results[name].append(measure(managers[name], name))
    return results


def decode_figures(managers, args, stagger: bool) -> dict:
    """name -> medians over rounds of each round's per-step figures (schedule + commit: median and mean;
    schedule and commit apart: medians). This package's manager also runs as ``ARRAYS``, planning with
    ``schedule_decode``."""
    runs = dict(managers)
    runs[ARRAYS] = managers["manager"]
    rounds = side_by_side(runs, args.repeats, lambda cls, name: work.decode_step_seconds(
        cls, args.batch, args.kvlen, args.page_size, args.steps, stagger, arrays=name == ARRAYS))
    out = {}
    for name, per_round in rounds.items():
        figures = {"median_s": [], "mean_s": [], "schedule_s": [], "commit_s": [], "cpu_median_s": [], "cpu_mean_s": []}
        for steps in per_round:
            totals = [s + c for s, c, _ in steps]
            figures["median_s"].append(statistics.median(totals))
            figures["mean_s"].append(statistics.fmean(totals))
            figures["schedule_s"].append(statistics.median(s for s, _, _ in steps))
            figures["commit_s"].append(statistics.median(c for _, c, _ in steps))
            figures["cpu_median_s"].append(statistics.median(cpu for _, _, cpu in steps))
            figures["cpu_mean_s"].append(statistics.fmean(cpu for _, _, cpu in steps))
        out[name] = {key: statistics.median(values) for key, values in figures.items()}
    return out


def mixed_figures(managers, args) -> dict:
    """name -> {"context": {kvlen: s}, "prefills": {count: s}} (medians over rounds). Each round visits
    every case for every manager, so a change of the machine's load during the run hits them alike."""
    max_pages = -(-(max(max(args.mixed_kvlens), args.kvlen) + 2 * args.page_size + args.steps) // args.page_size)
    sweeps = {"context": [(kvlen, args.mixed_prefills[1]) for kvlen in args.mixed_kvlens],
              "prefills": [(args.kvlen, prefills) for prefills in args.mixed_prefills]}
    # A case in both sweeps (kvlen = --kvlen at the second prefill count) is measured once and shown in both.
    cases = {(name, kvlen, prefills): (cls, kvlen, prefills) for name, cls in managers.items()
             for sweep in sweeps.values() for kvlen, prefills in sweep}
    rounds = side_by_side(cases, args.repeats, lambda case, _: work.mixed_step_seconds(
        case[0], args.batch, case[1], args.page_size, max_pages, case[2], args.prefill_len, args.steps))
    out = {name: {"context": {}, "prefills": {}} for name in managers}
    for name in managers:
        for sweep, points in sweeps.items():
            for kvlen, prefills in points:
                out[name][sweep][kvlen if sweep == "context" else prefills] = statistics.median(
                    rounds[(name, kvlen, prefills)])
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
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    cases = [(kind, stat) for kind in ("sync", "staggered") for stat in ("median_s", "mean_s")]
    decode_names = decode_columns(names)
    x, width = np.arange(len(cases)), 0.8 / len(decode_names)
    for i, name in enumerate(decode_names):
        axes[0].bar(x + (i - (len(decode_names) - 1) / 2) * width, [decode[k][name][s] * 1e3 for k, s in cases],
                    width, label=name)
    axes[0].axhline(0.1, color="gray", linewidth=0.8, linestyle="--", label="0.1 ms")
    axes[0].set_xticks(x, [f"{k}\n{s[:-2]}" for k, s in cases])
    axes[0].set_yscale("log")
    axes[0].set_ylabel("ms per step (schedule + commit)")
    axes[0].set_title(f"decode step, {args.batch} sequences, kvlen {args.kvlen}")
    for key, ax, xlabel in (("context", axes[1], "context length of the decoding requests (tokens)"),
                            ("prefills", axes[2], f"requests prefilled in the step ({args.prefill_len} tokens each)")):
        for name in names:
            points = sorted((int(k), v) for k, v in mixed[name][key].items())
            ax.plot([p for p, _ in points], [s * 1e3 for _, s in points], marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms per step")
        ax.set_yscale("log")
        if key == "context":
            ax.set_xscale("log", base=2)
        ax.set_title(f"mixed step: {args.batch} decoding + " + (f"{args.mixed_prefills[1]} prefilled"
                                                               if key == "context" else f"n prefilled, kvlen {args.kvlen}"))
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def decode_columns(names: list) -> list:
    """The decode table's managers: this package's (through schedule, then schedule_decode), the others."""
    return names[:1] + [ARRAYS] + names[1:]


def markdown(result: dict, names: list) -> str:
    """results.md: the command, the machine, three tables and what each workload is."""
    a, base = result["args"], (names[1] if len(names) > 1 else None)
    ms = lambda s: f"{s * 1e3:.3f}"  # noqa: E731

    def table(columns, rows, speedup):
        """``rows``: (label, {column: value}, format, higher is better: True/False, None for no ratio).
        ``speedup``: a column with how much better the manager's value is than the baseline's."""
        lines = ["| measure | " + " | ".join(f"`{c}`" for c in columns) + (" | speed-up |" if speedup else " |"),
                 "| --- " * (len(columns) + 1 + bool(speedup)) + "|"]
        for label, values, fmt, higher_is_better in rows:
            cells = " | ".join(fmt(values[c]) if c in values else "" for c in columns)
            ratio = ""
            if speedup and base in values and higher_is_better is not None:
                ratio = values["manager"] / values[base] if higher_is_better else values[base] / values["manager"]
                ratio = f"{ratio:.1f}x"
            lines.append(f"| {label} | {cells} |" + (f" {ratio} |" if speedup else ""))
        return lines

    decode_rows = []
    for kind in ("sync", "staggered"):
        for stat, label in (("median_s", "schedule + commit, median"), ("mean_s", "schedule + commit, mean"),
                            ("schedule_s", "schedule, median"), ("commit_s", "commit, median"),
                            ("cpu_median_s", "schedule + commit, CPU time, median"),
                            ("cpu_mean_s", "schedule + commit, CPU time, mean")):
            decode_rows.append((f"{kind}: {label}, ms", {n: result["decode"][kind][n][stat] for n in result["decode"][kind]},
                                ms, False))
    mixed_rows = [(f"kvlen {k}, {a['mixed_prefills'][1]} prefilled, ms",
                   {n: result["mixed"][n]["context"][str(k)] for n in names}, ms, False) for k in a["mixed_kvlens"]]
    mixed_rows += [(f"kvlen {a['kvlen']}, {p} prefilled, ms", {n: result["mixed"][n]["prefills"][str(p)] for n in names},
                    ms, False) for p in a["mixed_prefills"]]
    match = result["match_insert"]
    cache_rows = [("match+insert, M tokens/s", {n: match[n]["tokens_per_s"] / 1e6 for n in names + ["seed"]},
                   lambda v: f"{v:.2f}", True),
                  ("chat prefix hit rate", {n: result["chat"][n]["hit_rate"] for n in names}, lambda v: f"{v:.4f}", None),
                  ("chat evictions", {n: result["chat"][n]["evictions"] for n in names}, str, None)]
    lines = ["# Cache-manager benchmark", "", f"Command: `{result['command']}`", "",
             f"Machine: {result['machine']}. Every figure is a median over {a['repeats']} rounds (match+insert: "
             f"{min(a['repeats'], 3)}); in each round the managers run the same workload one after the other, "
             "taking turns to go first"
             + (f"; `{base}` is the manager of revision {base}, loaded from its sources, and speed-up is its time "
                "over `manager`'s" if base else "") + ".", "",
             f"## Decode step: {a['batch']} sequences at kvlen {a['kvlen']}", "",
             *table(decode_columns(names), decode_rows, bool(base)), "",
             f"Each sequence is fed one token per step (pages of {a['page_size']}); per round the median and the mean "
             f"over {a['steps']} steps. `sync`: every sequence fills its page on the same step, so one step in "
             f"{a['page_size']} publishes {a['batch']} pages and the next takes {a['batch']}; `staggered`: sequence b "
             f"starts at kvlen + b % {a['page_size']}, so every step publishes and takes {a['batch'] // a['page_size']}. "
             f"`{ARRAYS}`: the same manager planning the same steps with `schedule_decode(request_ids, tokens)` "
             "(an int64 array) instead of `schedule({rid: [token]})`. CPU time: the thread's own (it leaves out "
             "the time it waited for a core while other processes ran; wall times include it).", "",
             "## Mixed step", "", *table(names, mixed_rows, bool(base)), "",
             f"The staggered decode batch ({a['batch']} requests) plus new requests fed their whole "
             f"{a['prefill_len']}-token prompt in the same step (admitted before it and finished after it, not timed); "
             f"page tables {result['mixed_max_pages']} pages wide throughout, so only the context changes.", "",
             "## Prefix cache", "", *table(names + ["seed"], cache_rows, bool(base)), "",
             f"Match+insert: {a['requests']} requests x {a['prompt_len']} tokens, {a['shared']} shared in "
             f"{a['families']} families, {a['pages']} pages of {a['page_size']}, admitted, prefilled and finished one "
             f"by one (hit rate {match['manager']['hit_rate']:.2f}, {match['manager']['evictions']} evictions); `seed`: "
             "the block-trie design of the seed discussion on the same prompts.", "",
             f"Chat: {a['chat_conversations']} conversations x {a['chat_turns']} turns (a 64-token system prompt, then "
             f"{a['chat_user_len']}-token user messages and {a['chat_reply_len']}-token replies decoded one token per "
             f"step), {a['chat_concurrent']} conversations live at a time, {a['chat_pages']} pages of {a['page_size']}: "
             "each turn's prompt is the whole conversation so far, so its hits are what eviction left of it."]
    if result.get("op_s"):
        lines += ["", f"The op itself on the decode batch (ORT CPU EP, fp16, H=8, Dh=128, paged, layout 0): "
                      f"{result['op_s'] * 1e3:.3f} ms."]
    return "\n".join(lines) + "\n"


def machine() -> str:
    import platform

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, numpy {np.__version__}"


def load_average() -> str:
    """The 1-minute load average: how many runnable processes shared the cores (other jobs included)."""
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "unknown"


def main(argv=None, prog: str = None) -> int:
    parser = OneLineParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=at_least(1), default=2000)
    parser.add_argument("--prompt-len", type=at_least(1), default=1024)
    parser.add_argument("--shared", type=at_least(0), default=512, help="shared system-prompt tokens")
    parser.add_argument("--families", type=at_least(1), default=8)
    parser.add_argument("--page-size", type=at_least(1), default=16)
    parser.add_argument("--pages", type=at_least(1), default=32768, help="pool size (the workload overflows it: eviction)")
    parser.add_argument("--batch", type=at_least(1), default=256)
    parser.add_argument("--kvlen", type=at_least(1), default=1024)
    parser.add_argument("--steps", type=at_least(1), default=64, help="decode steps per round")
    parser.add_argument("--repeats", type=at_least(1), default=5, help="rounds")
    parser.add_argument("--mixed-kvlens", type=at_least(1), nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--mixed-prefills", type=at_least(0), nargs="+", default=[0, 4, 16, 64])
    parser.add_argument("--prefill-len", type=at_least(1), default=128)
    parser.add_argument("--chat-conversations", type=at_least(1), default=64)
    parser.add_argument("--chat-turns", type=at_least(1), default=6)
    parser.add_argument("--chat-user-len", type=at_least(1), default=48)
    parser.add_argument("--chat-reply-len", type=at_least(1), default=32)
    parser.add_argument("--chat-concurrent", type=at_least(1), default=16)
    parser.add_argument("--chat-pages", type=at_least(1), default=1024)
    parser.add_argument("--baseline", type=pathlib.Path, help="folder holding another revision's 'manager' package")
    parser.add_argument("--baseline-name", default="baseline", help="its name in the tables")
    parser.add_argument("--out", type=out_folder)
    args = parser.parse_args(argv)
    if len(args.mixed_prefills) < 2:
        parser.error("--mixed-prefills needs at least two counts (the second is used for the context sweep)")
    if args.baseline_name in ("manager", "seed", ARRAYS):
        parser.error(f"--baseline-name {args.baseline_name!r} is this package's own row's name: choose another")
    if args.shared > args.prompt_len:
        parser.error(f"--shared {args.shared} exceeds --prompt-len {args.prompt_len}")
    if args.pages < -(-args.prompt_len // args.page_size):
        parser.error(f"--pages {args.pages} cannot hold one prompt of --prompt-len {args.prompt_len} "
                     f"(pages of {args.page_size})")
    chat_needs = work.chat_pages_needed(args.chat_turns, args.chat_user_len, args.chat_reply_len,
                                        args.chat_concurrent, args.page_size)
    if args.chat_pages < chat_needs:
        parser.error(f"--chat-pages {args.chat_pages} cannot hold {args.chat_concurrent} conversations at once "
                     f"(at least {chat_needs})")
    baseline = None
    if args.baseline:
        try:
            baseline = work.load_manager_class(args.baseline)
        except (OSError, ImportError, AttributeError) as error:
            parser.error(f"--baseline {args.baseline}: {error}")
    command = recorded_command("kvcache_op.benchmarks.manager.bench", argv)
    load_at_start = load_average()
    from ...manager import KVCacheManager

    managers = {"manager": KVCacheManager}
    if baseline is not None:
        managers[args.baseline_name] = baseline
    names = list(managers)

    prompts = work.shared_prefix_prompts(args.requests, args.prompt_len, args.shared, args.families)
    tokens = sum(len(p) for p in prompts)
    match = {}
    for name, rounds in side_by_side(managers, min(args.repeats, 3), lambda cls, _: work.match_insert_seconds(
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
        for name in decode_columns(names):
            f = figures[name]
            print(f"decode step ({kind}), {args.batch} sequences, kvlen {args.kvlen}, {name}: median "
                  f"{f['median_s'] * 1e3:.3f} ms (schedule {f['schedule_s'] * 1e3:.3f}, commit {f['commit_s'] * 1e3:.3f}),"
                  f" mean {f['mean_s'] * 1e3:.3f} ms; CPU time median {f['cpu_median_s'] * 1e3:.3f} ms,"
                  f" mean {f['cpu_mean_s'] * 1e3:.3f} ms")
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

    result = {"command": command, "machine": f"{machine()}; load average {load_at_start} at the start, "
                                             f"{load_average()} at the end", "args": {k: v for k, v in vars(args).items()
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
