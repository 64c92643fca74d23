"""How the error of repeated shift-RoPE-K grows on a quantized cache, next to discard-and-re-evaluate.

Keys ``RoPE(k, p)`` are stored (int8, int4 with float32 scales; float16 for reference), then shifted
``n`` times by ``-delta`` positions with KeyCacheRotaryShift; re-evaluation instead stores
``RoPE(k, p - n * delta)`` directly. Error: RMS of (dequantized cache - exact float64 RoPE) over RMS of the
exact keys.

    python -m kvcache_op.benchmarks.shift_error.measure --out benchmarks/shift_error
"""

import argparse
import json
import sys

import numpy as np

from ...arguments import OneLineParser, at_least, out_folder
from ..environment import recorded_command


def _rope64(raw, positions, theta=10000.0):
    d = raw.shape[-1]
    z = raw[..., : d // 2] + 1j * raw[..., d // 2:]
    z = z * np.exp(1j * positions[:, None, None] * theta ** (-2.0 * np.arange(d // 2) / d))
    return np.concatenate([z.real, z.imag], axis=-1)


def _store(cache_kind, keys):
    """A layout-0 single-layer cache holding ``keys[N, H, Dh]`` in slots 0..N-1."""
    from ...reference import cache_shape, quantize
    from ...reference.dtypes import CACHE_TYPE_FOR_QUANT_BIT

    n, heads, dh = keys.shape
    if cache_kind == "float16":
        cache = np.zeros(cache_shape(0, 1, n, heads, dh), np.float16)
        cache[:, 0, 0] = keys.astype(np.float16)
        return cache, None, 0
    bits = 8 if cache_kind == "int8" else 4
    codes, scale = quantize(keys.astype(np.float32), bits, 32, np.float32)
    cache = np.zeros(cache_shape(0, 1, n, heads, dh), CACHE_TYPE_FOR_QUANT_BIT[bits])
    scales = np.zeros(cache_shape(0, 1, n, heads, dh // 32), np.float32)
    cache[:, 0, 0], scales[:, 0, 0] = codes.astype(cache.dtype), scale
    return cache, scales, bits


def _read(cache, scales, bits):
    from ...reference import dequantize

    if not bits:
        return cache[:, 0, 0].astype(np.float64)
    return dequantize(cache[:, 0, 0], scales[:, 0, 0], 32, np.float32).astype(np.float64)


def measure(shift_counts, delta=64, tokens=256, heads=8, head_dim=128, start=8192, seed=0):
    """Rows of {cache, shifts, shift_error, reevaluate_error}."""
    from ...reference import key_cache_rotary_shift, rotary_shift_tables

    rng = np.random.default_rng(seed)
    raw = rng.standard_normal((tokens, heads, head_dim))
    positions = start + np.arange(tokens, dtype=np.float64)
    rows = []
    for kind in ("float16", "int8", "int4"):
        cache, scales, bits = _store(kind, _rope64(raw, positions))
        cos, sin = rotary_shift_tables(np.full(tokens, -delta), head_dim)
        done = 0
        for target in sorted(shift_counts):
            while done < target:
                key_cache_rotary_shift(cache, scales, np.arange(tokens), cos, sin, quant_bit=bits, quant_group=32)
                done += 1
            exact = _rope64(raw, positions - target * delta)
            norm = np.sqrt(np.mean(exact**2))
            shifted = np.sqrt(np.mean((_read(cache, scales, bits) - exact) ** 2)) / norm
            fresh_cache, fresh_scales, _ = _store(kind, exact)
            fresh = np.sqrt(np.mean((_read(fresh_cache, fresh_scales, bits) - exact) ** 2)) / norm
            rows.append({"cache": kind, "shifts": target, "shift_error": shifted, "reevaluate_error": fresh})
    return rows


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shifts", type=at_least(1), nargs="+", default=[1, 2, 5, 10, 20, 50, 100])
    parser.add_argument("--delta", type=at_least(1), default=64, help="positions per shift")
    parser.add_argument("--tokens", type=at_least(1), default=256)
    parser.add_argument("--out", type=out_folder)
    args = parser.parse_args(argv)
    command = recorded_command("kvcache_op.benchmarks.shift_error.measure", argv)
    rows = measure(args.shifts, args.delta, args.tokens)
    lines = [f"# Repeated shift-RoPE-K vs re-evaluation (relative RMS error of the stored keys)", "",
             f"Command: `{command}`", "",
             f"{args.tokens} tokens x 8 heads x Dh 128, each shift moves every key by -{args.delta} positions; "
             "int8/int4 use quant_group 32 and float32 scales.", "",
             "| cache | shifts | shift-RoPE-K error | re-evaluate error | ratio |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['cache']} | {r['shifts']} | {r['shift_error']:.5f} | {r['reevaluate_error']:.5f} | "
                     f"{r['shift_error'] / r['reevaluate_error']:.2f}x |")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text("\n".join(lines) + "\n")
        (args.out / "results.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
