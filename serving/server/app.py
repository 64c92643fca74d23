"""The OpenAI-compatible HTTP API over one :class:`~kvcache_op.serving.Engine` (FastAPI): ``POST /v1/completions``,
``POST /v1/chat/completions`` (``"stream": true`` as server-sent events ending with ``[DONE]``), ``GET /v1/models``,
``GET /health`` and ``GET /metrics``.

Every refusal is an OpenAI-style JSON error with a 4xx status (5xx only for the server's own failures), decided
before a stream starts: malformed JSON, a wrong type or range, an unknown model, a prompt or ``max_tokens`` over the
limits, a request that can never fit the cache (400); a missing or wrong API key on ``/v1`` routes (401); a body over
the size limit (413); a full queue (503, with ``Retry-After``). A client that disconnects cancels its request; one
that leaves before its body arrived is counted as 499 (nginx's "client closed request"), not as the server's error."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..online import EngineBusy
from ..tokenizer import PlainText, chat_prompt_ids, text_prompt_ids
from .errors import APIError, bad_request
from .generation import Generation
from .metrics import MetricsUnavailable, ServerMetrics
from .protocol import ChatRequest, CompletionRequest, parse
from .responses import Reply, sse

log = logging.getLogger("kvcache_op.server")
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
OPEN_ROUTES = ("/health", "/metrics")  # everything else needs the API key when there is one (docs included)
CLIENT_CLOSED = 499  # the status counted for a request whose client left before sending it whole (nginx's)
DISCONNECT_POLL_S = 0.05  # how often a non-streamed request checks that its client is still there


class GenerationStream(StreamingResponse):
    """A streamed reply that ends its generation however the response ends: also when the call is cancelled before
    the body starts (while the headers are sent: a proxy such as Ray Serve's cancels the call when its client goes
    away), where the body's own ``finally`` never runs. A client gone mid-stream is no error (nothing is logged)."""

    def __init__(self, generation: Generation, content, **kwargs):
        super().__init__(content, **kwargs)
        self.generation = generation

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # an ASGI 2.4 server's send failed: the client left mid-stream, no server error
            pass
        finally:
            self.generation.close()


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one request may ask: ``max_body_bytes`` of JSON, ``max_prompt_tokens`` of prompt (None: the engine's
    context), ``max_tokens`` up to ``max_tokens_limit``; ``max_queue`` requests waiting for admission beyond the
    engine's free running slots before new ones are refused with 503 (0: none waits, a request is refused unless a
    running slot is free)."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = None
    max_tokens_limit: int = 4096
    max_queue: int = 256


