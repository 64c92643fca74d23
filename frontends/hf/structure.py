"""What a ``transformers`` causal LM is, read from its structure and from probing its own forward, never from its
family name: the attention heads and windows every layer calls attention with, whether every layer attends through
the attention interface at all, whether its keys rotate as KeyCacheRotaryShift rotates them, and finally whether
its forward with attention routed to the ops gives its own logits. What the packed graph cannot express exactly is
refused with a ``ValueError`` naming the feature: no model exports and serves wrong tokens silently."""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import torch

from ..reference.rotary import rotate
from ..serving.model_info import DecoderSizes
from .cache_settings import CacheSettings
from .packed_attention import PackedStep, Unexpressible, model_lock, stepping

# Rotary types whose inverse frequencies depend on the sequence length at run time: they cannot be one static
# graph, and a cache of keys rotated under one length would be wrong under another.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
_PROBE_TOKEN, _PROBE_POSITION, _PROBE_SHIFT = 3, 5, 7
#: The longest sequence the routing check runs to see a sliding window act (a window it passes to the attention is
#: checked against the model's own forward where window + 2 tokens fit in this; a longer one is trusted as passed).
_WINDOW_CHECK_TOKENS = 512


def text_config(model):
    """The config that describes the decoder (a multimodal config's text config)."""
    config = model.config
    return getattr(config, "text_config", None) or config


def probe(model, input_ids, positions) -> dict:
    """layer_idx -> the settings (and, for this check, the keys) each attention is called with when the model runs
    ``input_ids`` at ``positions`` as one packed row; attention outputs zeros, nothing is stored."""
    step = PackedStep(inputs={}, cache=None, sizes=None, probe=True)
    with torch.no_grad(), stepping(model, step):
        _routed_forward(model, dict(input_ids=torch.tensor([input_ids]), position_ids=torch.tensor([positions]),
                                    use_cache=False, logits_to_keep=1))
    return step.seen


def _routed_forward(model, arguments: dict):
    """The model's forward with attention routed to the ops; a failure there is a ``ValueError`` saying so."""
    try:
        return model(**arguments)
    except Unexpressible:
        raise
    except Exception as error:  # noqa: BLE001 - any failure means the model needs what the route does not give
        raise ValueError(f"the model's forward fails with its attention routed to the ops ({type(error).__name__}: "
                         f"{error}): it needs an attention mask or attention weights the packed graph does not "
                         f"have (ALiBi, a custom mask, ...)") from None


@contextlib.contextmanager
def _widened(model):
    """The model's float16 and bfloat16 parameters and buffers as float32 inside; each back to its own dtype after
    (they widen exactly, so the round trip changes no value; tensors of other dtypes are not touched). Under the
    model's lock (:func:`~.packed_attention.model_lock`): no packed forward of it in another thread sees it widened."""
    with model_lock(model):
        narrow = [t for t in itertools.chain(model.parameters(), model.buffers())
                  if t.dtype in (torch.float16, torch.bfloat16)]
        dtypes = [t.dtype for t in narrow]
        for t in narrow:
            t.data = t.data.float()
        try:
            yield
        finally:
            for t, dtype in zip(narrow, dtypes):
                t.data = t.data.to(dtype)


