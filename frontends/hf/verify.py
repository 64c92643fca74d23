"""The source model's own answers, to check a served model against: ``transformers``' greedy ``generate``
one request at a time, optionally with its KV cache stored the way an exported cache stores it
(rounded to the cache dtype, or quantized and dequantized exactly as KeyValueCache specifies), so a
quantized export has an oracle of matching precision."""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache, GenerationConfig

from ..reference.quantize import dequantize, quantize
from ..serving.model_info import ModelInfo
from .structure import eos_token_ids

_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def stored_kv(info: ModelInfo):
    """``round(x) -> x'``: keys/values ``[..., Dh]`` as the exported cache gives them back: cast to the
    cache dtype T1, then (quantized) quantized and dequantized as KeyValueCache specifies, back in T1.
    ``None`` when the cache keeps float32 exactly."""
    import ml_dtypes

    numpy_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
    t1 = _TORCH[info.cache_dtype]
    if info.quant_bit:
        scale_dtype, out_dtype = numpy_dtype[info.scale_dtype], numpy_dtype[info.cache_dtype]

        def round_quantized(x: torch.Tensor) -> torch.Tensor:
            codes, scale = quantize(x.to(t1).float().numpy(), info.quant_bit, info.quant_group, scale_dtype)
            stored = dequantize(codes, scale, info.quant_group, out_dtype).astype(np.float32)
            return torch.from_numpy(stored).to(x.dtype)
        return round_quantized
    if info.cache_dtype == "float32":
        return None
    return lambda x: x.to(t1).to(x.dtype)


class StoredKVCache(DynamicCache):
    """A ``DynamicCache`` whose stored keys/values pass through ``round_kv`` first."""

    def __init__(self, config, round_kv):
        super().__init__(config=config)
        self.round_kv = round_kv

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(self.round_kv(key_states), self.round_kv(value_states), layer_idx, *args, **kwargs)


def _cache(model, round_kv) -> dict:
    """The keyword argument that hands ``model`` (and its ``generate``) a fresh cache. transformers 5
    renamed ``past_key_values`` to ``cache`` within its major version and warns on the old name, so the
    name is the one the model's ``forward`` takes."""
    import inspect

    cache = StoredKVCache(model.config, round_kv) if round_kv is not None else DynamicCache(config=model.config)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def reference_generate(model, prompt, max_new_tokens: int, round_kv=None) -> list:
    """``model.generate`` greedy continuation of one prompt, stopping after an end-of-sequence id of the
    config or generation config (included), as the engine does; on the model's device."""
    ids = torch.tensor([list(prompt)], device=model.device)
    # Plain greedy search and the stop ids the engine uses, not the checkpoint's generation defaults
    # (repetition penalties and the like would make it another decoding rule).
    # generate fills what a passed config leaves at its defaults from the model's own, so the model's is
    # swapped for the duration of the call.
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
                              eos_token_id=list(eos_token_ids(model)) or None)
    saved, model.generation_config = model.generation_config, config
    try:
        with torch.no_grad():  # an explicit mask: generate would otherwise mask every token equal to the pad id
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **_cache(model, round_kv))
    finally:
        model.generation_config = saved
    return out[0, len(prompt):].tolist()


def reference_logits(model, prompt, tokens, round_kv=None) -> np.ndarray:
    """The model's logits ``[len(tokens), vocab]`` predicting each of ``tokens`` after ``prompt`` (one
    forward pass over the whole sequence)."""
    with torch.no_grad():
        ids = torch.tensor([list(prompt) + list(tokens)], device=model.device)
        logits = model(ids, **_cache(model, round_kv), use_cache=True).logits
    return logits[0, len(prompt) - 1:-1].float().cpu().numpy()
