"""kvcache-op beside what a user would otherwise run, on the same weights: ONNX Runtime GenAI (its model builder's
fp32 CPU export) and ``transformers``' own ``generate``, greedy, the same prompts, tokens compared, medians of
repeats, side by side in one run, each system warmed by a short untimed generation first. Rows: one stream; 32 requests at
once; 32 requests of 1,000-token prompts, half sharing a 900-token prefix. Needs the ``hf`` extra and
``onnxruntime-genai``.

    python -m kvcache_op.benchmarks.serving.peers --out benchmarks/serving/peers
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from ...arguments import OneLineParser, at_least, out_folder
from ..timing import cpu_device, ort_version
from ..environment import recorded_command
from .report import pages_for, publish

PEER_MODELS = {  # name -> Llama sizes (the vocabulary is the tiny checkpoint's tokenizer's)
    "256x4": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=4096),
    "1024x8": dict(hidden_size=1024, intermediate_size=2752, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=4, max_position_embeddings=4096),
}


#: Each system first generates 2 tokens after this many prompt tokens, untimed, on the session (model, engine)
#: the timed run uses: a server's sessions are warm, and a fresh ONNX Runtime session's first run costs several
#: times a warm one's (its memory plans and arenas), which would otherwise land in whichever run comes first.
WARM_UP_TOKENS = 8


def workloads(vocab: int, seed: int = 0) -> dict:
    """name -> prompts (equal lengths within a row: GenAI's batch takes one length)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(2, vocab, 900).tolist()
    return {
        "1 x 128": [rng.integers(2, vocab, 128).tolist()],
        "32 x 128": [rng.integers(2, vocab, 128).tolist() for _ in range(32)],
        "32 x 1000, 16 share 900": [shared + rng.integers(2, vocab, 100).tolist() if i % 2 == 0 else
                                    rng.integers(2, vocab, 1000).tolist() for i in range(32)],
    }


def run_kvcache_op(path: str, prompts: list, new_tokens: int, num_pages: int, providers=None,
                   max_batch_tokens: int = None) -> tuple:
    """(tokens, seconds, where the time went) of the engine serving every prompt at once (``providers``,
    ``max_batch_tokens``: the engine's defaults where None). The last is the timed call's share of
    :meth:`Engine.metrics`: the ``max_batch_tokens`` it ran with, ``steps``, ``ort_run_s`` (the graph's runs: on a
    GPU its device time too, as each run ends with its tokens or logits on the host) and ``host_s`` (the rest of the
    wall time: scheduling, feeds, sampling)."""
    from ...serving import Engine, SamplingParams

    engine = Engine(path, num_pages=num_pages, providers=providers, max_batch_tokens=max_batch_tokens)
    engine.generate([prompts[0][:WARM_UP_TOKENS]], 2)  # warm, as each peer is (see WARM_UP_TOKENS)
    before = engine.metrics()
    began = time.perf_counter()
    tokens = engine.generate(prompts, new_tokens, params=SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    seconds = time.perf_counter() - began
    after = engine.metrics()
    engine.close()
    ort_run = after["time_ort_run_s"] - before["time_ort_run_s"]
    return tokens, seconds, {"max_batch_tokens": engine.max_batch_tokens, "steps": after["steps"] - before["steps"],
                             "ort_run_s": ort_run, "host_s": max(0.0, seconds - ort_run)}


def run_genai(folder: str, prompts: list, new_tokens: int) -> tuple:
    import onnxruntime_genai as og

    model = og.Model(folder)
    warm = og.GeneratorParams(model)  # warm, as each peer is (see WARM_UP_TOKENS)
    warm.set_search_options(max_length=WARM_UP_TOKENS + 2, min_length=WARM_UP_TOKENS + 2, do_sample=False, batch_size=1)
    warming = og.Generator(model, warm)
    warming.append_tokens(np.array([prompts[0][:WARM_UP_TOKENS]], np.int32))
    while not warming.is_done():
        warming.generate_next_token()
    del warming
    params = og.GeneratorParams(model)
    length = len(prompts[0]) + new_tokens
    params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=len(prompts))
    began = time.perf_counter()
    generator = og.Generator(model, params)
    generator.append_tokens(np.array(prompts, np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    seconds = time.perf_counter() - began
    return [[int(t) for t in generator.get_sequence(i)[len(prompts[0]):]] for i in range(len(prompts))], seconds


def run_transformers(model, prompts: list, new_tokens: int) -> tuple:
    """(tokens, seconds) of transformers' batched greedy generate on the model's device (equal prompt lengths)."""
    import torch

    ids = torch.tensor(prompts, device=model.device)
    with torch.no_grad():  # warm, as each peer is (see WARM_UP_TOKENS)
        model.generate(ids[:1, :WARM_UP_TOKENS], attention_mask=torch.ones_like(ids[:1, :WARM_UP_TOKENS]),
                       max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    return out[:, len(prompts[0]):].tolist(), seconds


def agreement(a: list, b: list, eos=()) -> float:
    """Share of positions where two runs chose the same token, up to the first end-of-sequence token of either:
    to generate every request's full length, GenAI and transformers ban it (min_length) while kvcache-op ignores it
    (ignore_eos), so after it the three legitimately continue differently."""
    pairs = []
    for ta, tb in zip(a, b):
        for x, y in zip(ta, tb):
            if x in eos or y in eos:
                break
            pairs.append((x, y))
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else 0.0


#: Seconds GenAI's model builder may take for one of the benchmark's small models (it takes seconds).
BUILDER_TIMEOUT_S = 600


def build_genai_model(checkpoint: str, out: str, cache: str, timeout: float = BUILDER_TIMEOUT_S) -> None:
    """Runs ONNX Runtime GenAI's model builder (fp32, CPU) on ``checkpoint`` into ``out``; a failure or a run past
    ``timeout`` seconds is a RuntimeError naming the last lines the builder printed."""
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", checkpoint, "-o", out, "-p", "fp32",
               "-e", "cpu", "-c", cache]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"GenAI's model builder did not finish within {timeout:g} s: {' '.join(command)}") from None
    if done.returncode:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"GenAI's model builder failed (exit {done.returncode}): {tail}")


def measure(name: str, sizes: dict, folder: str, new_tokens: int, repeats: int, rows, progress) -> list:
    """Every row of one model: tokens/s of the three systems (medians) and their token agreement."""
    import torch
    from transformers import AutoModelForCausalLM

    from ...hf import export_model, tiny_checkpoint

    checkpoint = os.path.join(folder, name)
    model, tokenizer = tiny_checkpoint(checkpoint, **sizes)
    path = export_model(model, os.path.join(folder, f"{name}.onnx"))
    genai = os.path.join(folder, f"{name}-genai")
    progress(f"{name}: GenAI's model builder (fp32, cpu) ...")
    build_genai_model(checkpoint, genai, os.path.join(folder, "hf-cache"))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    eos = {model.config.eos_token_id}
    results = []
    for row, prompts in workloads(len(tokenizer)).items():
        if rows and row not in rows:
            continue
        pages = len(prompts) * pages_for(len(prompts[0]) + new_tokens) + 16
        times = {"kvcache-op": [], "genai": [], "transformers": []}
        tokens = {}
        for repeat in range(repeats):
            progress(f"{name} {row}: repeat {repeat + 1}/{repeats}")
            tokens["kvcache-op"], t, _ = run_kvcache_op(path, prompts, new_tokens, pages)
            times["kvcache-op"].append(t)
            tokens["genai"], t = run_genai(genai, prompts, new_tokens)
            times["genai"].append(t)
            tokens["transformers"], t = run_transformers(reference, prompts, new_tokens)
            times["transformers"].append(t)
        generated = len(prompts) * new_tokens
        speed = {k: generated / float(np.median(v)) for k, v in times.items()}
        results.append({"model": name, "row": row, "tokens_per_s": speed,
                        "vs_genai": speed["kvcache-op"] / speed["genai"],
                        "vs_transformers": speed["kvcache-op"] / speed["transformers"],
                        "agreement": {"genai": agreement(tokens["kvcache-op"], tokens["genai"], eos),
                                      "transformers": agreement(tokens["kvcache-op"], tokens["transformers"], eos),
                                      "genai_vs_transformers": agreement(tokens["genai"], tokens["transformers"], eos)}})
    return results


def table(result: dict) -> str:
    lines = [result["header"], "",
             "| model | row | kvcache-op tok/s | GenAI tok/s | transformers tok/s | vs GenAI | vs transformers | "
             "same tokens as GenAI / transformers (to the first EOS) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        s, a = r["tokens_per_s"], r["agreement"]
        lines.append(f"| {r['model']} | {r['row']} | {s['kvcache-op']:.0f} | {s['genai']:.0f} | {s['transformers']:.0f} "
                     f"| {r['vs_genai']:.2f}x | {r['vs_transformers']:.2f}x | {a['genai']:.1%} / "
                     f"{a['transformers']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m kvcache_op.benchmarks.serving.peers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(PEER_MODELS), default=sorted(PEER_MODELS))
    parser.add_argument("--rows", nargs="+", choices=list(workloads(100)), help="rows to run (default all)")
    parser.add_argument("--new-tokens", type=at_least(1), default=32)
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--out", type=out_folder, help="folder for results.json and README.md")
    args = parser.parse_args(argv)
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        parser.error("needs onnxruntime-genai: pip install onnxruntime-genai")

    def progress(line):
        print(line, file=sys.stderr, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            rows += measure(name, PEER_MODELS[name], folder, args.new_tokens, args.repeats, args.rows, progress)
    header = (f"Command: `{recorded_command('kvcache_op.benchmarks.serving.peers', argv)}` — {cpu_device()}, "
              f"onnxruntime {ort_version()}; fp32 Llamas with random weights (`tiny_checkpoint`), greedy, "
              f"{args.new_tokens} new tokens per request, medians of {args.repeats}; tokens/s = generated tokens / "
              f"wall time including prefill, each system warmed by an untimed {WARM_UP_TOKENS}-token generation first; "
              f"every system uses the machine's default threads")
    publish(args.out, "kvcache-op beside ONNX Runtime GenAI and transformers", {"header": header, "rows": rows},
            table({"header": header, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
