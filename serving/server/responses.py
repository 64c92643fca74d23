"""OpenAI's response bodies and stream chunks for completions and chat completions, from a :class:`Generation`'s
pieces."""

from __future__ import annotations

import json
import time
import uuid


def new_id(prefix: str) -> str:
    """A response id in OpenAI's style (``cmpl-...``, ``chatcmpl-...``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


FLOOR_LOGPROB = -9999.0  # what OpenAI reports for a token of no probability (JSON has no -inf)


def _finite(logprob: float) -> float:
    """A log-probability JSON can carry: -inf (a logit of -inf: the model rules the token out) and NaN as
    :data:`FLOOR_LOGPROB`."""
    return logprob if logprob >= FLOOR_LOGPROB else FLOOR_LOGPROB  # NaN too (comparisons false)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload) -> bytes:
    """One server-sent event carrying ``payload`` (JSON, or the literal ``[DONE]``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def listed_token(generation, token: int) -> str:
    """A token as completions' logprobs list it (they carry no bytes): its text, or where its bytes are no UTF-8 text
    (part of a character, which reads as U+FFFD) OpenAI's ``bytes:\\xNN...`` of them, so that such tokens are told
    apart."""
    text = generation.token_text(token)
    if "\ufffd" in text:
        data = generation.token_bytes(token)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
    return text


def _by_text(listed, top) -> dict:
    """Completions' {listed token: logprob}: tokens listed alike (two tokens of one text) keep the most likely."""
    out = {}
    for token, logprob in top:
        out.setdefault(listed(token), _finite(logprob))
    return out


class Reply:
    """The pieces of one generation shaped as a completion or a chat completion (``chat``), whole or chunked."""

    def __init__(self, generation, model: str, chat: bool):
        self.generation, self.model, self.chat = generation, model, chat
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self._offset = 0  # characters of the tokens' own texts so far (completions' text_offset)

    # ---- logprobs ------------------------------------------------------------------------------------------
    def logprobs(self, pieces: list):
        """The logprobs object of ``pieces`` (None when the request asked for none)."""
        if self.generation.params.logprobs is None:
            return None
        text = self.generation.token_text
        if self.chat:
            def entry(token, logprob):
                return {"token": text(token), "logprob": _finite(logprob),
                        "bytes": list(self.generation.token_bytes(token))}
            return {"content": [dict(entry(p.token, p.logprobs.logprob),
                                     top_logprobs=[entry(t, lp) for t, lp in p.logprobs.top]) for p in pieces]}
        # OpenAI's text_offset: where each token starts in its tokens' text joined (each token as "tokens" lists
        # it), not in the reply's, which holds a character's bytes back and leaves stop strings out.
        def listed(token):
            return listed_token(self.generation, token)
        tokens, offsets = [listed(p.token) for p in pieces], []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        return {"tokens": tokens,
                "token_logprobs": [_finite(p.logprobs.logprob) for p in pieces],
                "top_logprobs": [_by_text(listed, p.logprobs.top) for p in pieces],
                "text_offset": offsets}

    # ---- whole -------------------------------------------------------------------------------------------
    def body(self, text: str, pieces: list) -> dict:
        """The non-streamed response."""
        g = self.generation
        choice = {"index": 0, "logprobs": self.logprobs(pieces), "finish_reason": g.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": usage(len(g.prompt_ids), g.completion_tokens)}

    # ---- streamed ----------------------------------------------------------------------------------------
    def chunk(self, text: str = None, pieces: list = (), finish_reason: str = None, *, role: bool = False) -> dict:
        """One stream chunk: ``text`` (with the logprobs of ``pieces``), or the opening role (chat), or the
        closing ``finish_reason``."""
        choice = {"index": 0, "logprobs": self.logprobs(list(pieces)) if pieces else None,
                  "finish_reason": finish_reason}
        if self.chat:
            delta = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the token counts."""
        g = self.generation
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [],
                "usage": usage(len(g.prompt_ids), g.completion_tokens)}
