"""Each token's own text and bytes, as the logprobs report them, join to the text they came from, for SentencePiece
tokenizers too (Llama 2, Mistral, Phi-3: "▁" stands for a space, and decoding a word-initial piece alone drops it):
checked on the pieces of a known text, and on the served replies (chat ``bytes``, completions ``tokens`` and
``text_offset``) of the tiny export under such a tokenizer."""

import string

import pytest

pytest.importorskip("transformers")

SPACE = "\u2581"
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def sentencepiece_tokenizer(decoder: str, byte_fallback: bool, size: int = 360):
    """A SentencePiece-style BPE tokenizer of ``size`` tokens, built from a fixed vocabulary (no training, so the same
    every run): <s>=0 and </s>=1 as the tiny export has them, 256 ``<0xHH>`` byte tokens (``byte_fallback``) or an
    <unk>, characters, then word pieces. ``decoder``: "llama2" (normalizer prepends and maps spaces; the decoder
    replaces "▁", fuses and strips one leading space) or "metaspace" (Metaspace pre-tokenizer and decoder)."""
    import tokenizers
    from tokenizers import decoders, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1}
    vocab.update({f"<0x{b:02X}>": 2 + b for b in range(256)} if byte_fallback else {"<unk>": 2})
    for c in SPACE + string.ascii_lowercase + string.digits + ".,!?'-":
        vocab[c] = len(vocab)
    merges = []

    def merge(a, b):
        if a + b not in vocab and len(vocab) < size:
            vocab[a + b] = len(vocab)
            merges.append((a, b))

    for word in ["the", "cache", "key", "value", "page", "hello", "world", "token", "attention"]:
        for i in range(len(word)):
            merge(SPACE + word[:i], word[i])
    for a in string.ascii_lowercase:
        for b in string.ascii_lowercase:
            merge(a, b)
    assert len(vocab) == size
    raw = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges, byte_fallback=byte_fallback,
                                                     unk_token=None if byte_fallback else "<unk>"))
    fallback = [decoders.ByteFallback()] if byte_fallback else []
    if decoder == "llama2":
        raw.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        raw.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), *fallback, decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first")
        raw.decoder = decoders.Sequence([*fallback, decoders.Metaspace(replacement=SPACE, prepend_scheme="first")])
    specials = ["<s>", "</s>"] + ([] if byte_fallback else ["<unk>"])
    raw.add_special_tokens([tokenizers.AddedToken(s, special=True) for s in specials])
    raw.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                        unk_token=None if byte_fallback else "<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


DECODERS = ["llama2", "metaspace"]


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("byte_fallback", [True, False], ids=["byte-fallback", "pieces-only"])
def test_the_pieces_of_a_text_join_to_it(decoder, byte_fallback):
    """The normalizer writes a text T as "▁" + T with spaces as "▁", so its pieces' bytes joined are " " + T (the
    bytes of a character the vocabulary lacks come from its byte tokens), and their texts joined are that with each
    split character read as replacement characters."""
    from kvcache_op.serving.tokenizer import token_bytes, token_text

    tokenizer = sentencepiece_tokenizer(decoder, byte_fallback)
    text = "hello world the café 東京 cache keys" if byte_fallback else "hello world the cafe cache keys"
    ids = tokenizer(text)["input_ids"][1:]  # after the BOS
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert pieces[0] == SPACE + "hello" and sum(p.startswith(SPACE) for p in pieces) >= 5, pieces
    assert b"".join(token_bytes(tokenizer, t) for t in ids) == (" " + text).encode()
    texts = [token_text(tokenizer, t) for t in ids]
    assert texts[:3] == [" hello", " world", " the"]
    if not byte_fallback:
        assert "".join(texts) == " " + text
    else:
        assert sum(t == "\ufffd" for t in texts) == sum(p.startswith("<0x") for p in pieces) > 0


@pytest.fixture(scope="module", params=DECODERS)
def sentencepiece_client(request, exported):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from conftest import served_app

    tokenizer = sentencepiece_tokenizer(request.param, byte_fallback=False)  # every reply is whole characters
    with TestClient(served_app(exported, tokenizer)) as client:
        yield client, tokenizer


def test_the_logprobs_of_a_reply_join_to_its_text(sentencepiece_client):
    """Chat: the ``bytes`` of the tokens the reply shows join to its content (OpenAI: they are to be combined into
    the text). Completions: the ``tokens`` join to the text, and ``text_offset`` indexes them. Sampled replies of
    many words, so word-initial pieces are among them."""
    client, tokenizer = sentencepiece_client
    special = set(tokenizer.all_special_tokens)
    spaced = 0
    for seed in range(6):
        chat = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 16,
            "temperature": 1.0, "seed": seed, "logprobs": True, "top_logprobs": 2}).json()["choices"][0]
        entries = [e for e in chat["logprobs"]["content"] if e["token"] not in special]
        assert b"".join(bytes(e["bytes"]) for e in entries).decode() == chat["message"]["content"]
        assert all(bytes(e["bytes"]) == e["token"].encode() for e in entries)
        plain = client.post("/v1/completions", json={
            "model": "tiny", "prompt": "the cache", "max_tokens": 16, "temperature": 1.0, "seed": seed,
            "logprobs": 2}).json()["choices"][0]
        tokens = plain["logprobs"]["tokens"]
        assert "".join(t for t in tokens if t not in special) == plain["text"]
        assert plain["logprobs"]["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
        spaced += sum(t.startswith(" ") for t in tokens) + sum(e["token"].startswith(" ") for e in entries)
    assert spaced > 0, "no reply held a word-initial piece: the test checks nothing"


@pytest.mark.parametrize("decoder", DECODERS)
def test_completions_list_a_token_holding_part_of_a_character_by_its_bytes(decoder):
    """Completions' logprobs carry no bytes: a token that is part of a character is listed as OpenAI lists one,
    ``bytes:\\xNN``, so the top alternatives of one place are as many as asked for (byte tokens all read U+FFFD and
    collapsed into one key); whole tokens keep their text, and text_offset indexes the tokens as listed."""
    import types

    from kvcache_op.serving.sampling import TokenLogprobs
    from kvcache_op.serving.server.generation import Piece
    from kvcache_op.serving.server.responses import Reply
    from kvcache_op.serving.tokenizer import token_bytes, token_text

    tokenizer = sentencepiece_tokenizer(decoder, byte_fallback=True)
    generation = types.SimpleNamespace(params=types.SimpleNamespace(logprobs=4),
                                       token_text=lambda t: token_text(tokenizer, t),
                                       token_bytes=lambda t: token_bytes(tokenizer, t))
    e6, e7, b1 = (tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xE6, 0xE7, 0xB1))
    hello = tokenizer.convert_tokens_to_ids(SPACE + "hello")
    pieces = [Piece("", e6, TokenLogprobs(-0.5, [(e6, -0.5), (e7, -1.0), (b1, -2.0), (hello, -3.0)])),
              Piece(" hello", hello, TokenLogprobs(-0.1, [(hello, -0.1)]))]
    logprobs = Reply(generation, "tiny", chat=False).logprobs(pieces)
    assert logprobs["tokens"] == ["bytes:\\xe6", " hello"]
    assert logprobs["top_logprobs"][0] == {"bytes:\\xe6": -0.5, "bytes:\\xe7": -1.0, "bytes:\\xb1": -2.0,
                                           " hello": -3.0}
    assert logprobs["text_offset"] == [0, len("bytes:\\xe6")]
