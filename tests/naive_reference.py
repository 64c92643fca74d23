"""A deliberately naive, per-token, per-element transliteration of spec/KeyValueCache.md.

It shares no code with kvcache_op.reference: flat indices come from the layout formulas of the spec,
arithmetic is done one float32 scalar at a time. Only valid inputs are given to it.
"""

import numpy as np

QMAX = {8: 127, 4: 7}


def flat_index(layout, L, max_t, H, D, l, kv, h, slot, d):
    """Flat element index of (layer l, kv, head h, slot, d) in a C-contiguous tensor of ``layout``."""
    if layout == 0:
        return (((slot * L + l) * 2 + kv) * H + h) * D + d
    if layout == 1:
        return (((l * max_t + slot) * 2 + kv) * H + h) * D + d
    if layout == 2:
        return (((l * 2 + kv) * max_t + slot) * H + h) * D + d
    return (((l * 2 + kv) * H + h) * max_t + slot) * D + d


def naive_key_value_cache(ck, cv, seqstarts, kvstarts, cachestarts, start_pos, cache, scale, *, num_layer=1,
                          layer_idx=0, quant_bit=0, quant_group=8, num_repeat=1, cache_mode=0, cache_layout=0,
                          page_size=128):
    """Returns (key, value, cache_after, scale_after); the inputs are not modified."""
    cache = cache.copy()
    scale = None if scale is None else scale.copy()
    flat_cache = cache.reshape(-1)
    flat_scale = None if scale is None else scale.reshape(-1)
    L, H, D = num_layer, ck.shape[1], ck.shape[2]
    max_t = cache.shape[cache_layout]  # in layout k, MaxT is axis k
    G = D // quant_group
    B = len(seqstarts) - 1

    def slot(b, p):
        if cache_mode == 0:
            return int(cachestarts[b]) + p
        return int(cachestarts[b][p // page_size]) + p % page_size

    for b in range(B):
        for i in range(int(seqstarts[b + 1] - seqstarts[b])):
            row = int(seqstarts[b]) + i
            s = slot(b, int(start_pos[b]) + i)
            for kv, src in ((0, ck), (1, cv)):
                for h in range(H):
                    if not quant_bit:
                        for d in range(D):
                            flat_cache[flat_index(cache_layout, L, max_t, H, D, layer_idx, kv, h, s, d)] = src[row, h, d]
                        continue
                    for g in range(G):
                        elems = [np.float32(src[row, h, g * quant_group + e]) for e in range(quant_group)]
                        amax = np.float32(0)
                        for e in elems:
                            amax = max(amax, np.float32(abs(e)))
                        sc = max(np.float32(amax / np.float32(QMAX[quant_bit])), np.float32(1e-5))
                        sc = scale.dtype.type(sc)
                        flat_scale[flat_index(cache_layout, L, max_t, H, G, layer_idx, kv, h, s, g)] = sc
                        for e, x in enumerate(elems):
                            code = np.rint(np.float32(x / np.float32(sc)))
                            code = min(max(code, -QMAX[quant_bit]), QMAX[quant_bit])
                            idx = flat_index(cache_layout, L, max_t, H, D, layer_idx, kv, h, s, g * quant_group + e)
                            flat_cache[idx] = int(code)
    total = int(kvstarts[-1])
    outs = []
    for kv in (0, 1):
        out = np.zeros((total, H * num_repeat, D), ck.dtype)
        for b in range(B):
            for t in range(int(kvstarts[b + 1] - kvstarts[b])):
                s = slot(b, t)
                for j in range(H * num_repeat):
                    h = j // num_repeat
                    for d in range(D):
                        v = flat_cache[flat_index(cache_layout, L, max_t, H, D, layer_idx, kv, h, s, d)]
                        if quant_bit:
                            g = d // quant_group
                            sc = flat_scale[flat_index(cache_layout, L, max_t, H, G, layer_idx, kv, h, s, g)]
                            v = np.float32(np.float32(int(v)) * np.float32(sc))
                        out[int(kvstarts[b]) + t, j, d] = v
        outs.append(out)
    return outs[0], outs[1], cache, scale
