"""The sampling graph against the host's sampler on the same logits: ``--rows`` rows of ``--vocab`` logits (normal,
times 4: peaked as a trained model's are, not flat), per setting the median time of the host's ``choose_tokens``
and of the sampling graph on each provider at hand, in interleaved rounds, and the host's time over the graph's.
On a device the graph reads logits already there, and the host's time includes copying them to the host, as the
engine's host sampling does.

    python -m kvcache_op.benchmarks.serving.sampler [--rows 64] [--vocab 32000] [--dtype float16] [--out DIR]
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ...arguments import OneLineParser, at_least, out_folder
from ..environment import recorded_command
from ..timing import cpu_device, ort_version
from .report import publish

#: The settings timed: each request's temperature, top-p and top-k.
SETTINGS = {"temperature 0.8": dict(temperature=0.8), "and top_p 0.9": dict(temperature=0.8, top_p=0.9),
            "and top_k 50": dict(temperature=0.8, top_k=50)}


def _graph(provider: str, dtype: str):
    """A function running the sampling graph on ``provider`` over a logits OrtValue; tokens to the host."""
    from onnx import TensorProto

    from ...ort_ops import make_session
    from ...serving.sampler_graph import COMPLETE, LOGITS, SORT_WIDTH, TOKENS, sampler_model

    element = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    session = make_session(sampler_model(element), (provider,),
                           disable_cpu_fallback=provider != "CPUExecutionProvider")

    def run(logits, feeds):
        binding = session.io_binding()
        binding.bind_ortvalue_input(LOGITS, logits)
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output(TOKENS, "cpu")
        binding.bind_output(COMPLETE, "cpu")
        session.run_with_iobinding(binding)
        tokens, complete = (value.numpy() for value in binding.get_outputs())
        if not complete.all():  # the engine would draw these rows on the host: not what this times
            raise RuntimeError(f"{int((~complete).sum())} rows' nuclei lie past the {feeds[SORT_WIDTH][0]} tokens "
                               "sorted")
        return tokens
    return run


def measure(logits: np.ndarray, rounds: int, providers: list) -> dict:
    """Per setting and provider, the host's and the graph's times (seconds, one per round) over ``logits`` (float16
    or float32, ``[rows, vocab]``)."""
    import onnxruntime as ort

    from ...serving.sampler_graph import sampler_feeds
    from ...serving.sampling import SamplingParams, choose_tokens

    rows, vocab = logits.shape
    dtype = logits.dtype.name
    histories = [((), ())] * rows
    times = {}
    for provider in providers:
        device = "cuda" if provider == "CUDAExecutionProvider" else "cpu"
        value = ort.OrtValue.ortvalue_from_numpy(logits, device, 0)
        graph = _graph(provider, dtype)
        for name, fields in SETTINGS.items():
            params = [SamplingParams(**fields)] * rows
            generators = [np.random.default_rng(r) for r in range(rows)]

            def host():
                return choose_tokens(value.numpy(), params, histories, generators)  # numpy(): a copy off a device

            def in_graph():
                return graph(value, sampler_feeds(params, [g.random() for g in generators], vocab))
            samples = {"host": [], "graph": []}
            for _ in range(2):  # warm-up
                host(), in_graph()
            for _ in range(rounds):
                for kind, fn in (("host", host), ("graph", in_graph)):
                    start = time.perf_counter()
                    fn()
                    samples[kind].append(time.perf_counter() - start)
            times[f"{provider}|{name}"] = samples
            print(f"{provider}, {name}: host {statistics.median(samples['host']) * 1e3:.1f} ms, graph "
                  f"{statistics.median(samples['graph']) * 1e3:.1f} ms", flush=True)
    return times


def table(result: dict) -> str:
    """A markdown table of the medians and the host / graph ratio."""
    lines = [result["header"], "", "| provider | setting | host ms | graph ms | host / graph |",
             "| --- | --- | ---: | ---: | ---: |"]
    for key, samples in result["times"].items():
        provider, name = key.split("|")
        host, graph = statistics.median(samples["host"]), statistics.median(samples["graph"])
        lines.append(f"| {provider} | {name} | {host * 1e3:.1f} | {graph * 1e3:.1f} | {host / graph:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import onnxruntime as ort

    parser = OneLineParser(prog="python -m kvcache_op.benchmarks.serving.sampler",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=at_least(1), default=64, help="rows of logits (requests sampled at once)")
    parser.add_argument("--vocab", type=at_least(2), default=32000, help="logits a row")
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    parser.add_argument("--rounds", type=at_least(1), default=7, help="timed rounds (medians are reported)")
    parser.add_argument("--out", type=out_folder, help="write README.md and results.json here")
    args = parser.parse_args(argv)
    providers = ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    logits = (np.random.default_rng(0).standard_normal((args.rows, args.vocab)) * 4).astype(args.dtype)
    times = measure(logits, args.rounds, providers)
    command = recorded_command("kvcache_op.benchmarks.serving.sampler", argv)
    header = (f"{args.rows} rows of {args.vocab:,} {args.dtype} logits; {cpu_device()}; onnxruntime {ort_version()}; "
              f"median of {args.rounds} interleaved rounds.\n\n    {command}")
    result = {"header": header, "times": times}
    publish(args.out, "The sampling graph against the host's sampler", result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