def _route_path(scope) -> str:
    """The path routing sees: without the ``root_path`` a proxy or Ray Serve's route prefix puts in front."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


class _Gate:
    """ASGI middleware (plain, so a handler still sees its client disconnect): the API key on ``/v1`` routes and the
    count of answers by route and status."""

    def __init__(self, app, *, expected, metrics, reject):
        self.app, self.expected, self.metrics, self.reject = app, expected, metrics, reject
        self.engine_id = str(os.getpid()).encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = _route_path(scope)
        route = path if path in ROUTES else "/v1/models" if path.startswith("/v1/models/") else "other"
        status = [500]

        async def send_noting_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                # Which engine answered (refusals included): replicas (Ray Serve) are told apart by their process.
                headers = [*message.get("headers", []), (b"x-kvcache-op-engine", self.engine_id)]
                message = {**message, "headers": headers}
            await send(message)
        if self.expected is not None and path not in OPEN_ROUTES:
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.expected):
                self.metrics.observe_request(route, 401)
                refusal = self.reject(APIError(401, "a valid API key is required: Authorization: Bearer <key>",
                                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
                return await refusal(scope, receive, send_noting_status)  # counted here: the try below is not run
        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            self.metrics.observe_request(route, status[0])


def _encodable(text: str) -> bool:
    """Whether ``text`` is Unicode text a tokenizer can take: JSON's escapes can carry lone surrogates, which no UTF-8
    encoding holds."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def create_app(engine, tokenizer, *, model_name: str, api_key: str = None, limits: ServerLimits = None,
               metrics: ServerMetrics = None) -> FastAPI:
    """The app serving ``engine`` as ``model_name``; ``engine`` must be made with ``tokenizer=PlainText(tokenizer)``
    (``ValueError`` otherwise), so that it ends a request at a stop string in the same text the reply holds, which
    leaves special tokens out. With ``api_key``, every route but ``/health`` and ``/metrics`` needs
    ``Authorization: Bearer <api_key>`` (compared in constant time). The engine is closed when the app shuts down.
    A tokenizer with more tokens than the model's vocabulary is refused (``ValueError``). ``metrics``: what
    ``/metrics`` answers and the requests are counted in (default: a :class:`ServerMetrics` of ``engine``'s own; a
    replica's also answers the other replicas')."""
    if not (isinstance(engine.tokenizer, PlainText) and engine.tokenizer.tokenizer is tokenizer):
        raise ValueError("the engine must find stop strings in the reply's text: make it with "
                         "Engine(..., tokenizer=PlainText(tokenizer)) for the tokenizer the app is given")
    if len(tokenizer) > engine.info.vocab_size:  # another model's tokenizer: its ids would index past the embedding
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than the model's vocabulary of "
                         f"{engine.info.vocab_size}: it is not this model's")
    limits = limits or ServerLimits()
    context = engine.usable_context  # what /v1/models reports as max_model_len
    max_prompt = min(limits.max_prompt_tokens or context, context)
    metrics = metrics or ServerMetrics(engine)
    expected = api_key.encode() if api_key else None

    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.close, 10.0)

    app = FastAPI(title="kvcache-op", lifespan=lifespan)

    def error_response(error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def _api_error(request, error):
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, error):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_response(APIError(error.status_code, str(error.detail), type=kind))

    @app.exception_handler(Exception)
    async def _internal(request, error):
        log.exception("request failed")
        return error_response(APIError(500, f"internal error: {type(error).__name__}", type="server_error"))

    app.add_middleware(_Gate, expected=expected, metrics=metrics, reject=error_response)

    async def read_json(request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise APIError(413, f"the body is {declared} bytes, over the limit of {limits.max_body_bytes}")
        body = bytearray()
        try:
            async for part in request.stream():
                body += part
                if len(body) > limits.max_body_bytes:
                    raise APIError(413, f"the body is over the limit of {limits.max_body_bytes} bytes")
        except ClientDisconnect:  # the client's own doing, not the server's failure: no 5xx, no error logged
            raise APIError(CLIENT_CLOSED, "the client closed the connection before its request's body arrived") \
                from None
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as error:
            raise bad_request(f"the body is not valid JSON: {str(error)[:200]}") from None

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")

    def settle_max_tokens(requested, prompt_len: int, default, field: str, prompt_field: str) -> int:
        if prompt_len > max_prompt:
            raise bad_request(f"the prompt has {prompt_len} tokens, over the limit of {max_prompt}", prompt_field,
                              "context_length_exceeded")
        room = context - prompt_len
        if requested is None:
            requested = min(default if default is not None else room, room, limits.max_tokens_limit)
            if requested < 1:
                raise bad_request(f"the prompt's {prompt_len} tokens leave no room in the context of {context}",
                                  prompt_field, "context_length_exceeded")
        if requested < 1 or requested > limits.max_tokens_limit:
            raise bad_request(f"{field} must be in [1, {limits.max_tokens_limit}], got {requested}", field)
        if prompt_len + requested > context:
            raise bad_request(f"{prompt_len} prompt tokens + {field}={requested} exceed the context of {context}",
                              field, "context_length_exceeded")
        return requested

    def busy(waiting: int) -> APIError:
        """``waiting``: the requests that would wait for a running slot with this one."""
        return APIError(503, f"the server is busy: with this request {waiting} would wait for a running slot, more "
                             f"than the limit of {limits.max_queue}; retry later", type="server_overloaded",
                        headers={"Retry-After": "1"})

    async def start(req, prompt_ids: list, max_tokens, default_max, logprobs,
                    max_tokens_field: str = "max_tokens", prompt_field: str = "prompt") -> Generation:
        if engine.backlog(adding=1) > limits.max_queue:  # early, before any work; submit holds the limit exactly
            raise busy(engine.backlog(adding=1))
        if not prompt_ids:
            raise bad_request("the prompt encodes to no tokens", prompt_field)
        vocab = engine.info.vocab_size
        if any(not 0 <= t < vocab for t in req.stop_token_ids or ()):
            raise bad_request(f"stop_token_ids must be token ids in [0, {vocab})", "stop_token_ids")
        params = req.sampling(settle_max_tokens(max_tokens, len(prompt_ids), default_max, max_tokens_field,
                                                prompt_field), logprobs)
        try:  # the engine checks the prompt and the salt; what it refuses is the client's error
            return await Generation.start(engine, tokenizer, prompt_ids, params, req.cache_salt, limits.max_queue)
        except (TypeError, ValueError) as error:
            text = str(error)  # the prompt's ids, the salt, or the pages the prompt and max_tokens need together
            param = "cache_salt" if text.startswith("salt") else prompt_field if text.startswith("the prompt") else None
            raise bad_request(text, param) from None
        except EngineBusy as error:
            raise busy(error.waiting + 1) from None
        except RuntimeError as error:  # the engine is closed: shutting down
            raise APIError(503, str(error), type="server_overloaded", headers={"Retry-After": "1"}) from None

    async def respond(request: Request, req, generation: Generation, chat: bool):
        reply = Reply(generation, model_name, chat)
        metrics.observe_when_finished(generation.handle, len(generation.prompt_ids))
        if req.stream:
            return GenerationStream(generation, stream(reply, req.include_usage()), media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(cancel_on_disconnect(request, generation))
        pieces, text = [], []
        try:
            async for piece in generation.pieces():
                pieces.append(piece)
                text.append(piece.text)
        except Exception as error:
            raise APIError(500, f"generation failed: {error}", type="server_error") from None
        finally:
            watcher.cancel()
        text.append(generation.tail())
        return JSONResponse(reply.body("".join(text), pieces))

    async def stream(reply: Reply, include_usage: bool):
        g = reply.generation

        def event(chunk: dict) -> bytes:
            if include_usage:  # OpenAI: every chunk before the last carries "usage": null
                chunk["usage"] = None
            return sse(chunk)

        try:
            if reply.chat:
                yield event(reply.chunk(role=True))
            async for piece in g.pieces():
                if piece.text or piece.logprobs is not None:
                    yield event(reply.chunk(piece.text, [piece] if piece.logprobs is not None else ()))
            tail = g.tail()
            if tail:
                yield event(reply.chunk(tail))
            yield event(reply.chunk(None if reply.chat else "", finish_reason=g.finish_reason))
            if include_usage:
                yield sse(reply.usage_chunk())
        except Exception as error:  # the step failed: say so in the stream, then end it
            yield sse(APIError(500, f"generation failed: {error}", type="server_error").body())
        yield sse("[DONE]")

    async def cancel_on_disconnect(request: Request, generation: Generation):
        while not generation.handle.done:
            if await request.is_disconnected():
                generation.handle.cancel()
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await read_json(request))
        check_model(req.model)
        prompt = req.the_prompt()
        if isinstance(prompt, str):
            if not _encodable(prompt):  # the tokenizer's own word for it names its internals
                raise bad_request("the prompt is not valid Unicode text (it holds a lone surrogate)", "prompt")
            # Tokenized whole, then counted: characters bound no token count (a token may hold any number of them);
            # the body limit bounds the work.
            try:
                ids = await asyncio.to_thread(text_prompt_ids, tokenizer, prompt)  # off the event loop
            except Exception as error:  # e.g. a lone surrogate the tokenizer cannot encode
                raise bad_request(f"the prompt cannot be tokenized: {error}", "prompt") from None
        else:
            ids = list(prompt)
        generation = await start(req, ids, req.max_tokens, 16, req.top_logprobs())
        return await respond(request, req, generation, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatRequest, await read_json(request))
        check_model(req.model)
        messages = [m.as_template_input() for m in req.messages]
        unencodable = next((i for i, m in enumerate(messages) if not _encodable(m["content"])), None)
        if unencodable is not None:
            raise bad_request(f"message {unencodable} is not valid Unicode text (it holds a lone surrogate)",
                              f"messages.{unencodable}.content")
        try:
            ids = await asyncio.to_thread(chat_prompt_ids, tokenizer, messages)
        except ValueError as error:
            raise bad_request(str(error), "messages") from None
        except Exception as error:  # the template itself refused the conversation (e.g. roles out of order)
            raise bad_request(f"the chat template cannot render these messages: {error}", "messages") from None
        max_tokens, field = req.requested_max_tokens()
        generation = await start(req, ids, max_tokens, None, req.top_logprobs_count(), field, "messages")
        return await respond(request, req, generation, chat=True)

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "kvcache-op", "max_model_len": context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return card

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        try:
            text = await metrics.answer()
        except MetricsUnavailable as error:
            raise APIError(503, str(error), type="server_error") from None
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
