"""Streaming text: the chunks of TextStream joined equal the tokenizer's own decode of all the tokens, and none
holds a broken character, whatever the tokens (a byte-level BPE trained here on text with accents, CJK and
emoji); StopMatcher emits exactly the text before the first stop string, found across chunk edges."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")

from kvcache_op.serving.text import REPLACEMENT, StopMatcher, TextStream  # noqa: E402

CORPUS = ["héllo wörld, ça va? 你好，世界！ 🙂🚀 naïve café", "the quick brown fox — jumps over 13 lazy dogs",
          "日本語のテキスト and English mixed 🎉 émoji"] * 20


LONG = " ".join(CORPUS[:3]) * 4  # long enough for the stream's window to move many times


def _byte_level():
    """GPT-2's kind: bytes as characters, spaces part of the word that follows."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _metaspace_byte_fallback(folder):
    """Llama's (sentencepiece) kind: "▁" for spaces, the decode dropping the text's first space, characters outside
    the vocabulary as byte tokens <0xNN> of the model's own vocabulary (not special tokens, which a decode skips)."""
    trained = tokenizers.Tokenizer(tokenizers.models.BPE())
    trained.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=600, special_tokens=[f"<0x{b:02X}>" for b in range(256)],
                                             limit_alphabet=40)  # rare characters left to the byte tokens
    trained.train_from_iterator(CORPUS, trainer)
    vocab, merges = trained.model.save(str(folder))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(vocab, merges, byte_fallback=True))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    dec = tokenizers.decoders
    tok.decoder = dec.Sequence([dec.Replace("\u2581", " "), dec.ByteFallback(), dec.Fuse(), dec.Strip(" ", 1, 0)])
    return tok


@pytest.fixture(scope="module", params=["byte-level", "metaspace"])
def tokenizer(request, tmp_path_factory):
    return _byte_level() if request.param == "byte-level" else _metaspace_byte_fallback(tmp_path_factory.mktemp("bpe"))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_chunks_join_to_the_decode_and_never_break_a_character(tokenizer, data):
    text = data.draw(st.sampled_from(CORPUS[:3]))
    ids = tokenizer.encode(text).ids
    start = data.draw(st.integers(0, len(ids) - 1))
    stream = TextStream(tokenizer, prompt_ids=ids[:start])
    chunks = [stream.push(t) for t in ids[start:]] + [stream.finish()]
    # the prompt's text (up to a character it leaves unfinished: the generation completes it), then the chunks
    prompt_text = tokenizer.decode(ids[:start]).rstrip(REPLACEMENT) if start else ""
    assert prompt_text + "".join(chunks) == text
    assert not any(REPLACEMENT in c for c in chunks)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_a_long_reply_joins_to_its_decode_as_the_window_moves(tokenizer, data):
    ids = tokenizer.encode(LONG).ids
    start = data.draw(st.integers(0, 40))
    stream = TextStream(tokenizer, prompt_ids=ids[:start])
    chunks = [stream.push(t) for t in ids[start:]] + [stream.finish()]
    prompt_text = tokenizer.decode(ids[:start]).rstrip(REPLACEMENT) if start else ""
    assert prompt_text + "".join(chunks) == tokenizer.decode(ids)
    assert not any(REPLACEMENT in c for c in chunks)


class CountingDecode:
    """A tokenizer whose decodes are counted by the tokens each is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, ids):
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids)


def test_a_token_costs_the_same_however_long_the_reply(tokenizer):
    """Each push decodes a bounded window, not every token so far: 2,000 tokens in, the largest decode is as small
    as in the first hundred (decoding everything each time made a long reply quadratic, and with stop strings the
    engine did it under its lock)."""
    ids = (tokenizer.encode(LONG).ids * 8)[:2000]
    while tokenizer.decode(ids).endswith(REPLACEMENT):  # whole characters: a byte-fallback decode of a cut run
        ids.pop()                                       # differs from its stream (see the random sequences' test)
    counting = CountingDecode(tokenizer)
    stream = TextStream(counting, prompt_ids=ids[:10])
    chunks = [stream.push(t) for t in ids[10:]]
    bound = 3 * 4 + TextStream.SETTLE_AFTER
    assert max(counting.sizes) <= bound, max(counting.sizes)
    assert sum(counting.sizes) <= 20 * bound * len(chunks)  # the window's own retries included
    prompt_text = tokenizer.decode(ids[:10]).rstrip(REPLACEMENT)
    assert prompt_text + "".join(chunks) + stream.finish() == tokenizer.decode(ids)


def test_a_prompt_cut_inside_a_long_run_of_byte_tokens_is_completed_by_the_reply(tokenizer):
    """Characters outside the vocabulary are runs of byte tokens; a prompt may end anywhere in one. The context is
    then found further back than the run (a byte-fallback decode turns a whole run that ends inside a character into
    replacement characters, so no tail inside it decodes cleanly): the reply completes the cut character, and the
    prompt's text and the chunks join to the text."""
    text = "ok \U0001D11E\U0001D11E\U0001D11E\U0001D160 done"  # musical symbols: in neither vocabulary
    ids = tokenizer.encode(text).ids
    for cut in range(1, len(ids)):
        stream = TextStream(tokenizer, prompt_ids=ids[:cut])
        chunks = [stream.push(t) for t in ids[cut:]] + [stream.finish()]
        assert tokenizer.decode(ids[:cut]).rstrip(REPLACEMENT) + "".join(chunks) == text, cut
        assert not any(REPLACEMENT in c for c in chunks), cut


