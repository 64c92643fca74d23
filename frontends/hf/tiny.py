"""Small ``transformers`` decoders with seeded random weights, built from a config (no download): what the
demo serves and the tests check the engine against."""

from __future__ import annotations

import torch

# Sizes small enough for seconds on two CPU cores, large enough to exercise GQA and several layers.
BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2, eos_token_id=None,
            bos_token_id=None, pad_token_id=None)
FAMILY_DEFAULTS = {
    "llama": dict(rope_theta=10000.0),
    "mistral": dict(rope_theta=10000.0, sliding_window=24),
    "qwen2": dict(rope_theta=1000000.0, tie_word_embeddings=True),  # Qwen2's q/k/v projections carry biases
    # The families below exercise what the exporter takes from the model's own forward: QK-norm (qwen3, olmo2),
    # (1 + w) norms and scaled embeddings (gemma), softcapping and pre/post feed-forward norms (gemma2), per-layer-
    # type rotary and windows (gemma3_text), fused qkv and gate/up projections (phi3), multipliers and logit
    # scaling (granite), partial rotary (stablelm, gpt_neox), parallel residual (gpt_neox), experts (mixtral,
    # qwen3_moe).
    "qwen3": dict(head_dim=16),
    # Untied: with Gemma's scaled embeddings a tied head predicts the input token again. Small softcaps, so
    # that softcapping changes the scores of these small weights.
    "gemma": dict(head_dim=16, tie_word_embeddings=False),
    "gemma2": dict(head_dim=16, sliding_window=24, query_pre_attn_scalar=16, tie_word_embeddings=False,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gemma3_text": dict(head_dim=16, sliding_window=24, query_pre_attn_scalar=16, sliding_window_pattern=2,
                        tie_word_embeddings=False),
    "phi3": dict(),
    "olmo2": dict(),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0, attention_multiplier=0.3),
    "stablelm": dict(partial_rotary_factor=0.5),
    "gpt_neox": dict(rotary_pct=0.5, initializer_range=0.1),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
}


def tiny_config(family: str, **overrides):
    """A ``transformers`` config of ``family`` (a key of :data:`FAMILY_DEFAULTS`) with :data:`BASE` sizes."""
    from transformers import AutoConfig

    if family not in FAMILY_DEFAULTS:
        raise ValueError(f"family must be one of {', '.join(FAMILY_DEFAULTS)}, got {family!r}")
    settings = {**BASE, **FAMILY_DEFAULTS[family], **overrides}
    return AutoConfig.for_model(family, **settings)


def tiny_model(family: str, *, seed: int = 0, **overrides):
    """A float32 causal LM of ``family`` with weights drawn from ``torch.manual_seed(seed)``, in eval mode,
    using transformers' eager attention (the plain reference implementation)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    config._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return model.eval()