def check_routing(model, sizes: DecoderSizes, tokens: int = 64) -> float:
    """Runs two sequences through the model's own forward and through its forward with attention routed to the ops
    (a scratch float32 cache), the model in float32 (:func:`decoder_sizes` widens a float16 one around every probe),
    and returns the largest logit difference. The routed forward sees what serving does: a packed step of both
    sequences from position 0 (the first ``4/7`` of a ``tokens``-token prompt and a shorter one), then a packed step
    in which the shorter decodes one token and the first prefills its remaining tokens from where it stopped.
    ``ValueError`` when they differ beyond float32 noise: the model attends in a way the ops do not express (a mask
    with a bias, an attention it changes after the interface, positions it takes from a cache's length rather than
    from ``position_ids``, ...), and exporting it would serve wrong tokens."""
    from .. import torch as kt

    n = min(tokens, sizes.max_positions)
    first, short = (max(1, n * 4 // 7), max(1, min(n // 3, n - 1))) if n > 1 else (1, 1)
    a = torch.arange(n) * 7 % sizes.vocab_size  # the long sequence: prefilled in two chunks
    b = (torch.arange(short + 1) * 5 + 1) % sizes.vocab_size  # the short one: prefilled, then one token decoded
    settings = CacheSettings(page_size=16)
    ps = settings.page_size
    pages_a, pages_b = -(-n // ps), -(-(short + 1) // ps)
    cache, _ = kt.new_cache(num_layer=sizes.num_layers, max_tokens=(pages_a + pages_b) * ps,
                            heads=sizes.num_kv_heads, head_dim=sizes.head_dim, dtype=torch.float32,
                            cache_layout=settings.cache_layout)
    table = {"a": torch.arange(pages_a) * ps, "b": (pages_a + torch.arange(pages_b)) * ps}

    def routed(parts, decoding: int):
        """The routed forward's logits of one packed step: ``parts`` as (sequence, its new tokens, start)."""
        lengths = [len(t) for _, t, _ in parts]
        starts = [start for _, _, start in parts]
        width = max(len(table[name]) for name, _, _ in parts)
        inputs = dict(seqstarts=torch.tensor([0, *itertools.accumulate(lengths)]),
                      kvstarts=torch.tensor([0, *itertools.accumulate(s + q for s, q in zip(starts, lengths))]),
                      cachestarts=torch.stack([torch.nn.functional.pad(table[name], (0, width - len(table[name])))
                                               for name, _, _ in parts]),
                      start_pos=torch.tensor(starts), decoding_batches=torch.tensor(decoding),
                      max_seqlen=torch.tensor(max(lengths)),
                      max_kvlen=torch.tensor(max(s + q for s, q in zip(starts, lengths))), cache=cache, scale=None)
        positions = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, lengths)])
        with stepping(model, PackedStep(inputs=inputs, cache=settings, sizes=sizes)):
            return _routed_forward(model, dict(input_ids=torch.cat([t for _, t, _ in parts])[None],
                                               position_ids=positions[None], use_cache=False)).logits[0].float()

    with torch.no_grad():
        own_a = model(input_ids=a[None], use_cache=False).logits[0].float()
        own_b = model(input_ids=b[None], use_cache=False).logits[0].float()
        step1 = routed([("a", a[:first], 0), ("b", b[:short], 0)], decoding=0)
        step2 = routed([("b", b[short:], short)] + ([("a", a[first:], first)] if first < n else []), decoding=1)
    own = torch.cat([own_a[:first], own_b[:short], own_b[short:], own_a[first:]])
    gap = float((own - torch.cat([step1, step2])).abs().max())
    if not gap <= 1e-3 * max(1.0, float(own.abs().max())):
        raise ValueError(f"the model's forward with attention routed to the ops differs from its own by {gap:.3g} "
                         f"in the logits of a packed prefill of {first} and {short} tokens followed by a step "
                         f"continuing both (a decode and {n - first} more prompt tokens): it attends in a way the ops "
                         f"do not express (a biased or custom mask, attention changed after the interface, positions "
                         f"not taken from position_ids, ...)")
    return gap


def _refuse_unexpressible(model, config) -> None:
    compute = next(model.parameters()).dtype
    if compute == torch.bfloat16:
        raise ValueError("the model computes in bfloat16, which ONNX Runtime's CPU EP has no kernels for: pass "
                         "model.float() (a checkpoint folder is loaded in float32); dtype= still sets the cache's "
                         "element type")
    if getattr(config, "kv_lora_rank", None):
        raise ValueError("multi-head latent attention (kv_lora_rank): its cache holds compressed latents, not "
                         "per-head keys and values")
    other = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
    if other:
        raise ValueError(f"layer types {', '.join(other)}: only full and sliding-window softmax attention run on the "
                         f"paged cache (linear, recurrent or chunked attention does not)")
    for name, module in model.named_modules():
        rope_type = getattr(module, "rope_type", None)
        # One type, or one per layer type (a rotary module serving several: Gemma 3's, OLMo 3's)
        for where, kind in (rope_type.items() if isinstance(rope_type, dict) else [(None, rope_type)]):
            if isinstance(kind, str) and kind in LENGTH_DEPENDENT_ROPE:
                layers = f", {where} layers" if where is not None else ""
                raise ValueError(f"rope type {kind!r} ({name}{layers}) changes its frequencies with the sequence "
                                 f"length; the packed graph needs static frequencies (default, linear, llama3, yarn, "
                                 f"...)")
    positions = getattr(config, "max_position_embeddings", None)
    if positions is None:
        raise ValueError("the config names no max_position_embeddings: the engine needs the longest context")
    if positions <= _PROBE_POSITION + _PROBE_SHIFT:
        raise ValueError(f"the model has {positions} positions (max_position_embeddings): the export probes its "
                         f"forward at position {_PROBE_POSITION + _PROBE_SHIFT}, so it needs more")


def _uniform(seen: dict, field: str, what: str, why: str = "one paged cache needs one shape for all"):
    values = {s[field] for s in seen.values()}
    if len(values) != 1:
        raise ValueError(f"layers differ in {what} ({sorted(values)}): {why}")
    return values.pop()


