"""Online serving latency: a Poisson stream of requests submitted while others run (``Engine.submit``), time to
first token and inter-token latency (p50/p99) and tokens/s, beside the same requests through one ``generate``
batch call (all at once). Requests share a few system prompts (as a server's do). Needs the ``hf`` extra.

    python -m kvcache_op.benchmarks.serving.online --out benchmarks/serving/online
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time

import numpy as np

from ...arguments import OneLineParser, at_least, out_folder
from ..environment import recorded_command
from ..timing import cpu_device, ort_version
from .bench import MODELS
from .report import arrivals, check_fits, ms, publish


#: A request's prompt: one of 4 shared system prompts of 64 tokens, then 16 of its own.
SYSTEM_TOKENS, OWN_TOKENS = 64, 16
PROMPT_TOKENS = SYSTEM_TOKENS + OWN_TOKENS


def workload(requests: int, vocab: int, seed: int = 0) -> list:
    """Prompts: one of 4 shared system prompts of SYSTEM_TOKENS, then OWN_TOKENS of the request's own."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab, SYSTEM_TOKENS).tolist() for _ in range(4)]
    return [systems[i % 4] + rng.integers(0, vocab, OWN_TOKENS).tolist() for i in range(requests)]


def percentiles(values: list) -> dict:
    """p50 and p99 in milliseconds (None without values)."""
    if not values:
        return {"p50_ms": None, "p99_ms": None}
    return {"p50_ms": float(np.percentile(values, 50)) * 1e3, "p99_ms": float(np.percentile(values, 99)) * 1e3}


def run_online(engine, prompts: list, rate: float, max_tokens: int, seed: int = 1) -> dict:
    """Submits ``prompts`` at Poisson arrival times of ``rate`` per second from one client thread; returns
    TTFT and ITL percentiles and tokens/s over the whole stream. TTFT counts from the client's call of ``submit``
    (any wait of the call for a running step included), as the batch side's counts from its call of ``generate``;
    an exception of the client is raised here, not left behind in its thread."""
    from ...serving import SamplingParams

    handles, sent, failed = [], [], []

    def client():
        try:
            start = time.perf_counter()
            for prompt, due in zip(prompts, arrivals(len(prompts), rate, seed)):
                delay = start + due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                sent.append(time.perf_counter())
                handles.append(engine.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        except BaseException as error:  # handed to the caller below
            failed.append(error)

    began = time.perf_counter()
    thread = threading.Thread(target=client)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    for h in handles:
        h.result(timeout=600)
    wall = time.perf_counter() - began
    ttft = [h.token_times[0] - at for h, at in zip(handles, sent)]
    itl = [b - a for h in handles for a, b in zip(h.token_times, h.token_times[1:])]
    tokens = sum(len(h.tokens) for h in handles)
    return {"ttft": percentiles(ttft), "itl": percentiles(itl), "tokens_per_s": tokens / wall, "wall_s": wall}


def run_batch(engine, prompts: list, max_tokens: int) -> dict:
    """The same requests through one ``generate`` call, all arriving at its start."""
    from ...serving import SamplingParams

    times = [[] for _ in prompts]
    began = time.perf_counter()
    results = engine.generate(prompts, max_tokens, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                              on_token=lambda i, token: times[i].append(time.perf_counter()))
    wall = time.perf_counter() - began
    ttft = [t[0] - began for t in times]
    itl = [b - a for t in times for a, b in zip(t, t[1:])]
    return {"ttft": percentiles(ttft), "itl": percentiles(itl), "tokens_per_s": sum(map(len, results)) / wall,
            "wall_s": wall}


def host_share(engine) -> float:
    """The engine's host work (scheduling, feeds, commit, sampling) as a share of its ONNX Runtime time."""
    m = engine.metrics()
    return (m["time_scheduling_s"] + m["time_other_s"]) / m["time_ort_run_s"] if m["time_ort_run_s"] else 0.0


def table(result: dict) -> str:
    """A markdown table of both modes."""
    lines = [result["header"], "", "| mode | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tokens/s | wall s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode in ("online", "batch"):
        r = result[mode]
        lines.append(f"| {mode} | {ms(r['ttft']['p50_ms'])} | {ms(r['ttft']['p99_ms'])} | {ms(r['itl']['p50_ms'])} | "
                     f"{ms(r['itl']['p99_ms'])} | {r['tokens_per_s']:.0f} | {r['wall_s']:.2f} |")
    lines += ["", f"Online engine host work: {result['online_host_share']:.1%} of its ONNX Runtime time."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m kvcache_op.benchmarks.serving.online", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=at_least(1), default=200)
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second (default 4)")
    parser.add_argument("--max-tokens", type=at_least(1), default=32)
    parser.add_argument("--num-pages", type=at_least(1), default=256)
    parser.add_argument("--decode-steps", type=at_least(1), default=None,
                        help="decode steps the engine plans at once (default: the engine's, 64)")
    parser.add_argument("--model", choices=sorted(MODELS), default="small",
                        help="the decoder (the serving benchmark's: tiny 3 x 64, small 4 x 256; default small)")
    parser.add_argument("--out", type=out_folder, help="folder for results.json and README.md")
    args = parser.parse_args(argv)
    if not args.rate > 0:
        parser.error(f"--rate must be > 0, got {args.rate}")
    check_fits(parser, PROMPT_TOKENS, args.max_tokens, args.num_pages, MODELS[args.model]["max_position_embeddings"])
    from ...hf import export_model, tiny_model
    from ...serving import Engine

    model = tiny_model("llama", **MODELS[args.model])
    prompts = workload(args.requests, model.config.vocab_size)
    with tempfile.TemporaryDirectory() as folder:
        path = export_model(model, os.path.join(folder, f"{args.model}.onnx"))
        print(f"online: {args.requests} requests at {args.rate}/s ...", file=sys.stderr, flush=True)
        online_engine = Engine(path, num_pages=args.num_pages, decode_steps=args.decode_steps)
        online = run_online(online_engine, prompts, args.rate, args.max_tokens)
        online_engine.close(timeout=60)
        print("batch: the same requests in one generate call ...", file=sys.stderr, flush=True)
        batch = run_batch(Engine(path, num_pages=args.num_pages, decode_steps=args.decode_steps), prompts, args.max_tokens)
    command = recorded_command("kvcache_op.benchmarks.serving.online", argv)
    result = {"header": f"Command: `{command}` — {cpu_device()}, onnxruntime {ort_version()}; {args.model} Llama "
                        f"({model.config.num_hidden_layers} x {model.config.hidden_size}), {args.requests} requests of {PROMPT_TOKENS} prompt tokens (4 shared system prompts) + "
                        f"{args.max_tokens} new tokens",
              "online": online, "batch": batch, "online_host_share": host_share(online_engine)}
    publish(args.out, "Online serving latency", result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
