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
}


def tiny_config(family: str, **overrides):
    """A ``transformers`` config of ``family`` (llama, mistral, qwen2) with :data:`BASE` sizes."""
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
