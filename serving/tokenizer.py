"""Text to token ids and back for a served checkpoint: its tokenizer and chat template through ``transformers``'
``AutoTokenizer`` (the ``tokenizers`` fast path). Its end-of-sequence ids travel in the exported file's metadata
(the config's and the generation config's)."""

from __future__ import annotations

import functools
import pathlib
import weakref


def load_tokenizer(folder):
    """The tokenizer saved in ``folder`` (a checkpoint folder, or the ``OUT.tokenizer`` folder ``kvcache-op export``
    writes), loaded offline. ``FileNotFoundError``/``ValueError`` naming the folder when it has none."""
    folder = pathlib.Path(folder)
    check_tokenizer_folder(folder)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except ImportError:
        raise  # a missing optional module (sentencepiece, say): the command names what brings it
    except Exception as error:  # noqa: BLE001 - a damaged tokenizer file: one line naming the folder, not a traceback
        raise ValueError(f"cannot load the tokenizer in {folder}: {type(error).__name__}: {error}") from error


def check_tokenizer_folder(folder) -> None:
    """``FileNotFoundError``/``ValueError`` naming ``folder`` unless it holds a tokenizer's files (cheap: what
    ``kvcache-op serve`` checks before exporting a checkpoint)."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no tokenizer folder at {folder}")
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ValueError(f"{folder} holds no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_ids(tokenizer, messages: list) -> list:
    """The token ids of ``messages`` ([{"role": ..., "content": str}, ...]) rendered by the checkpoint's chat template
    with the assistant's turn opened (``add_generation_prompt``). ``ValueError`` when it has no template."""
    if not has_chat_template(tokenizer):
        raise ValueError("this model's tokenizer has no chat template: use /v1/completions")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template writes the special tokens (BOS included) itself: encoding adds none.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def text_prompt_ids(tokenizer, text: str) -> list:
    """The token ids of a completion prompt, with the tokenizer's special tokens (a BOS where it adds one), as
    ``transformers`` encodes a prompt for ``generate``."""
    return list(tokenizer(text)["input_ids"])


class PlainText:
    """A tokenizer's decode without its special tokens (an end-of-sequence token has no text in a reply)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@functools.lru_cache(maxsize=None)
def _byte_level_alphabet() -> dict:
    """The byte-level BPE alphabet (GPT-2's, as Llama 3's and Qwen's tokenizers use it) read back: each character a
    token string uses -> the byte it stands for (``transformers``' own table, inverted)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


class _TokenPieces:
    """One tokenizer's token texts and bytes, each read once and kept (a vocabulary's worth at most): a text read
    after an anchor (an ordinary token, ``"a"``); bytes from the token string where it spells them. It holds no
    reference to the tokenizer, which keys it weakly."""

    def __init__(self, tokenizer):
        self.anchor = list(tokenizer("a", add_special_tokens=False)["input_ids"])
        self.lead = _plain_decode(tokenizer, self.anchor) if self.anchor else ""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self.alphabet = _byte_level_alphabet() if byte_level else {}
        self.special = set(getattr(tokenizer, "all_special_ids", ()))
        self.texts, self.bytes = {}, {}

    def text(self, tokenizer, token: int) -> str:
        if token not in self.texts:
            pair = _plain_decode(tokenizer, self.anchor + [token]) if self.lead else ""
            self.texts[token] = pair[len(self.lead):] if self.lead and pair.startswith(self.lead) else \
                _plain_decode(tokenizer, [token])
        return self.texts[token]

    def bytes_of(self, tokenizer, token: int) -> bytes:
        if token not in self.bytes:
            self.bytes[token] = self._spelled(tokenizer, token) or \
                self.text(tokenizer, token).encode("utf-8", errors="replace")
        return self.bytes[token]

    def _spelled(self, tokenizer, token: int):
        """The bytes a byte-level token string or a byte-fallback ``<0xHH>`` token spells; None for other tokens."""
        if token in self.special or not hasattr(tokenizer, "convert_ids_to_tokens"):
            return None
        piece = tokenizer.convert_ids_to_tokens(token)
        if not isinstance(piece, str) or not piece:
            return None
        if self.alphabet and all(c in self.alphabet for c in piece):
            return bytes(self.alphabet[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return None


def _plain_decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids))  # the tokenizer's own clean-up setting, as the reply's decode has it


_TOKEN_PIECES = weakref.WeakKeyDictionary()  # tokenizer -> its _TokenPieces


def _pieces(tokenizer) -> _TokenPieces:
    try:
        pieces = _TOKEN_PIECES.get(tokenizer)
        if pieces is None:
            pieces = _TOKEN_PIECES[tokenizer] = _TokenPieces(tokenizer)
        return pieces
    except TypeError:  # a tokenizer that takes no weak reference: nothing kept
        return _TokenPieces(tokenizer)


def token_text(tokenizer, token: int) -> str:
    """Token ``token``'s own text as it reads inside a text: what it adds after an ordinary token. A word-initial
    SentencePiece piece (``"▁the"``) keeps the space its decode alone drops, so the texts of a reply's tokens join to
    the reply; a token holding part of a character reads as the replacement character; a special token as itself.
    Where the anchor's text is not a prefix of the pair's, the token's decode alone."""
    return _pieces(tokenizer).text(tokenizer, int(token))


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes token ``token`` stands for, also where it holds part of a character (its text alone then decodes to
    a replacement character): read from a byte-level token string, or a byte-fallback token ``<0xHH>``; otherwise
    (special tokens, SentencePiece pieces, whole-character vocabularies) the UTF-8 of its :func:`token_text`."""
    return _pieces(tokenizer).bytes_of(tokenizer, int(token))
