"""A ``transformers`` causal LM as one packed dynamic-batching forward: the tokens of every sequence of a
step in one row-major batch, each layer's attention through MultiHeadCacheAttention (or the split pair
KeyValueCache then MultiHeadAttention).

The module reuses the model's own submodules (embeddings, norms, projections, MLPs, LM head), so
every variant those modules implement (biases, activations, tied embeddings) is the model's own
code. Only what the packed form changes is written here: rotary embedding at explicit positions,
and attention over the paged cache instead of a padded batch.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import torch as kt
from ..serving.model_info import DecoderSizes

# Rotary types whose inverse frequencies depend on the sequence length at run time: they cannot be
# one static graph, and a cache of keys rotated under one length would be wrong under another.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """How the exported graph stores its KV cache (KeyValueCache's attributes, cache_mode 1)."""

    page_size: int = 16
    quant_bit: int = 0
    quant_group: int = 8
    cache_layout: int = 1  # each layer's slots together: one stream per layer for the fused attention
    dtype: torch.dtype = torch.float32  # T1: the cache's element type when unquantized, and attention's
    # One MultiHeadCacheAttention node per layer (reading the cache in place), or the split pair KeyValueCache
    # (gathering a packed copy of every sequence's keys) then MultiHeadAttention.
    fused_attention: bool = True

    @property
    def scale_dtype(self) -> torch.dtype:
        """T3 of a quantized cache: the cache dtype where the spec admits it (float32/float16)."""
        return self.dtype if self.dtype in (torch.float32, torch.float16) else torch.float32


def decoder_sizes(model) -> DecoderSizes:
    """Reads a Llama/Mistral/Qwen2 causal LM; ``ValueError`` for what the packed graph cannot express."""
    config = model.config
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
    rotary = model.model.rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type in LENGTH_DEPENDENT_ROPE:
        raise ValueError(f"rope type {rope_type!r} changes its frequencies with the sequence length; the packed "
                         f"graph needs static frequencies (default, linear, llama3, yarn, ...)")
    compute = next(model.parameters()).dtype
    if compute == torch.bfloat16:
        raise ValueError("the model computes in bfloat16, which ONNX Runtime's CPU EP has no kernels for: pass "
                         "model.float() (a checkpoint folder is loaded in float32); dtype= still sets the cache's "
                         "element type")
    attention = model.model.layers[0].self_attn
    head_dim = attention.head_dim
    if 2 * rotary.inv_freq.numel() != head_dim:
        raise ValueError(f"partial rotary embedding ({2 * rotary.inv_freq.numel()} of {head_dim} dims) is not "
                         f"supported")
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    windows = tuple(window if window and (layer_types is None or layer_types[i] == "sliding_attention") else 0
                    for i in range(num_layers))
    eos = _ids(getattr(config, "eos_token_id", None)) + _ids(getattr(getattr(model, "generation_config", None),
                                                                       "eos_token_id", None))
    eos = tuple(dict.fromkeys(eos))  # chat checkpoints keep their end-of-turn id in the generation config
    return DecoderSizes(family, num_layers, config.num_attention_heads, config.num_key_value_heads, head_dim,
                        config.vocab_size, config.max_position_embeddings, windows,
                        tuple(float(f) for f in rotary.inv_freq.float()), float(attention.scaling), eos)


def _ids(value) -> tuple:
    """None, an id or a list of ids as a tuple of ints."""
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the last axis: the GPT-NeoX / Llama rotary pairing."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PackedDecoder(torch.nn.Module):
    """``forward(input_ids [T], positions [T], seqstarts [B+1], kvstarts [B+1], cachestarts [B, P],
    start_pos [B], decoding_batches, max_seqlen, max_kvlen, cache[, scale]) -> logits [B, vocab]``: the
    logits of each sequence's last token of this step. ``cache`` (one for all layers, ``layer_idx``
    selects) and ``scale`` are written in place; the first ``decoding_batches`` sequences are decodes."""

    def __init__(self, model, cache: CacheSettings):
        super().__init__()
        self.shape = decoder_sizes(model)
        self.cache = cache
        self.embed = model.get_input_embeddings()
        self.layers = model.model.layers
        self.norm = model.model.norm
        self.lm_head = model.get_output_embeddings()
        rotary = model.model.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=False)
        self.attention_scaling = float(rotary.attention_scaling)

    def rotary_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        """cos, sin ``[T, 1, Dh]`` at ``positions``, computed as the model's rotary embedding does."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def forward(self, input_ids, positions, seqstarts, kvstarts, cachestarts, start_pos, decoding_batches,
                max_seqlen, max_kvlen, cache, scale=None):
        s, c = self.shape, self.cache
        hidden = self.embed(input_ids)
        tokens = input_ids.shape[0]
        cos, sin = self.rotary_tables(positions, hidden.dtype)
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            query = attention.q_proj(x).view(tokens, s.num_heads, s.head_dim)
            key = attention.k_proj(x).view(tokens, s.num_kv_heads, s.head_dim)
            value = attention.v_proj(x).view(tokens, s.num_kv_heads, s.head_dim)
            query = query * cos + rotate_half(query) * sin
            key = key * cos + rotate_half(key) * sin
            cache_attributes = dict(num_layer=s.num_layers, layer_idx=index, quant_bit=c.quant_bit,
                                    quant_group=c.quant_group, cache_mode=1, cache_layout=c.cache_layout,
                                    page_size=c.page_size)
            attention_attributes = dict(num_heads=s.num_heads, head_dim=s.head_dim, num_kv_heads=s.num_kv_heads,
                                        sliding_window=s.sliding_windows[index], softmax_scale=s.softmax_scale)
            if c.fused_attention:
                attended = kt.multi_head_cache_attention(
                    query.to(c.dtype), key.to(c.dtype), value.to(c.dtype), seqstarts, kvstarts, cachestarts, start_pos,
                    decoding_batches, max_seqlen, max_kvlen, cache, scale, **cache_attributes, **attention_attributes)
            else:
                all_keys, all_values = kt.key_value_cache(
                    key.to(c.dtype), value.to(c.dtype), seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
                    max_kvlen, cache, scale, **cache_attributes)
                attended = kt.multi_head_attention(
                    query.to(c.dtype), all_keys, all_values, seqstarts, kvstarts, decoding_batches, max_seqlen,
                    max_kvlen, **attention_attributes)
            hidden = hidden + attention.o_proj(attended.to(hidden.dtype).reshape(tokens, s.num_heads * s.head_dim))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        last = self.norm(hidden).index_select(0, seqstarts[1:] - 1)
        return self.lm_head(last)
