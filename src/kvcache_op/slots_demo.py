"""``kvcache-op slots-demo``: a scripted dynamic-batching run through a paged KV cache, slot by slot.

Requests arrive, are prefilled (in chunks), decode, and finish, in one batch per step. Every key
element is ``1000 * request + position`` so the printout shows exactly which token each gathered row
came from; every step checks that each sequence got back exactly its own history.
"""

import numpy as np

from .reference import cache_shape

PAGE_SIZE, HEADS, HEAD_DIM, PAGES, MAX_PAGES = 4, 2, 8, 24, 8
# (request id, arrival step, prompt length, tokens to generate)
SCRIPT = [(1, 0, 6, 4), (2, 1, 9, 3), (3, 2, 3, 5), (4, 4, 5, 2)]
CHUNK = 4  # chunked prefill: at most this many prompt tokens per request per step


def _runner(backend: str):
    """Returns (name, run(model, inputs) -> (key, value)) for the chosen backend."""
    from .validation.adapters import run_ort, run_reference

    if backend == "reference":
        return "onnx ReferenceEvaluator (numpy reference)", run_reference
    from .ort_ops import library_available

    if library_available():
        return "ONNX Runtime CPU EP + kvcache-op custom-op library", run_ort
    if backend == "ort":
        raise ValueError("--backend ort: the custom-op library is not built in this install; reinstall with "
                         "'pip install .', or pass --backend reference")
    return "onnx ReferenceEvaluator (the ONNX Runtime library is not built in this install)", run_reference


def _token(request: int, position: int) -> np.ndarray:
    return np.full((HEADS, HEAD_DIM), 1000 * request + position, np.float32)


def run_slots_demo(backend: str = "auto", steps: int = 8) -> int:
    """Runs the scripted scenario for ``steps`` steps; returns 0 iff every gathered row is right."""
    from . import spec

    name, run = _runner(backend)
    print(f"backend: {name}")
    print(f"paged cache: {PAGES} pages x {PAGE_SIZE} slots, H={HEADS}, Dh={HEAD_DIM}, float32, layout 0")
    cache = np.zeros(cache_shape(0, 1, PAGES * PAGE_SIZE, HEADS, HEAD_DIM), np.float32)
    free = list(range(PAGES - 1, -1, -1))
    live = {}  # request -> {"pos", "prompt", "todo", "pages"}
    model = None
    failures = 0
    for step in range(steps):
        for rid, arrival, prompt, gen in SCRIPT:
            if arrival == step:
                live[rid] = {"pos": 0, "prompt": prompt, "todo": prompt + gen, "pages": []}
        batch = [rid for rid in sorted(live) if live[rid]["todo"] > 0]
        rows, seqstarts, kvstarts, start_pos, tables, plan = [], [0], [0], [], [], []
        for rid in batch:
            s = live[rid]
            n = min(CHUNK, s["prompt"] - s["pos"]) if s["pos"] < s["prompt"] else 1
            while len(s["pages"]) * PAGE_SIZE < s["pos"] + n:
                s["pages"].append(free.pop())
            rows += [_token(rid, s["pos"] + i) for i in range(n)]
            seqstarts.append(seqstarts[-1] + n)
            kvstarts.append(kvstarts[-1] + s["pos"] + n)
            start_pos.append(s["pos"])
            tables.append(s["pages"] + [-1] * (MAX_PAGES - len(s["pages"])))
            plan.append((rid, s["pos"], n))
        current = np.stack(rows) if rows else np.zeros((0, HEADS, HEAD_DIM), np.float32)
        inputs = {
            "current_key": current, "current_value": -current,
            "seqstarts": np.array(seqstarts, np.int64), "kvstarts": np.array(kvstarts, np.int64),
            "cachestarts": np.array(tables, np.int64).reshape(len(batch), MAX_PAGES) * PAGE_SIZE,
            "start_pos": np.array(start_pos, np.int64),
            "max_seqlen": np.array(max(np.diff(seqstarts), default=0), np.int64),
            "max_kvlen": np.array(max(np.diff(kvstarts), default=0), np.int64),
            "cache": cache,
        }
        if model is None:
            model = spec.make_model(inputs, cache_mode=1, page_size=PAGE_SIZE)
        key, value = run(model, inputs)
        print(f"\nstep {step}: batch of {len(batch)} sequence(s), {current.shape[0]} new token(s), "
              f"{key.shape[0]} gathered")
        for b, (rid, pos, n) in enumerate(plan):
            s = live[rid]
            kind = "prefill" if pos < s["prompt"] else "decode "
            got = key[kvstarts[b]:kvstarts[b + 1], 0, 0].astype(int).tolist()
            want = [1000 * rid + p for p in range(pos + n)]
            ok = got == want and np.array_equal(value[kvstarts[b]:kvstarts[b + 1]], -key[kvstarts[b]:kvstarts[b + 1]])
            failures += not ok
            slots = [s["pages"][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(pos, pos + n)]
            print(f"  req {rid} {kind} stored positions {pos}..{pos + n - 1} -> slots {slots}; pages {s['pages']}")
            shown = got if len(got) <= 8 else got[:3] + ["..."] + got[-3:]
            print(f"        gathered {len(got)} keys {shown}  {'ok' if ok else 'MISMATCH'}")
            s["pos"] += n
            s["todo"] -= n
            if s["todo"] == 0:
                free.extend(reversed(s["pages"]))
                print(f"        req {rid} finished; pages {s['pages']} returned to the free list")
                del live[rid]
    print(f"\n{'all gathered keys and values were right' if not failures else f'{failures} MISMATCH(ES)'}")
    return 1 if failures else 0
