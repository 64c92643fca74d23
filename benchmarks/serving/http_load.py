"""HTTP load on ``kvcache-op serve``: a Poisson stream of streamed chat requests sent with the official ``openai``
async client to a server on loopback (started here on a checkpoint folder made here, stopped at the end), sharing a
few system prompts as a chat service's requests do. Reports the sustained request rate, tokens/s, and time to first
token and inter-token latency (p50/p99) as the client sees them. Bounded in requests and seconds. Needs the
``serve`` and ``hf`` extras and ``openai``.

    python -m kvcache_op.benchmarks.serving.http_load --out benchmarks/serving/http
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import tempfile
import time

from ...arguments import OneLineParser, at_least, out_folder, positive_seconds
from ..environment import recorded_command
from ..timing import cpu_device, ort_version
from .bench import MODELS
from .report import arrivals, ms, publish
from .online import percentiles

SYSTEM_PROMPTS = ["You are a careful assistant. Answer briefly and cite the cache page you read. " * 2,
                  "You translate the user's words into French, keeping the accents: café, naïve, résumé. " * 2,
                  "You summarize text about paged attention, prefix caching and quantized keys. " * 2,
                  "You are a tutor. The quick brown fox jumps over the lazy dog; explain each word. " * 2]


async def drive(url: str, api_key: str, requests: int, rate: float, max_tokens: int, time_limit: float,
                seed: int = 1) -> dict:
    """Sends ``requests`` streamed chat requests at Poisson times of ``rate``/s (stopping new sends after
    ``time_limit`` s, and cancelling what runs at twice that); returns the client-side figures."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=time_limit * 2)
    ttft, itl, tokens, errors = [], [], [], []

    async def one(i: int):
        messages = [{"role": "system", "content": SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)]},
                    {"role": "user", "content": f"request {i}: what does the cache keep?"}]
        sent = time.perf_counter()
        try:
            stream = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            times = []
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    times.append(time.perf_counter())
                if chunk.usage is not None:
                    tokens.append(chunk.usage.completion_tokens)
            if times:
                ttft.append(times[0] - sent)
                itl.extend(b - a for a, b in zip(times, times[1:]))
        except Exception as error:  # noqa: BLE001 - counted and reported, the run goes on
            errors.append(f"{type(error).__name__}: {error}"[:200])

    began = time.perf_counter()
    tasks = []
    for i, due in enumerate(arrivals(requests, rate, seed)):
        if due > time_limit:
            break
        await asyncio.sleep(max(0.0, began + due - time.perf_counter()))
        tasks.append(asyncio.create_task(one(i)))
    pending = ()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(1.0, 2 * time_limit - (time.perf_counter() - began)))
    for task in pending:
        task.cancel()
    wall = time.perf_counter() - began
    await client.close()
    return {"sent": len(tasks), "completed": len(tokens), "errors": len(errors), "error_samples": errors[:3],
            "unfinished": len(pending), "wall_s": wall, "requests_per_s": len(tokens) / wall,
            "tokens_per_s": sum(tokens) / wall, "ttft": percentiles(ttft), "itl": percentiles(itl)}


def table(result: dict) -> str:
    """A markdown table of the load's figures ("-" where no request gave one), then any errors' first reasons."""
    r = result["load"]
    lines = [
        result["header"], "",
        "| sent | completed | errors | unfinished | req/s | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {r['sent']} | {r['completed']} | {r['errors']} | {r['unfinished']} | {r['requests_per_s']:.2f} | "
        f"{r['tokens_per_s']:.0f} | {ms(r['ttft']['p50_ms'])} | {ms(r['ttft']['p99_ms'])} | {ms(r['itl']['p50_ms'])} | "
        f"{ms(r['itl']['p99_ms'])} |"]
    if r["error_samples"]:
        lines += ["", "Errors (the first of them):"] + [f"- {e}" for e in r["error_samples"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m kvcache_op.benchmarks.serving.http_load",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=at_least(1), default=200)
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second (default 4)")
    parser.add_argument("--max-tokens", type=at_least(1), default=32)
    parser.add_argument("--time-limit", type=positive_seconds, default=120.0,
                        help="no request is sent after this many seconds (default 120)")
    parser.add_argument("--num-pages", type=at_least(1), default=512)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--out", type=out_folder, help="folder for results.json and README.md")
    args = parser.parse_args(argv)
    if not args.rate > 0:
        parser.error(f"--rate must be > 0, got {args.rate}")
    first = arrivals(args.requests, args.rate)[0]
    if first > args.time_limit:
        parser.error(f"no request would be sent: the first is due at {first:.2f} s, after --time-limit "
                     f"{args.time_limit:g} s (raise --rate or --time-limit)")
    from ...hf import tiny_checkpoint
    from ...serve_command import ServerProcess

    sizes = {k: v for k, v in MODELS[args.model].items() if k != "vocab_size"}  # the tokenizer sets the vocabulary
    key = secrets.token_hex(16)
    with tempfile.TemporaryDirectory() as folder:
        model, _ = tiny_checkpoint(f"{folder}/checkpoint", **sizes)
        print(f"starting the server on {args.model} ...", file=sys.stderr, flush=True)
        with ServerProcess(f"{folder}/checkpoint", "--api-key", key, "--cache-dir", f"{folder}/cache",
                           "--num-pages", args.num_pages, "--model-name", "tiny",
                           lifetime=3 * args.time_limit + 120) as server:
            print(f"load: {args.requests} requests at {args.rate}/s on {server.url} ...", file=sys.stderr, flush=True)
            load = asyncio.run(drive(server.url, key, args.requests, args.rate, args.max_tokens, args.time_limit))
    command = recorded_command("kvcache_op.benchmarks.serving.http_load", argv)
    result = {"header": f"Command: `{command}` — {cpu_device()}, onnxruntime {ort_version()}; server and "
                        f"client on one machine (loopback); {args.model} Llama ({model.config.num_hidden_layers} x "
                        f"{model.config.hidden_size}), streamed chat requests over 4 shared system prompts, "
                        f"{args.max_tokens} new tokens each",
              "load": load}
    publish(args.out, "HTTP load on kvcache-op serve", result, table(result))
    if load["errors"] or load["unfinished"]:
        print(f"http_load: {load['errors']} of {load['sent']} requests failed and {load['unfinished']} did not finish",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
