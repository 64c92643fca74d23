"""Seeded multi-step serving scenarios: requests join, prefill in chunks, decode, fork prefixes, leave.

``steps(seed, ...)`` yields the op's inputs for every step of one paged cache; the caller runs each
backend on its own copy of the cache and compares step by step.
"""

import numpy as np

from kvcache_op.reference import cache_shape
from kvcache_op.reference.dtypes import BFLOAT16, CACHE_TYPE_FOR_QUANT_BIT

T1 = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16, "float32": np.dtype(np.float32)}


def initial_cache(quant_bit, t1, layout, pages, page_size, heads, head_dim, quant_group, num_layer=1):
    dtype = CACHE_TYPE_FOR_QUANT_BIT[quant_bit] or T1[t1]
    cache = np.zeros(cache_shape(layout, num_layer, pages * page_size, heads, head_dim), dtype)
    scale = None
    if quant_bit:
        scale = np.zeros(cache_shape(layout, num_layer, pages * page_size, heads, head_dim // quant_group), np.float32)
    return cache, scale


def steps(seed, n_steps=30, page_size=4, pages=64, max_pages=16, heads=2, head_dim=8, t1="float16"):
    """Yields dicts of the op's index inputs and current key/value (no cache) for each step."""
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(pages))
    live = {}
    next_id = 0
    for _ in range(n_steps):
        # arrivals: fresh prompts, or forks that share the full pages of a live request's prefix
        if len(live) < 6 and rng.random() < 0.6:
            prompt = int(rng.integers(1, 14))
            new = {"pos": 0, "prompt": prompt, "todo": prompt + int(rng.integers(1, 8)), "pages": []}
            donors = [r for r in live.values() if r["pos"] >= 2 * page_size]
            if donors and rng.random() < 0.5:
                donor = donors[int(rng.integers(len(donors)))]
                shared = min(donor["pos"] // page_size, 2)
                new["pages"] = list(donor["pages"][:shared])  # read-only: both write beyond them
                new["pos"] = shared * page_size
                new["prompt"] = max(new["prompt"], new["pos"] + 1)
                new["todo"] = new["prompt"] - new["pos"] + int(rng.integers(1, 6))
            live[next_id] = new
            next_id += 1
        batch = list(live)
        rng.shuffle(batch)
        rows, seqstarts, kvstarts, start_pos, tables = 0, [0], [0], [], []
        for rid in batch:
            s = live[rid]
            n = int(rng.integers(1, 5)) if s["pos"] < s["prompt"] else 1
            n = min(n, s["todo"])
            while len(s["pages"]) * page_size < s["pos"] + n:
                s["pages"].append(int(free.pop()))
            rows += n
            seqstarts.append(seqstarts[-1] + n)
            kvstarts.append(kvstarts[-1] + s["pos"] + n)
            start_pos.append(s["pos"])
            tables.append([p * page_size for p in s["pages"]] + [-1] * (max_pages - len(s["pages"])))
            s["pos"] += n
            s["todo"] -= n
        yield {
            "current_key": (rng.standard_normal((rows, heads, head_dim)) * 2).astype(T1[t1]),
            "current_value": (rng.standard_normal((rows, heads, head_dim)) * 2).astype(T1[t1]),
            "seqstarts": np.array(seqstarts, np.int64),
            "kvstarts": np.array(kvstarts, np.int64),
            "cachestarts": np.array(tables, np.int64).reshape(len(batch), max_pages),
            "start_pos": np.array(start_pos, np.int64),
            "max_seqlen": np.array(max(np.diff(seqstarts), default=0), np.int64),
            "max_kvlen": np.array(max(np.diff(kvstarts), default=0), np.int64),
        }
        for rid in [r for r in batch if live[r]["todo"] == 0]:
            del live[rid]  # pages of finished requests are not reused here: forks may still read them
