"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions`` (OpenAI's fields plus vLLM's ``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids`` and ``cache_salt``), validated strictly (a
string where a number belongs is refused, not converted), and their mapping to :class:`SamplingParams`.

Fields a client may send that this server cannot honour (``n`` > 1, ``echo``, ``logit_bias``, tools and functions,
response formats, ``suffix``, ``best_of`` > 1) are refused by name; fields it does not know are ignored, as OpenAI's own
API and other compatible servers do."""

from __future__ import annotations

from typing import Annotated, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..sampling import SamplingParams
from .errors import bad_request

MAX_LOGPROBS = 20  # OpenAI's limit on top logprobs
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings are matched on every token: bounded
MAX_STOP_TOKEN_IDS = 1024  # looked up on every token (in a set), but a list a client sends is bounded all the same
SEED_RANGE = (-2**63, 2**63 - 1)  # OpenAI's and vLLM's seed: a signed 64-bit integer
# OpenAI's stream options; include_obfuscation (random padding against length side channels) is optional for a
# server to honour: none is added, whatever it says.
STREAM_OPTIONS = {"include_usage", "include_obfuscation"}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: Optional[dict] = None
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict] = None
    user: Optional[str] = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: Optional[Annotated[List[int], Field(max_length=MAX_STOP_TOKEN_IDS)]] = None
    cache_salt: Optional[str] = None

    def unsupported(self) -> dict:
        """Fields set to something this server cannot do: {field: why}."""
        out = {}
        if self.n != 1:
            out["n"] = "only n = 1 is supported"
        if self.logit_bias:
            out["logit_bias"] = "logit_bias is not supported"
        if self.stream_options is not None:
            if not self.stream:
                out["stream_options"] = "stream_options needs stream: true"
            elif set(self.stream_options) - STREAM_OPTIONS or \
                    not all(isinstance(v, bool) for v in self.stream_options.values()):
                out["stream_options"] = "stream_options takes include_usage and include_obfuscation: true or false"
        return out

    def include_usage(self) -> bool:
        """``stream_options.include_usage``: a last chunk carrying the token counts."""
        return (self.stream_options or {}).get("include_usage") is True

    def sampling(self, max_tokens: int, logprobs) -> SamplingParams:
        """The request's :class:`SamplingParams` (``max_tokens`` settled by the caller); an out-of-range value is a
        400 naming the field."""
        if not 0.0 <= self.temperature <= 2.0:
            raise bad_request(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        top_k = 0 if self.top_k == -1 else self.top_k  # vLLM's "off"
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise bad_request(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters", "stop")
        seed = None if self.seed is None else self.seed % 2**64  # the generator's seed: the same bits, unsigned
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=top_k,
                                  min_p=self.min_p, seed=seed, stop_token_ids=tuple(self.stop_token_ids or ()),
                                  stop=tuple(stop), presence_penalty=self.presence_penalty,
                                  frequency_penalty=self.frequency_penalty,
                                  repetition_penalty=self.repetition_penalty, logprobs=logprobs,
                                  ignore_eos=self.ignore_eos)
        except (TypeError, ValueError) as error:
            raise bad_request(str(error), str(error).split(" ", 1)[0].split("[", 1)[0]) from None


class CompletionRequest(_Request):
    """``POST /v1/completions``: one prompt, text or token ids (or a list holding one of either)."""

    prompt: Union[str, List[int], List[str], List[List[int]]]
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def unsupported(self) -> dict:
        out = super().unsupported()
        if self.echo:
            out["echo"] = "echo is not supported"
        if self.suffix:
            out["suffix"] = "suffix is not supported"
        if self.best_of not in (None, 1):
            out["best_of"] = "only best_of = 1 is supported"
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)) \
                and len(self.prompt) != 1:
            out["prompt"] = "one prompt per request"
        return out

    def the_prompt(self):
        """The prompt: a string (``""`` too: it may encode to a beginning-of-sequence token), or a list of token ids
        (not empty)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return prompt

    def top_logprobs(self):
        """How many top tokens to report per token (``logprobs``), or None."""
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, List[TextPart]]

    def as_template_input(self) -> dict:
        """The message as a chat template reads it (text parts joined)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatRequest(_Request):
    """``POST /v1/chat/completions``: messages rendered by the checkpoint's chat template."""

    messages: List[Message]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    functions: Optional[list] = None  # the older form of tools, which the openai client still sends
    function_call: Optional[Union[str, dict]] = None
    response_format: Optional[dict] = None

    def unsupported(self) -> dict:
        out = super().unsupported()
        if self.tools:
            out["tools"] = "tools are not supported"
        if self.tool_choice not in (None, "none", "auto"):
            out["tool_choice"] = "tool_choice is not supported"
        if self.functions:
            out["functions"] = "functions are not supported"
        if self.function_call not in (None, "none", "auto"):
            out["function_call"] = "function_call is not supported"
        if self.response_format and self.response_format.get("type") != "text":
            out["response_format"] = "only the text response format is supported"
        if not self.messages:
            out["messages"] = "messages must not be empty"
        return out

    def requested_max_tokens(self) -> tuple:
        """(the completion's token limit, the field that set it): ``max_completion_tokens`` over ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def top_logprobs_count(self):
        """How many top tokens to report per token, or None (``logprobs`` false)."""
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}", "top_logprobs")
        if not self.logprobs:
            if self.top_logprobs:
                raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return self.top_logprobs or 0


def _union_tag(part: str) -> bool:
    """pydantic's name of a union's member in an error's location ('str', 'list[int]'), not a field."""
    return part in ("str", "int", "float", "bool", "dict") or part.startswith(("list[", "List[", "Literal[", "dict["))


def parse(model: type, body) -> _Request:
    """``body`` (decoded JSON) as ``model`` (an optional field given as null: its default); a 400 naming the first
    offending field otherwise, or the first field this server cannot honour."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    # An optional field sent as null takes its default, as OpenAI's API reads it (the openai client sends null for
    # a None argument); a required one sent as null is still refused.
    body = {k: v for k, v in body.items() if v is not None or k not in model.model_fields
            or model.model_fields[k].is_required()}
    try:
        request = model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        loc = [str(part) for part in first["loc"] if not _union_tag(str(part))]
        param = ".".join(loc) or None
        raise bad_request(f"{param or 'body'}: {first['msg']}" + (f" ({len(error.errors())} problems)"
                                                                  if len(error.errors()) > 1 else ""), param) from None
    for field, why in request.unsupported().items():
        raise bad_request(why, field)
    return request
