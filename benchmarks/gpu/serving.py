"""End to end on a GPU: an exported decoder served by the engine on ONNX Runtime's CUDA EP against transformers'
own batched ``generate`` on the same GPU, the same weights and prompts, greedy, tokens compared, medians of repeats,
side by side in one run.

    python -m kvcache_op.benchmarks.gpu.serving --out DIR                 # 1024-wide 8-layer Llama, 64 x 1,000
    python -m kvcache_op.benchmarks.gpu.serving --dtype float16 --out DIR # the same in float16
    python -m kvcache_op.benchmarks.gpu.serving --device cpu --quick      # a smoke run on the CPU EP

The model is a float32 (``--dtype float16``: float16) Llama with random weights (``kvcache_op.hf.tiny_checkpoint``, the serving peers' 1024x8
sizes), exported by ``kvcache_op.hf.export_model`` (fused MultiHeadCacheAttention). Requests: ``--requests``
prompts of ``--prompt-tokens`` random tokens each, ``--new-tokens`` tokens generated for each (end-of-sequence
ignored by the engine, banned by ``min_new_tokens`` in transformers). tokens/s = generated tokens / wall time,
prefill included. The engine runs at each ``--max-batch-tokens`` budget (default: its own default on the device, and
on the GPU 256, the CPU's, beside it), side by side, with where its time went (steps; the graph's runs, device time
included; the host's work between them). The target: 2x transformers on the GPU. Needs the ``hf`` extra; on the GPU,
onnxruntime-gpu, torch with CUDA and a CUDA build of the library.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

from ...arguments import OneLineParser, at_least, out_folder
from ...serving.engine import DEFAULT_BATCH_TOKENS, default_batch_tokens
from ..environment import recorded_command
from ..serving.peers import PEER_MODELS, agreement, run_kvcache_op, run_transformers
from ..serving.report import pages_for, publish
from ..timing import ort_version
from .bench import missing_requirements

QUICK_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512)
TARGET = 2.0


def missing(device: str) -> list:
    """What this machine lacks for ``device``, one phrase each (empty: nothing)."""
    import onnxruntime as ort

    out = []
    try:
        import transformers  # noqa: F401
    except ImportError:
        out.append("transformers is not installed (the 'hf' extra)")
    if device == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            out.append(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (install onnxruntime-gpu)")
        out += missing_requirements()  # the library's CUDA kernels, torch with a GPU
    return out


def measure(args, folder: str, progress) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from ...hf import export_model, tiny_checkpoint

    sizes = QUICK_MODEL if args.quick else PEER_MODELS["1024x8"]
    checkpoint = os.path.join(folder, "model")
    model, tokenizer = tiny_checkpoint(checkpoint, vocab_size=args.vocab, **sizes)
    dtype = getattr(torch, args.dtype)
    progress(f"exporting ({args.dtype}) ...")
    # Both sides load the checkpoint the same way: model.to(float16) would round the rotary frequencies too (a
    # float buffer), which transformers' float16 loading keeps in float32, and the two would part at long positions.
    exported = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
    path = export_model(exported, os.path.join(folder, "model.onnx"))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval().to(args.device)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, model.config.vocab_size, args.prompt_tokens).tolist() for _ in range(args.requests)]
    budgets = budgets_of(args)
    times = {"transformers": [], **{b: [] for b in budgets}}
    spent = {b: [] for b in budgets}
    tokens = {}
    providers = ["CUDAExecutionProvider"] if args.device == "cuda" else ["CPUExecutionProvider"]
    pages = args.requests * pages_for(args.prompt_tokens + args.new_tokens) + 16
    for repeat in range(args.repeats):
        progress(f"repeat {repeat + 1}/{args.repeats}")
        for budget in budgets:
            tokens[budget], t, where = run_kvcache_op(path, prompts, args.new_tokens, pages, providers, budget)
            times[budget].append(t)
            spent[budget].append(where)
        tokens["transformers"], t = run_transformers(reference, prompts, args.new_tokens)
        times["transformers"].append(t)
    generated = args.requests * args.new_tokens
    speed = {k: generated / float(np.median(v)) for k, v in times.items()}
    eos = {model.config.eos_token_id}
    headline = budgets[0]
    result = {"model": sizes, "vocab_size": model.config.vocab_size, "dtype": args.dtype, "requests": args.requests,
              "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "max_batch_tokens": spent[headline][0]["max_batch_tokens"],
              "tokens_per_s": {"kvcache-op": speed[headline], "transformers": speed["transformers"]},
              "vs_transformers": speed[headline] / speed["transformers"], "target": TARGET,
              "agreement": agreement(tokens[headline], tokens["transformers"], eos),
              "budgets": [{"max_batch_tokens": spent[b][0]["max_batch_tokens"], "tokens_per_s": speed[b],
                           "vs_transformers": speed[b] / speed["transformers"],
                           **{k: float(np.median([w[k] for w in spent[b]])) for k in ("steps", "ort_run_s", "host_s")},
                           "agreement": agreement(tokens[b], tokens["transformers"], eos)} for b in budgets]}
    if args.dtype != "float32":
        # What agreement to expect: transformers' own tokens in this dtype against its float32 ones (a random-weight
        # model has many near-ties, and after the first difference two runs continue differently).
        progress("transformers in float32, for the baseline agreement ...")
        wide = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval().to(args.device)
        result["baseline_agreement"] = agreement(tokens["transformers"], run_transformers(wide, prompts,
                                                                                          args.new_tokens)[0], eos)
    return result


def budgets_of(args) -> list:
    """The engine's token budgets to run, the headline first: ``--max-batch-tokens`` as given, else the engine's
    default (None; on a GPU, the CPU's 256 beside it)."""
    if args.max_batch_tokens:
        return list(dict.fromkeys(args.max_batch_tokens))
    return [None] if default_batch_tokens(args.device) == DEFAULT_BATCH_TOKENS else [None, DEFAULT_BATCH_TOKENS]


def table(result: dict) -> str:
    s = result["tokens_per_s"]
    verdict = "met" if result["vs_transformers"] >= TARGET else "missed"
    baseline = ([] if "baseline_agreement" not in result else
                ["", f"Baseline: transformers' own {result['dtype']} tokens agree with its float32 tokens at "
                     f"{result['baseline_agreement']:.1%} of positions (near-ties of random weights)."])
    return "\n".join([
        result["header"], "",
        "| requests x prompt + new | kvcache-op tok/s | transformers tok/s | vs transformers | same tokens |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| {result['requests']} x {result['prompt_tokens']} + {result['new_tokens']} | {s['kvcache-op']:.0f} | "
        f"{s['transformers']:.0f} | {result['vs_transformers']:.2f}x ({verdict} >= {TARGET}x) | "
        f"{result['agreement']:.1%} |"] + baseline + [
        "", "The engine at each token budget (max_batch_tokens; medians; the graph's runs include device time, as each "
            "run ends with its tokens or logits on the host):", "",
        "| max_batch_tokens | tok/s | vs transformers | steps | in the graph's runs s | host s | same tokens |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"] + [
        f"| {b['max_batch_tokens']} | {b['tokens_per_s']:.0f} | {b['vs_transformers']:.2f}x | {b['steps']:.0f} | "
        f"{b['ort_run_s']:.3f} | {b['host_s']:.3f} | {b['agreement']:.1%} |" for b in result["budgets"]]) + "\n"


def main(argv=None) -> int:
    """0 after the run; 2 (one line) where the machine lacks what the device needs."""
    parser = OneLineParser(prog="python -m kvcache_op.benchmarks.gpu.serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--requests", type=at_least(1), default=64)
    parser.add_argument("--prompt-tokens", type=at_least(1), default=1000)
    parser.add_argument("--new-tokens", type=at_least(1), default=32)
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                        help="the model's weights and cache (float16: the tensor-core attention kernel)")
    parser.add_argument("--max-batch-tokens", type=at_least(1), nargs="+",
                        help="the engine's token budgets per step, run side by side, the first in the headline "
                             "(default: the engine's own, on the GPU with "
                             f"{DEFAULT_BATCH_TOKENS} beside it)")
    parser.add_argument("--vocab", type=at_least(360), default=None,
                        help="the model's vocabulary (default: its tokenizer's, 360; e.g. 32000 for Llama 2's width: "
                             "the logits' matrix product and what leaves the device grow with it)")
    parser.add_argument("--quick", action="store_true", help="a 64-wide 2-layer model: checks the tool runs")
    parser.add_argument("--out", type=out_folder, help="folder for results.json and README.md")
    args = parser.parse_args(argv)
    lacking = missing(args.device)
    if lacking:
        print("GPU serving benchmark: cannot run: " + "; ".join(lacking), file=sys.stderr)
        return 2

    def progress(line):
        print(line, file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as folder:
        result = measure(args, folder, progress)
    device = "cpu"
    if args.device == "cuda":
        import torch

        device = torch.cuda.get_device_name()
    result["header"] = (f"Command: `{recorded_command('kvcache_op.benchmarks.gpu.serving', argv)}` — {device}, "
                        f"onnxruntime {ort_version()}; {args.dtype} Llama {result['model']['hidden_size']}x"
                        f"{result['model']['num_hidden_layers']}, vocabulary {result['vocab_size']}, with random "
                        f"weights, greedy, medians of "
                        f"{args.repeats}; "
                        f"same tokens = positions where both chose the same token, to the first end-of-sequence")
    publish(args.out, "The engine on the CUDA EP beside transformers on the same GPU", result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