def _expected_windows(config, num_layers: int) -> list:
    """Which layers the config says attend through a sliding window."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [t == "sliding_attention" for t in layer_types]
    return [bool(window) and getattr(config, "use_sliding_window", True) is not False] * num_layers


def _shift_frequencies(model, seen: dict, shifted: dict) -> tuple:
    """The rotary inverse frequencies KeyCacheRotaryShift must use to move this model's cached keys, or () when no
    single set of frequencies does: every layer's key at position p, rotated by the shift, must equal the model's
    own key at p + shift (probed with attention zeroed, so keys depend only on the token and its position)."""
    candidates = {tuple(m.inv_freq.detach().float().tolist()) for m in model.modules()
                  if isinstance(getattr(m, "inv_freq", None), torch.Tensor)}
    if len(candidates) != 1:
        return ()
    inv_freq = np.array(candidates.pop(), np.float64)
    angle = _PROBE_SHIFT * inv_freq
    cos, sin = np.cos(angle)[None, :].astype(np.float32), np.sin(angle)[None, :].astype(np.float32)
    rotary_dim = 2 * len(inv_freq)
    for layer, record in seen.items():
        before = record["key"][0, :, 0, :].numpy()  # [Hkv, Dh] of the one token
        after = shifted[layer]["key"][0, :, 0, :].numpy()
        if rotary_dim > before.shape[-1]:
            return ()
        moved = rotate(before[:, None, :], cos, sin, rotary_dim, False)[:, 0, :]
        if not np.allclose(moved, after, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(after).max()))):
            return ()
    return tuple(float(f) for f in inv_freq.astype(np.float32))


def decoder_sizes(model) -> DecoderSizes:
    """The decoder's sizes, per-layer windows, softmax scale, stop ids and (when its keys rotate as the shift op
    rotates them) rotary frequencies, from probing its own forward; ``ValueError`` naming what the packed graph
    cannot express. A float16 model is probed widened to float32 (restored after): its keys in float16 would miss
    the rotation check's float32 tolerance, and it would lose the key shift."""
    config = text_config(model)
    _refuse_unexpressible(model, config)
    with _widened(model):
        return _decoder_sizes(model, config)


def _decoder_sizes(model, config) -> DecoderSizes:
    num_layers = config.num_hidden_layers
    seen = probe(model, [_PROBE_TOKEN], [_PROBE_POSITION])
    layers = sorted(k for k in seen if isinstance(k, int))
    if layers != list(range(num_layers)):
        missing = sorted(set(range(num_layers)) - set(layers))
        raise ValueError(f"layers {missing} of {num_layers} do not attend through transformers' attention interface "
                         f"(linear or recurrent attention, or a custom attention): they cannot use the paged cache")
    heads = _uniform(seen, "heads", "query heads")
    kv_heads = _uniform(seen, "kv_heads", "key/value heads")
    head_dim = _uniform(seen, "head_dim", "head size")
    if _uniform(seen, "value_dim", "value head size") != head_dim:
        raise ValueError(f"value heads of {seen[0]['value_dim']} dims against keys of {head_dim}: the cache stores "
                         f"keys and values of one head size")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    scaling = _uniform(seen, "scaling", "softmax scale", "the exported model records one softmax scale for all "
                       "its layers")
    windows = tuple(seen[i]["sliding_window"] for i in range(num_layers))
    for i, expected in enumerate(_expected_windows(config, num_layers)):
        if expected and not windows[i]:
            raise ValueError(f"layer {i} has a sliding window in its config that its attention does not pass to the "
                             f"attention interface (applied through the mask only): the ops would attend further")
    shifted = probe(model, [_PROBE_TOKEN], [_PROBE_POSITION + _PROBE_SHIFT])
    sizes = DecoderSizes(config.model_type, num_layers, heads, kv_heads, head_dim, config.vocab_size,
                         config.max_position_embeddings, windows, _shift_frequencies(model, seen, shifted),
                         scaling if scaling else head_dim ** -0.5, eos_token_ids(model))
    check_routing(model, sizes)
    _check_windows_act(model, sizes)
    return sizes


def _check_windows_act(model, sizes: DecoderSizes) -> None:
    """Where a layer passes a sliding window to the attention interface that the 64-token routing check cannot see
    act, runs the check on a sequence longer than the window (up to :data:`_WINDOW_CHECK_TOKENS`): a model whose own
    mask ignores the window it passes (OLMoE with a ``sliding_window`` in its config) is refused, not exported with a
    window it does not apply."""
    reach = min(_WINDOW_CHECK_TOKENS, sizes.max_positions)  # a window of w acts from w + 1 tokens on
    window = max((w for w in sizes.sliding_windows if w and w < reach), default=0)  # the largest that acts in reach
    tokens = min(window + 2, reach)
    if not window or tokens <= 64:  # none acts within reach, or the 64-token check has seen it act
        return
    try:
        check_routing(model, sizes, tokens=tokens)
    except ValueError as error:
        raise ValueError(f"its layers pass a sliding window of {window} to the attention interface, but over "
                         f"{tokens} tokens its routed forward differs from its own (its mask may ignore the window): "
                         f"{error}") from None


def eos_token_ids(model) -> tuple:
    """The ids generation stops after: the config's and the generation config's (chat checkpoints keep their
    end-of-turn id in the latter), but for ids past the vocabulary, which no step can generate (a config's defaults
    kept over a smaller vocabulary)."""
    eos = _ids(getattr(text_config(model), "eos_token_id", None)) + _ids(
        getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    vocab = text_config(model).vocab_size
    return tuple(t for t in dict.fromkeys(eos) if 0 <= t < vocab)


def _ids(value) -> tuple:
    """None, an id or a list of ids as a tuple of ints."""
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
