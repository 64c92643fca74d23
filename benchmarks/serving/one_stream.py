"""The engine's host work on one stream: one request (a 128-token prompt, then ``--tokens`` greedy tokens) through
``Engine.generate`` with each ``--decode-steps`` setting, in interleaved rounds, and the host's share of the step:
the engine's busy time outside ONNX Runtime runs (``wall_s - time_ort_run_s`` of ``metrics()``: admission,
planning, feeds, binding, handing tokens over, committing) over its time in them. Needs the ``hf`` extra.

    python -m kvcache_op.benchmarks.serving.one_stream --out benchmarks/serving/one_stream
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

from ...arguments import OneLineParser, at_least, out_folder
from ..timing import cpu_device, ort_version
from .bench import MODELS
from ..environment import recorded_command
from .report import pages_for, publish


#: Tokens of each round's prompt.
PROMPT_TOKENS = 128


def measure(engine, prompt: list, tokens: int) -> dict:
    """One ``generate`` of ``tokens`` greedy tokens after ``prompt``: tokens/s, the run and the host's time per
    step, and the host's share of the run (from the engine's own counters), with the steps, the tokens fed to the
    model and the prompt tokens served from the prefix cache."""
    from ...serving import SamplingParams

    before = engine.metrics()
    engine.generate([prompt], tokens, params=SamplingParams(max_tokens=tokens, ignore_eos=True))
    after = engine.metrics()
    run = after["time_ort_run_s"] - before["time_ort_run_s"]
    wall = after["wall_s"] - before["wall_s"]
    steps = after["steps"] - before["steps"]
    return {"tokens_per_s": tokens / wall, "run_us": run / steps * 1e6, "host_us": (wall - run) / steps * 1e6,
            "host_share": (wall - run) / run, "steps": steps,
            "fed_tokens": after["fed_tokens"] - before["fed_tokens"],
            "prefix_hit_tokens": after["prefix_hit_tokens"] - before["prefix_hit_tokens"]}


def table(result: dict) -> str:
    """A markdown table: per setting, the median and range of the rounds."""
    lines = [result["header"], "", "| decode steps planned at once | host / run (median) | host / run (range) | "
             "host us a step | run us a step | tokens/s |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for steps, rounds in result["rounds"].items():
        share = [r["host_share"] for r in rounds]
        med = {k: float(np.median([r[k] for r in rounds])) for k in rounds[0]}
        lines.append(f"| {steps} | {med['host_share']:.1%} | {min(share):.1%}-{max(share):.1%} | "
                     f"{med['host_us']:.0f} | {med['run_us']:.0f} | {med['tokens_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m kvcache_op.benchmarks.serving.one_stream",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("--decode-steps", type=at_least(1), action="append",
                        help="a decode_steps setting to measure (repeatable; default: 1, 8 and 64)")
    parser.add_argument("--tokens", type=at_least(2), default=256, help="tokens generated per round (default 256)")
    parser.add_argument("--rounds", type=at_least(1), default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--model", choices=sorted(MODELS), default="small",
                        help="the decoder (the serving benchmark's: tiny 3 x 64, small 4 x 256; default small)")
    parser.add_argument("--out", type=out_folder, help="folder for results.json and README.md")
    args = parser.parse_args(argv)
    from ...hf import export_model, tiny_model
    from ...serving import Engine, SamplingParams

    settings = args.decode_steps or [1, 8, 64]
    model = tiny_model("llama", **MODELS[args.model])
    # A fresh prompt for the warm-up and for each round (the same for every setting in a round, each setting's
    # engine its own): a prompt seen before would be served from the prefix cache, all but its last page.
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, PROMPT_TOKENS).tolist() for _ in range(args.rounds + 1)]
    with tempfile.TemporaryDirectory() as folder:
        path = export_model(model, os.path.join(folder, f"{args.model}.onnx"))
        pages = 2 * pages_for(PROMPT_TOKENS + args.tokens + max(settings))  # room for every planned step's pages
        engines = {k: Engine(path, num_pages=pages, decode_steps=k) for k in settings}
        for engine in engines.values():  # warm: the first step of a session is slow
            engine.generate([prompts[-1]], 8, params=SamplingParams(max_tokens=8, ignore_eos=True))
        rounds = {k: [] for k in settings}
        for r in range(args.rounds):
            print(f"round {r + 1} of {args.rounds} ...", file=sys.stderr, flush=True)
            for k, engine in engines.items():
                rounds[k].append(measure(engine, prompts[r], args.tokens))
    command = recorded_command("kvcache_op.benchmarks.serving.one_stream", argv)
    result = {"header": f"Command: `{command}` — {cpu_device()}, onnxruntime {ort_version()}; {args.model} Llama "
                        f"({model.config.num_hidden_layers} x {model.config.hidden_size}), one request: "
                        f"{PROMPT_TOKENS} prompt tokens (a fresh prompt each round: no prefix cache hits) + "
                        f"{args.tokens} greedy tokens, {args.rounds} interleaved rounds",
              "rounds": rounds}
    publish(args.out, "The engine's host work on one stream", result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
