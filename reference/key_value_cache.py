"""The reference implementation: spec/KeyValueCache.md section "Semantics", line for line."""

import numpy as np

from .layout import canonical_view
from .quantize import dequantize, quantize
from .validate import Attributes, KeyValueCacheError, check_writable, effective_scale, validate_call


def key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                    max_kvlen, cache, scale=None, *, num_layer=1, layer_idx=0, quant_bit=0, quant_group=8,
                    num_repeat=1, cache_mode=0, cache_layout=0, page_size=128):
    """Store this step's keys/values into ``cache`` (in place) and gather every sequence's keys/values.

    Shapes: ``current_key``/``current_value`` ``(seqstarts[B], H, Dh)``; ``cache`` and ``scale`` as
    ``cache_layout`` says; returns ``(key, value)`` of shape ``(kvstarts[B], H * num_repeat, Dh)`` and
    dtype of ``current_key``. Every input is validated first: on a :class:`KeyValueCacheError`
    (a ``ValueError``) ``cache`` and ``scale`` are byte-for-byte unchanged.
    """
    attrs = Attributes(num_layer, layer_idx, quant_bit, quant_group, num_repeat, cache_mode, cache_layout,
                       page_size)
    # The call on copies (spec: the reference works on values): a current_value that is a view of rows the stores
    # write must still be what it was when the call began.
    current = (np.array(current_key, copy=True), np.array(current_value, copy=True))
    scale = effective_scale(scale, quant_bit)
    plan = validate_call(*current, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                         cache, scale, attrs)
    check_writable(cache=cache, scale=scale)
    # Canonical (L, 2, H, MaxT, last) views of this layer: [kv][h, slot, :] writes into cache / scale.
    layer_cache = canonical_view(cache, cache_layout)[layer_idx]
    layer_scale = None if scale is None else canonical_view(scale, cache_layout)[layer_idx]
    out_dtype = current[0].dtype
    batch = len(plan.seq_len)
    # The outputs first: an allocation failure must not come after the cache was written.
    heads, head_dim = current[0].shape[1:]
    total = plan.kv_begin[-1] + plan.kv_len[-1] if batch else 0
    shape = (total, heads * num_repeat, head_dim)
    try:
        outputs = [np.empty(shape, dtype=out_dtype) for _ in (0, 1)]
    except MemoryError:  # spec: an output that fits in int64 but cannot be allocated is an error too
        raise KeyValueCacheError(f"outputs key and value of shape {list(shape)} {out_dtype} could not be allocated") \
            from None

    # 1. All stores: cache[slot(b, start_pos[b] + i)] = Q(current[seqstarts[b] + i]).
    for b in range(batch):
        rows = slice(plan.seq_begin[b], plan.seq_begin[b] + plan.seq_len[b])
        for kv in (0, 1):
            x = current[kv][rows].transpose(1, 0, 2)  # (H, seqlen, Dh)
            if quant_bit:
                codes, s = quantize(x, quant_bit, quant_group, layer_scale.dtype)
                layer_cache[kv][:, plan.store_slots[b], :] = codes.astype(cache.dtype)
                layer_scale[kv][:, plan.store_slots[b], :] = s
            else:
                layer_cache[kv][:, plan.store_slots[b], :] = x

    # 2. All loads: out[kvstarts[b] + t, h * num_repeat + r] = DQ(cache[slot(b, t)][h]).
    for kv, out in enumerate(outputs):
        for b in range(batch):
            slots = plan.load_slots[b]
            gathered = layer_cache[kv][:, slots, :]  # (H, kvlen, Dh)
            if quant_bit:
                gathered = dequantize(gathered, layer_scale[kv][:, slots, :], quant_group, out_dtype)
            rows = slice(plan.kv_begin[b], plan.kv_begin[b] + plan.kv_len[b])
            out[rows] = np.repeat(gathered.transpose(1, 0, 2), num_repeat, axis=1)
    return outputs[0], outputs[1]
