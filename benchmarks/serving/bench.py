"""Per-step cost of serving: Python scheduling and feed building vs the ONNX Runtime run, for a decode
batch at a given context length (``python -m kvcache_op.benchmarks.serving.bench``; needs the ``hf`` extra).

Every request shares a long system prompt (prefilled once, then prefix hits) plus a short own part, so
the measured decode steps have the full batch at about ``--context`` keys each. Figures are medians
over the decode steps in which every request decodes; "after run" is committing the step, choosing the
tokens (greedy, or sampled with ``--temperature`` / ``--top-p``, each request seeded) and retiring finished
requests. The engine plans one decode step at a time here, so that each step's
record holds its own host work (planned many at once, as the engine does by default, the planning of a run of steps
lands on the step before it and the steps themselves record none: ``serving.one_stream`` measures that form).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

import numpy as np

from ...arguments import OneLineParser, at_least, out_folder
from ...serving.sampling import GREEDY_BELOW
from ..timing import cpu_device, ort_version
from ..environment import recorded_command
from .report import check_fits, pages_for, publish

#: Tokens of each prompt's own after the shared system prompt (or, ``distinct``, its own long part).
OWN_TOKENS = 16

MODELS = {  # name -> transformers config overrides of the demo's tiny decoder
    "tiny": dict(max_position_embeddings=4096),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096),
}


def measure(model_name: str, requests: int, context: int, decode_steps: int, threads: int, folder: str,
            fused: bool = True, distinct: bool = False, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Runs the scenario for one model exported with ``fused`` attention (MultiHeadCacheAttention; False: the
    split pair KeyValueCache + MultiHeadAttention); returns the medians of its full decode steps. ``distinct``:
    every prompt its own (no shared system prompt, so no page is read by two sequences). ``temperature`` above 0:
    the tokens are sampled (``top_p``, request i seeded with i, end-of-sequence ignored so every request decodes
    every step)."""
    from kvcache_op.hf import export_model, tiny_model
    from kvcache_op.serving import Engine, SamplingParams

    model = tiny_model("llama", **MODELS[model_name])
    path = export_model(model, os.path.join(folder, f"{model_name}-{fused}.onnx"), fused_attention=fused)
    rng = np.random.default_rng(0)
    system = rng.integers(0, model.config.vocab_size, context - OWN_TOKENS).tolist()
    prompts = [(rng.integers(0, model.config.vocab_size, context - OWN_TOKENS).tolist() if distinct else system) +
               rng.integers(0, model.config.vocab_size, OWN_TOKENS).tolist() for _ in range(requests)]
    pages_each = pages_for(context + decode_steps)
    # Two prompts a step, within the positions a step may feed (the rotary tables' rows).
    budget = min(2 * context, MODELS[model_name]["max_position_embeddings"])
    engine = Engine(path, num_pages=requests * pages_each + 8, max_batch_tokens=budget, max_running=requests,
                    intra_op_num_threads=threads, trace_steps=True, decode_steps=1)
    params = None if not temperature else [
        SamplingParams(max_tokens=decode_steps, temperature=temperature, top_p=top_p, seed=i, ignore_eos=True)
        for i in range(requests)]
    engine.generate(prompts, decode_steps, arrival_steps=[0] + [1] * (requests - 1), params=params)
    params = sum(p.numel() for p in model.parameters())
    return dict(model=model_name, attention="fused" if fused else "split", params=params,
                layers=model.config.num_hidden_layers, hidden=model.config.hidden_size,
                **full_step_figures(engine.step_trace, requests))


def full_step_figures(trace: list, requests: int) -> dict:
    """The medians over the steps of ``trace`` in which all ``requests`` decode: each part of a step in ms, the
    keys attended, the host's share of the run (median parts) and decode tokens/s (``requests`` over the median
    step's whole time, not over a sum of the parts' medians, which no step took)."""
    full = [s for s in trace if s["sequences"] == requests and s["decodes"] == requests]
    if not full:
        raise RuntimeError("no step decoded the whole batch: raise --decode-steps")
    parts = ("scheduling_s", "ort_run_s", "after_run_s")
    med = {k: statistics.median(s[k] for s in full) * 1e3 for k in parts}
    step_s = statistics.median(sum(s[k] for k in parts) for s in full)
    return dict(steps=len(full), kv=statistics.median(s["kv_tokens"] for s in full),
                scheduling_ms=med["scheduling_s"], ort_ms=med["ort_run_s"], after_ms=med["after_run_s"],
                host_share=(med["scheduling_s"] + med["after_run_s"]) / med["ort_run_s"],
                tokens_per_s=requests / step_s)


