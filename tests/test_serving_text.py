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


@pytest.fixture(scope="module")
def tokenizer():
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


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


def test_random_token_sequences_still_join_to_their_decode(tokenizer):
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
    assert not any(s in "".join(out) for s in stops)
