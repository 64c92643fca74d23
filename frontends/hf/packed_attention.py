"""The model's own attention modules routed to the ops through ``transformers``' attention interface
(``AttentionInterface``, as vLLM's transformers backend does): the model computes its projections, norms, rotary
and everything around attention itself; only the attention of the packed step (one row of every sequence's new
tokens) runs here, through MultiHeadCacheAttention (or KeyValueCache then MultiHeadAttention) on the paged cache.

The step's index tensors reach the attention function through :func:`stepping` (a context set around the model's
forward), not through the model's keyword arguments, which some families do not pass down to attention. Masks are
not built: the ops apply causality, windows and the step's layout themselves."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import weakref

from .. import torch as kt

ATTENTION = "kvcache_op_packed"  # the attention implementation's registered name
_STEP = contextvars.ContextVar("kvcache_op_packed_step", default=None)
_LOCKS = {}  # id of a model's config -> (a weak reference to it, the lock its switched settings are held under)
_LOCKS_LOCK = threading.RLock()  # re-entrant: a collection inside it may run a config's callback, which takes it


def model_lock(model) -> threading.RLock:
    """The lock that serializes what switches settings of ``model`` for a block and switches them back (its attention
    and experts implementations while :func:`stepping`, its dtypes while probed widened): those settings are the
    shared model's, so two such blocks overlapping in two threads would restore each other's and run layers of one
    under the other's settings. Keyed by the model's config, which a wrapper (``torch.compile``'s) and its model
    share. Re-entrant: a probe steps inside its widening."""
    key = getattr(model, "config", model)  # configs compare by value and have no hash: kept by identity
    with _LOCKS_LOCK:
        entry = _LOCKS.get(id(key))
        if entry is None or entry[0]() is not key:
            entry = _LOCKS[id(key)] = (weakref.ref(key, _forget(id(key))), threading.RLock())
        return entry[1]


def _forget(key_id: int):
    """The callback that drops a collected config's lock (its id may be reused by another object)."""
    def forget(ref):
        with _LOCKS_LOCK:
            if _LOCKS.get(key_id, (None,))[0] is ref:
                del _LOCKS[key_id]
    return forget


class Unexpressible(ValueError):
    """What the packed attention found in a layer that the cache cannot hold (raised through the model's forward)."""


@dataclasses.dataclass
class PackedStep:
    """One step's inputs for every layer's attention, and what the layers showed of themselves (``seen``:
    layer_idx -> the settings its attention was called with)."""

    inputs: dict  # seqstarts, kvstarts, cachestarts, start_pos, decoding_batches, max_seqlen, max_kvlen, cache, scale
    cache: object  # CacheSettings
    sizes: object  # the decoder's DecoderSizes (attributes as ints, whatever a tracer makes of tensor shapes)
    probe: bool = False  # shapes and settings only: attention returns zeros, nothing is stored
    seen: dict = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def stepping(model, step: PackedStep):
    """Runs the block with every attention of ``model`` routed to the ops for ``step`` (its config's attention
    implementation switched, and switched back after; the experts of mixture-of-experts blocks computed by
    transformers' export-friendly ``batched_mm`` implementation). Blocks on one model run one at a time, whatever
    the threads (:func:`model_lock`); a plain forward of the model in another thread meanwhile is not supported."""
    register()
    with model_lock(model):
        configs = list(_configs(model.config))
        saved = [c._attn_implementation for c in configs]
        experts = model.get_experts_implementation() if _has_experts(model) else None
        token = _STEP.set(step)
        try:
            for config in configs:
                config._attn_implementation = ATTENTION
            if experts is not None:
                model.set_experts_implementation("batched_mm")
            yield step
        finally:
            _STEP.reset(token)
            for config, name in zip(configs, saved):
                config._attn_implementation = name
            if experts is not None:
                model.set_experts_implementation(experts)


def _configs(config):
    """A config and its sub-configs (a multimodal model's text config)."""
    yield config
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None:
            yield sub


def _has_experts(model) -> bool:
    if not callable(getattr(model, "get_experts_implementation", None)):
        return False
    try:
        return bool(model.get_experts_implementation())
    except (AttributeError, ValueError):
        return False


#: Keywords a layer may pass to the attention interface that change what it computes in ways the ops do not express,
#: with what they are (refused by name, where the routing check would only see logits differ).
UNEXPRESSIBLE_KEYWORDS = {"s_aux": "attention sinks", "sinks": "attention sinks", "position_bias": "a position bias"}


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     softcap=None, **kwargs):
    """The attention interface's function: ``query`` ``[1, H, T, Dh]``, ``key``/``value`` ``[1, Hkv, T, Dh]`` of the
    packed step (batch 1: all sequences' tokens in one row) -> ``([1, T, H, Dh], None)``. Stores the step's keys
    and values in layer ``module.layer_idx`` of the cache and attends each sequence to its own past."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError("the packed attention runs only inside kvcache_op.hf's export (no step is set)")
    heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[-1]
    layer = getattr(module, "layer_idx", None)
    passed = [name for name in UNEXPRESSIBLE_KEYWORDS if kwargs.get(name) is not None]
    if passed:
        what = ", ".join(f"{UNEXPRESSIBLE_KEYWORDS[name]} ({name})" for name in passed)
        raise Unexpressible(f"layer {layer} ({type(module).__name__}) passes {what} to its attention, which the ops "
                            f"do not express")
    if layer in step.seen:  # e.g. differential attention: two attentions whose values would share one cache layer
        raise Unexpressible(f"layer {layer} ({type(module).__name__}) calls attention more than once in a forward: "
                            f"the cache holds one key and one value per layer and position")
    step.seen[layer] = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, value_dim=value.shape[-1],
                            batch=query.shape[0], sliding_window=int(sliding_window or 0),
                            softcap=float(softcap or 0.0), scaling=float(scaling) if scaling is not None else None,
                            module=type(module).__name__)
    if step.probe:
        step.seen[layer]["key"] = key.detach().clone()
        return query.new_zeros(query.shape[0], query.shape[2], heads, value.shape[-1]), None
    c, s, sizes = step.cache, step.inputs, step.sizes
    # [1, heads, T, Dh] -> [T, heads, Dh]: the transpose undoes the model's own, so the exported graph drops both.
    q, k, v = (t.transpose(1, 2)[0].contiguous().to(c.dtype) for t in (query, key, value))
    cache_attributes = dict(num_layer=sizes.num_layers, layer_idx=layer, quant_bit=c.quant_bit,
                            quant_group=c.quant_group, cache_mode=1, cache_layout=c.cache_layout,
                            page_size=c.page_size)
    attention_attributes = dict(num_heads=sizes.num_heads, head_dim=sizes.head_dim, num_kv_heads=sizes.num_kv_heads,
                                sliding_window=int(sliding_window or 0), softmax_scale=float(scaling),
                                softcap=float(softcap or 0.0))
    index = (s["seqstarts"], s["kvstarts"], s["cachestarts"], s["start_pos"])
    if c.fused_attention:
        attended = kt.multi_head_cache_attention(
            q, k, v, *index, s["decoding_batches"], s["max_seqlen"], s["max_kvlen"], s["cache"], s.get("scale"),
            **cache_attributes, **attention_attributes)
    else:
        all_keys, all_values = kt.key_value_cache(k, v, *index, s["max_seqlen"], s["max_kvlen"], s["cache"],
                                                  s.get("scale"), **cache_attributes)
        attended = kt.multi_head_attention(q, all_keys, all_values, s["seqstarts"], s["kvstarts"],
                                           s["decoding_batches"], s["max_seqlen"], s["max_kvlen"],
                                           **attention_attributes)
    return attended.to(query.dtype)[None], None


def _no_mask(*args, **kwargs):
    """The mask builder for this implementation: none (the ops mask by the step's layout)."""
    return None


_registered = False


def register() -> None:
    """Registers the attention function and its (absent) mask with ``transformers`` once."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)
    _registered = True


__all__ = ["ATTENTION", "PackedStep", "Unexpressible", "packed_attention", "register", "stepping"]