def table(rows: list, command: str, requests: int, threads: int, sampling: str = "greedy") -> str:
    """A markdown table of the measurements, with the command and machine."""
    lines = [f"Command: `{command}`", "",
             f"Machine: {cpu_device()}, onnxruntime {ort_version()}, CPU EP, {threads or 'default'} "
             f"intra-op threads, {requests} requests decoding together ({sampling}), one decode step planned at a "
             "time.", "",
             "| model | attention | parameters | layers x hidden | decode steps | keys attended per step "
             "| scheduling + feeds ms | ONNX Runtime run ms | after run ms | host / run | decode tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['attention']} | {r['params'] / 1e6:.2f} M | {r['layers']} x {r['hidden']} | "
                     f"{r['steps']} | {r['kv']:.0f} | {r['scheduling_ms']:.3f} | {r['ort_ms']:.3f} | "
                     f"{r['after_ms']:.3f} | {r['host_share']:.1%} | {r['tokens_per_s']:.0f} |")
    split = {r["model"]: r for r in rows if r["attention"] == "split"}
    for r in rows:
        if r["attention"] == "fused" and r["model"] in split:
            lines.append(f"\n{r['model']}: the fused export decodes {r['tokens_per_s'] / split[r['model']]['tokens_per_s']:.2f}x "
                         f"the split pair's tokens/s.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """Measures each ``--model``; prints the table and writes it to ``--out``/README.md when given."""
    parser = OneLineParser(prog="bench_serving", description=__doc__)
    parser.add_argument("--model", action="append", choices=sorted(MODELS), help="default: every model")
    parser.add_argument("--requests", type=at_least(1), default=64)
    parser.add_argument("--context", type=at_least(1), default=1024)
    parser.add_argument("--decode-steps", type=at_least(1), default=24)
    parser.add_argument("--threads", type=at_least(0), default=0, help="ONNX Runtime intra-op threads (0: its default)")
    parser.add_argument("--attention", choices=("fused", "split", "both"), default="both",
                        help="the export's attention: MultiHeadCacheAttention, the split pair, or both side by side")
    parser.add_argument("--distinct", action="store_true",
                        help="every prompt its own (default: a shared system prompt plus 16 own tokens)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample each request's tokens at this temperature (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling's mass")
    parser.add_argument("--out", type=out_folder, help="folder for results.json and README.md")
    args = parser.parse_args(argv)
    try:  # the engine's own checks, before the export
        from kvcache_op.serving import SamplingParams

        greedy = SamplingParams(temperature=args.temperature, top_p=args.top_p).greedy
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    if greedy and args.temperature:
        parser.error(f"--temperature {args.temperature:g} is greedy (the engine samples from {GREEDY_BELOW:g} up): "
                     "give 0 for greedy or a larger one")
    if args.top_p < 1.0 and greedy:
        parser.error("--top-p samples: give a --temperature above 0 with it")
    if args.context < OWN_TOKENS:
        parser.error(f"--context must be at least {OWN_TOKENS} (each prompt ends in {OWN_TOKENS} tokens of its own), "
                     f"got {args.context}")
    if args.requests > 1 and args.decode_steps < 3:
        parser.error(f"--decode-steps must be at least 3 with more than one request (the first arrives a step before "
                     f"the rest, so the whole batch decodes together from the third step), got {args.decode_steps}")
    for name in args.model or MODELS:
        check_fits(parser, args.context, args.decode_steps, None, MODELS[name]["max_position_embeddings"])
    forms = {"fused": (True,), "split": (False,), "both": (False, True)}[args.attention]
    with tempfile.TemporaryDirectory() as folder:
        rows = []
        for name in args.model or sorted(MODELS, key=list(MODELS).index):
            for fused in forms:
                print(f"measuring {name}, {'fused' if fused else 'split'} attention ({args.requests} requests at "
                      f"~{args.context} keys) ...", file=sys.stderr)
                rows.append(measure(name, args.requests, args.context, args.decode_steps, args.threads, folder, fused,
                                    args.distinct, args.temperature, args.top_p))
    command = recorded_command("kvcache_op.benchmarks.serving.bench", argv)
    sampling = (f"sampled at temperature {args.temperature:g}" + (f", top_p {args.top_p:g}" if args.top_p < 1 else "")
                if args.temperature else "greedy")
    result = {"command": command, "machine": cpu_device(), "onnxruntime": ort_version(), "requests": args.requests,
              "threads": args.threads, "sampling": sampling, "rows": rows}
    publish(args.out, "Serving: per-step cost", result, table(rows, command, args.requests, args.threads, sampling))
    return 0


if __name__ == "__main__":
    sys.exit(main())
