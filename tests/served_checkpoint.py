"""A checkpoint folder as a user would point the server at: a tiny Llama with random weights (save_pretrained), a
byte-level BPE tokenizer trained here (no download) with BOS/EOS tokens, and a chat template."""

from __future__ import annotations

import pathlib

CORPUS = ["hello world, the cache keeps every key", "paged attention reads pages in place",
          "café naïve résumé — 東京 🙂", "the quick brown fox jumps over the lazy dog"] * 20
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def make_checkpoint(folder) -> tuple:
    """Writes the checkpoint into ``folder``; returns (model, tokenizer) as loaded objects."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvcache_op.hf import tiny_model

    folder = pathlib.Path(folder)
    raw = tokenizers.Tokenizer(tokenizers.models.BPE())
    raw.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=360, special_tokens=["<s>", "</s>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(CORPUS, trainer)
    bos, eos = raw.token_to_id("<s>"), raw.token_to_id("</s>")
    raw.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    model = tiny_model("llama", eos_token_id=eos, bos_token_id=bos, vocab_size=len(tokenizer))
    model.save_pretrained(folder)
    return model, tokenizer