def _byte_token_ids(tokenizer, data: bytes) -> list:
    """One token per byte: byte-level's byte characters (GPT-2's table, written out here), or byte fallback's
    ``<0xNN>``."""
    if tokenizer.decoder.__class__.__name__ != "ByteLevel":
        return [tokenizer.token_to_id(f"<0x{b:02X}>") for b in data]
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    char = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    return [tokenizer.token_to_id(char[b]) for b in data]


@pytest.mark.parametrize("ending", [b"\x90", b"\xe6", b"\xe6\x97", b"\xf0\x9f\x99"])
def test_a_prompt_ending_in_a_broken_character_keeps_its_replacement_characters(tokenizer, ending):
    """A prompt of token ids may end in bytes that are no whole character (a lone continuation byte, or a character's
    first bytes the reply does not go on with): the replacement characters they decode to are the prompt's, so the
    prompt's own decode and the chunks join to the decode of all the tokens, and no chunk holds one; byte-level, the
    reply is its own tokens' decode."""
    prompt = tokenizer.encode("hello world").ids + _byte_token_ids(tokenizer, ending)
    assert tokenizer.decode(prompt).endswith(REPLACEMENT)
    reply = tokenizer.encode("the quick café 你好").ids  # its first byte is ASCII: it completes nothing
    stream = TextStream(tokenizer, prompt_ids=prompt)
    chunks = [stream.push(t) for t in reply] + [stream.finish()]
    assert tokenizer.decode(prompt) + "".join(chunks) == tokenizer.decode(prompt + reply)
    assert not any(REPLACEMENT in c for c in chunks)
    if tokenizer.decoder.__class__.__name__ == "ByteLevel":  # byte fallback's decode alone drops the reply's space
        assert "".join(chunks) == tokenizer.decode(reply)


def test_random_token_sequences_still_join_to_their_decode(tokenizer):
    """Any tokens, where the decode of a prefix is a prefix of the decode (byte-level). A byte-fallback decoder is not
    so: a run of byte tokens that is not UTF-8 decodes byte by byte to replacement characters, so a byte token that
    joins a run can turn an ASCII byte already out (the run's first) into one; a stream cannot take text back."""
    if tokenizer.decoder.__class__.__name__ != "ByteLevel":
        pytest.skip("a byte-fallback decode of random bytes is not prefix-stable: no stream can equal it")
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(rng.randrange(1, 30))]
        stream = TextStream(tokenizer)
        assert "".join([stream.push(t) for t in ids] + [stream.finish()]) == tokenizer.decode(ids)


@pytest.mark.parametrize("chunks, stops, want", [
    (["hel", "lo wo", "rld"], ["lo w"], "hel"),
    (["abc", "de"], ["xyz"], "abcde"),
    (["ab", "c<", "/s", ">tail"], ["</s>"], "abc"),
    (["a<", "b"], ["</s>"], "a<b"),  # a held prefix that never became a stop is released
    (["xx", "yy"], ["yy", "xy"], "x"),  # the earliest stop wins
    (["ab", "cd"], ["", "zz"], "abcd"),  # an empty stop string is no stop (it would match before any text)
])
def test_stop_strings_are_found_across_chunks_and_never_emitted(chunks, stops, want):
    matcher = StopMatcher(stops)
    out = []
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        out.append(text)
        if stopped:
            break
    out.append(matcher.flush())
    assert "".join(out) == want
    assert not any(s and s in "".join(out) for s in stops)
