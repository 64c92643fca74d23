"""One request as the engine tracks it between steps."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Sequence:
    index: object  # the manager's request id: ("request", n), unique for the engine's life
    prompt: list
    max_new_tokens: int
    salt: object
    arrival: int  # first step at which it may join
    generated: list = dataclasses.field(default_factory=list)
    next_input: list = None  # the token to feed next when decoding (the last generated one)
    params: object = None  # its SamplingParams
    generator: object = None  # the request's own numpy Generator: its draws do not depend on the batch
    logprobs: list = dataclasses.field(default_factory=list)
    admissions: int = 0
    ran: bool = False  # ran at least one step since its last admission
    handle: object = None  # the RequestHandle its tokens stream to
    on_token: object = None  # generate(on_token=...): called with each token as it is chosen
    logits: list = None  # generate(record_logits=True): each chosen token's logits
    text_stream: object = None  # with stop strings: its TextStream and StopMatcher
    stop_matcher: object = None
    ends: frozenset = frozenset()  # the token ids that end it: its stop_token_ids and (unless ignore_eos) the eos ids

    @property
    def context(self) -> list:
        """What a (re-)admission feeds: the prompt and every token generated so far."""
        return self.prompt + self.generated
