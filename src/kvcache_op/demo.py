"""``kvcache-op demo``, the main job: a small decoder served end to end, and every answer checked.

1. builds a ``transformers`` decoder from a config with seeded random weights (no download);
2. exports it with :func:`kvcache_op.hf.export_model` (each layer: one MultiHeadCacheAttention node, which
   stores the step's keys and values and attends over the paged cache in place);
3. serves requests that share system prompts through :class:`kvcache_op.serving.Engine` in ONNX Runtime
   (continuous batching, chunked prefill, prefix caching with eviction under a small page pool);
4. checks every request's tokens against the source model's own greedy ``generate``, one request at a
   time. The exit status is non-zero on any mismatch.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

FAMILIES = ("llama", "mistral", "qwen2")


class Progress:
    """A one-line progress bar on a terminal; plain periodic lines otherwise (logs, CI)."""

    def __init__(self, total: int, label: str, stream=sys.stdout):
        self.total, self.label, self.stream = total, label, stream
        self.done, self.shown, self.started = 0, -1, time.perf_counter()
        self.tty = stream.isatty()

    def advance(self, count: int = 1, note: str = "") -> None:
        self.done += count
        tenth = 10 * self.done // max(self.total, 1)
        if self.tty:
            filled = 30 * self.done // max(self.total, 1)
            self.stream.write(f"\r  {self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {note}")
            self.stream.flush()
        elif tenth != self.shown:
            self.stream.write(f"  {self.label}: {self.done}/{self.total} {note}\n")
        self.shown = tenth

    def close(self) -> float:
        if self.tty:
            self.stream.write("\n")
        return time.perf_counter() - self.started


def _attention_form(graph) -> str:
    """The layers' attention as the exported ``ModelProto`` holds it: the fused node or the split pair."""
    from kvcache_op.spec import DOMAIN

    ops = {n.op_type for n in graph.graph.node if n.domain == DOMAIN}
    return "MultiHeadCacheAttention" if "MultiHeadCacheAttention" in ops else "KeyValueCache -> MultiHeadAttention"


def run_demo(family: str = "llama", requests: int = 32, new_tokens: int = 16, num_pages: int = 24,
             quant_bit: int = 0, page_size: int = 16, providers=None, out_dir=None, seed: int = 0) -> int:
    """Builds, exports, serves and verifies; prints figures; returns 0 iff every request matches the source
    model's own generation (quantized caches are checked against the source model with the same
    quantization applied to its cache, which is what they compute). The exported model is kept in
    ``out_dir``; without one it goes into a temporary folder removed at the end."""
    settings = dict(family=family, requests=requests, new_tokens=new_tokens, num_pages=num_pages,
                    quant_bit=quant_bit, page_size=page_size, providers=providers, seed=seed)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        return _run(out_dir, kept=True, **settings)
    with tempfile.TemporaryDirectory(prefix="kvcache-op-demo-") as folder:
        return _run(folder, kept=False, **settings)


def _run(folder: str, kept: bool, family: str, requests: int, new_tokens: int, num_pages: int, quant_bit: int,
         page_size: int, providers, seed: int) -> int:
    print(f"kvcache-op demo: a {family} decoder exported with the ops and served by ONNX Runtime")
    began = time.perf_counter()
    import onnx

    from kvcache_op.hf import export_model, tiny_model
    from kvcache_op.hf.verify import reference_generate, stored_kv
    from kvcache_op.serving import Engine, ModelInfo
    from kvcache_op.serving.workload import shared_prefix_workload

    model = tiny_model(family, seed=seed)
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    print(f"1. model: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} query / "
          f"{c.num_key_value_heads} key-value heads, vocab {c.vocab_size}, {params / 1e6:.2f} M parameters "
          f"(seeded random weights; sliding window: {getattr(c, 'sliding_window', None) or 'none'})")
    path = os.path.join(folder, f"{family}.onnx")
    t = time.perf_counter()
    export_model(model, path, page_size=page_size, quant_bit=quant_bit)
    graph = onnx.load(path, load_external_data=False)  # read once: its metadata and its attention nodes
    info = ModelInfo.of_model(graph)
    print(f"2. exported to {path}{'' if kept else ' (removed at the end; --out DIR keeps it)'} in "
          f"{time.perf_counter() - t:.1f} s: per layer {_attention_form(graph)} on one shared paged cache "
          f"(page {info.page_size}, quant_bit {info.quant_bit})")

    workload = shared_prefix_workload(requests, c.vocab_size, seed=seed)
    try:
        engine = Engine(path, num_pages=num_pages, providers=providers, max_batch_tokens=128, max_running=16)
    except ValueError as error:  # e.g. --num-pages more than this machine's memory holds: a line, not a traceback
        print(f"kvcache-op demo: error: {error}", file=sys.stderr)
        return 2
    print(f"3. serving {requests} requests ({sum(map(len, workload.prompts))} prompt tokens, 3 shared system "
          f"prompts, 2 arrivals per step) x {new_tokens} new tokens on {', '.join(engine.runner.providers)}, "
          f"{num_pages} pages of {info.page_size} slots")
    bar = Progress(requests * new_tokens, "tokens")
    with engine:
        try:
            tokens = engine.generate(workload.prompts, new_tokens, salts=workload.salts,
                                     arrival_steps=workload.arrival_steps, on_token=lambda i, token: bar.advance())
        except (RuntimeError, ValueError) as error:  # e.g. too few pages for one request: a line, not a traceback
            bar.close()
            print(f"kvcache-op demo: error: {error}", file=sys.stderr)
            return 2
        bar.close()
        m = engine.metrics()
    print(f"   throughput  {m['tokens_per_s']:.0f} generated tokens/s ({m['generated_tokens']} tokens, "
          f"{m['fed_tokens']} fed, {m['steps']} steps, {m['wall_s']:.2f} s)")
    print(f"   prefix hits {m['prefix_hit_rate']:.1%} of prompt tokens looked up ({m['prefix_hit_tokens']} of "
          f"{m['prompt_tokens']}, re-admissions included); evictions {m['evictions']}; preemptions {m['preemptions']}")
    print(f"   memory      cache {m['cache_bytes'] / 2**20:.2f} MiB; peak pages in use {m['peak_pages_in_use']} of "
          f"{m['pages_total']}")
    print(f"   time        ONNX Runtime {m['time_ort_run_s']:.2f} s, scheduling {m['time_scheduling_s']:.2f} s, "
          f"other {m['time_other_s']:.2f} s")

    rounding = stored_kv(info)
    what = "greedy generate" + (" with its cache quantized as the op stores it" if rounding else "")
    print(f"4. verifying every request against transformers' own {what}, one request at a time")
    bar = Progress(requests, "requests")
    mismatches = []
    for i, prompt in enumerate(workload.prompts):
        want = reference_generate(model, prompt, new_tokens, rounding)
        if tokens[i] != want:
            mismatches.append((i, tokens[i], want))
        bar.advance(note=f"{len(mismatches)} mismatch(es)")
    bar.close()
    for i, got, want in mismatches[:5]:
        print(f"   MISMATCH request {i}: served {got}\n                       transformers {want}")
    total = time.perf_counter() - began
    if mismatches:
        print(f"FAILED: {len(mismatches)} of {requests} requests differ from the source model ({total:.1f} s)")
        return 1
    print(f"OK: all {requests} requests match the source model token for token ({total:.1f} s in all)")
    return 0
