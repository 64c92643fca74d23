"""A checkpoint folder as a user would point ``kvcache-op serve`` at, made without a download: a tiny decoder with
seeded random weights (``save_pretrained``), a byte-level BPE tokenizer trained here with BOS/EOS tokens, and a chat
template. What the server's tests, its load benchmark and a first try of the server use."""

from __future__ import annotations

import pathlib

from .tiny import tiny_model

CORPUS = ["hello world, the cache keeps every key", "paged attention reads pages in place",
          "café naïve résumé — 東京 🙂", "the quick brown fox jumps over the lazy dog"] * 20
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def tiny_checkpoint(folder, family: str = "llama", *, seed: int = 0, vocab_size: int = None, **sizes) -> tuple:
    """Writes the checkpoint (weights, config, tokenizer, chat template) into ``folder``; returns the (model,
    tokenizer) objects. The model's vocabulary is the tokenizer's (``vocab_size``: a wider one, whose ids past the
    tokenizer's have no text: a real model's width for benchmarks fed token ids), its end-of-sequence id the
    tokenizer's ``</s>``; ``sizes`` override :func:`tiny_model`'s (hidden_size, num_hidden_layers, ...).
    ``ValueError`` for a ``vocab_size`` narrower than the tokenizer's, before anything is written."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = pathlib.Path(folder)
    raw = tokenizers.Tokenizer(tokenizers.models.BPE())
    raw.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=360, special_tokens=["<s>", "</s>"], show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(CORPUS, trainer)
    if vocab_size is not None and vocab_size < raw.get_vocab_size():
        raise ValueError(f"vocab_size={vocab_size} is narrower than the tokenizer's {raw.get_vocab_size()} tokens")
    bos, eos = raw.token_to_id("<s>"), raw.token_to_id("</s>")
    raw.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    model = tiny_model(family, seed=seed, **{**sizes, "eos_token_id": eos, "bos_token_id": bos,
                                             "vocab_size": vocab_size or len(tokenizer)})
    model.save_pretrained(folder)
    return model, tokenizer
