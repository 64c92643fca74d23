"""Writes the CUDA benchmark's rows as results.json, results.md (device, command, definitions, table) and,
with matplotlib, chart.png (each case's bandwidth as a fraction of a plain copy's)."""

import json
import pathlib

DEFINITIONS = """\
- **Bytes moved** (keys and values, num_repeat 1; as the CPU tool counts them): store = 2 x seqstarts[B] x
  (H*Dh x sizeof(T1) read + H*Dh x sizeof(cache) written [+ H*Dh/8 x sizeof(scale) written, quant 8]);
  gather = 2 x kvstarts[B] x (H*Dh x sizeof(cache) [+ H*Dh/8 x sizeof(scale), quant 8] read + H*Dh x
  sizeof(T1) written). Index inputs are not counted. GB/s = bytes moved / time / 1e9.
- **op**: the CUDA kernels through the C entry point, on torch device memory, one stream. **copy**:
  device-to-device `copy_` of bytes moved / 2 bytes (it reads and writes each byte: the op's traffic).
  **torch**: the op as vectorized torch (`index_copy_` into the cache slots, `index_select` of the gathered
  slots; quant 8 adds per-group absmax quantization before the store and dequantization after the gather);
  its slot vectors are on the device before timing.
- **Times**: CUDA events around each call (the op's index upload included), after warm-up, median of the
  repeats, all on one stream, enqueued while the GPU is held busy (so, unless a call waits for the stream,
  no host gap is timed); the copy is measured before and after the op and the faster one kept.
- **host ms**: wall-clock time of the `run_key_value_cache` Python call returning (binding, validation, index
  snapshot, index upload enqueue, launches; no wait for the kernels), each call on an idle stream, median.
  **queued ms**: the same with calls issued back to back, unwaited (a call that must wait for earlier work
  on the stream shows it here).
- **op / copy** = copy time / op time (1.0: the op moves its bytes as fast as a copy); **torch / copy** the
  same for the torch baseline; **vs torch** = torch time / op time (above 1: the op is faster).
"""


def case_name(r: dict) -> str:
    size = f"seqlen={r['seqlen']}" if r["shape"] == "prefill" else f"kvlen={r['kvlen']}"
    return (f"{r['shape']} B={r['B']} {size} H={r['H']} Dh={r['Dh']} {r['dtype']} q{r['quant_bit']} "
            f"layout {r['layout']} page {r['page_size']}")


def markdown(rows, command: str, device: str, torch_version: str) -> str:
    """results.md: what ran where, the definitions, one table row per case."""
    lines = [f"# KeyValueCache CUDA benchmark ({device})", "", f"Device: {device}, torch {torch_version}", "",
             f"Command: `{command}`", "", DEFINITIONS,
             "| case | MB moved | op ms | host ms | queued ms | op GB/s | copy GB/s | torch GB/s | op / copy "
             "| torch / copy | vs torch |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {case_name(r)} | {r['bytes_moved'] / 1e6:.1f} | {r['op_ms']:.3f} | {r['host_ms']:.3f} | "
                     f"{r['host_queued_ms']:.3f} | {r['op_GBps']:.1f} | {r['copy_GBps']:.1f} | "
                     f"{r['torch_GBps']:.1f} | {r['vs_copy']:.2f}x | {r['torch_vs_copy']:.2f}x | "
                     f"{r['vs_torch']:.2f}x |")
    return "\n".join(lines) + "\n"


def write_results(rows, out: pathlib.Path, command: str, device: str, torch_version: str) -> None:
    """Writes results.json, results.md and, when matplotlib is installed, chart.png into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": command, "device": device,
                                                  "torch": torch_version, "definitions": DEFINITIONS,
                                                  "rows": rows}, indent=1))
    (out / "results.md").write_text(markdown(rows, command, device, torch_version))
    from ..chart import paired_bar_chart

    short = {"float16": "fp16", "bfloat16": "bf16"}
    labels = [f"{r['shape']} {short.get(r['dtype'], r['dtype'])}\nq{r['quant_bit']} L{r['layout']} p{r['page_size']}"
              for r in rows]
    paired_bar_chart(out / "chart.png", labels, ("KeyValueCache op (CUDA kernels)", [r["vs_copy"] for r in rows]),
                     ("vectorized torch", [r["torch_vs_copy"] for r in rows]),
                     "bandwidth / copy bandwidth (same bytes)", f"KeyValueCache vs a device copy — {device}",
                     reference_line=1.0)
