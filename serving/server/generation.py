"""One HTTP request's generation: submitted to the engine (off the event loop: a submit waits for the step in
progress), its tokens turned into text as they come (whole characters only, stop strings cut, an end-of-sequence or
stop token's own text left out), and cancelled when the client goes away."""

from __future__ import annotations

import asyncio
import dataclasses

from ..text import StopMatcher, TextStream
from ..tokenizer import PlainText, token_bytes, token_text


@dataclasses.dataclass
class Piece:
    """What one token adds to the reply: its text (possibly "" while a character or a possible stop string is
    held), the token, and its logprobs entry (``TokenLogprobs`` or None)."""

    text: str
    token: int
    logprobs: object = None


class Generation:
    """A request running in the engine, read as text. Iterate :meth:`pieces` (async); then ``finish_reason``
    (OpenAI's: "stop" or "length"), ``completion_tokens`` and :meth:`tail` (text held back until the end)."""

    def __init__(self, engine, tokenizer, prompt_ids: list, params, handle):
        self.engine, self.tokenizer, self.params, self.handle = engine, tokenizer, params, handle
        self.prompt_ids = prompt_ids
        self._text = TextStream(PlainText(tokenizer), prompt_ids)
        self._stops = StopMatcher(params.stop)
        # Tokens that end a request carry no text of their own in the reply (OpenAI's and vLLM's default).
        self._silent = engine.end_tokens(params)
        self.completion_tokens = 0

    @classmethod
    async def start(cls, engine, tokenizer, prompt_ids: list, params, salt, max_waiting: int = None) -> "Generation":
        """Submits the request (``ValueError``/``TypeError`` from the engine's checks and ``EngineBusy`` where
        ``max_waiting`` requests wait already propagate). Cancelled while the submit waits (for the step in progress),
        the request it queues is cancelled as soon as it is queued: nobody would read it."""
        submitted = asyncio.ensure_future(asyncio.to_thread(engine.submit, prompt_ids, params, salt=salt,
                                                            max_waiting=max_waiting))
        try:
            handle = await asyncio.shield(submitted)  # the thread's submit cannot be stopped, only answered
        except asyncio.CancelledError:
            submitted.add_done_callback(_cancel_submitted)
            raise
        return cls(engine, tokenizer, prompt_ids, params, handle)

    def close(self) -> None:
        """Cancels the request unless it is done (its reader stopped early or went away); it leaves the engine at the
        next step boundary."""
        if not self.handle.done:
            self.handle.cancel()

    async def pieces(self):
        """One :class:`Piece` per generated token, as the engine chooses it; raises the step's error if it failed."""
        index = 0
        try:
            async for token in self.handle:
                self.completion_tokens += 1
                text = ""
                if token not in self._silent and not self._stops.stopped:
                    text, _ = self._stops.feed(self._text.push(token))
                yield Piece(text, token, self.handle.logprobs_of(index))  # one entry, not a copy of all per token
                index += 1
        finally:
            self.close()  # the client went away, or the reader stopped early

    def tail(self) -> str:
        """Text still held at the end (an incomplete character, as the tokenizer decodes it; a tail that never became
        a stop string)."""
        if self._stops.stopped:
            return ""
        text, _ = self._stops.feed(self._text.finish())
        return text + self._stops.flush()

    @property
    def finish_reason(self) -> str:
        """OpenAI's reason: "stop" (end of sequence, a stop id or string) or "length" (max_tokens); "abort" when the
        server cancelled it (shutting down)."""
        if self._stops.stopped or self.handle.finish_reason == "stop":
            return "stop"
        return "abort" if self.handle.finish_reason == "cancelled" else "length"

    def token_text(self, token: int) -> str:
        """One token's own text as it reads in the reply (for logprobs): see :func:`~..tokenizer.token_text`."""
        return token_text(self.tokenizer, token)

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes (for chat logprobs): a token holding part of a character has its part."""
        return token_bytes(self.tokenizer, token)


def _cancel_submitted(submitted: asyncio.Future) -> None:
    """Cancels the request a submit queued after its caller was cancelled (a refused submit queued none)."""
    if not submitted.cancelled() and submitted.exception() is None:
        submitted.result().cancel()
