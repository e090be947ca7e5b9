"""The Starlette app: ``/v1/completions``, ``/v1/chat/completions``, ``/health``, ``/metrics``, and ``/v1/models``,
``/tokenize``, ``/detokenize``, ``/version`` (``info``).

It runs in the engine's own trio run (hypercorn's trio worker), so handlers call the engine directly. One OpenAI
request of ``p`` prompts and ``n`` choices is ``p`` engine requests (ids ``<response id>-<prompt index>``), each with
``SamplingParams.n``: the engine makes the choices (logged as ``<id>/<j>``, seeded ``seed + j`` when the request has
a seed) and tags their frames with ``index``; choice ``j`` of prompt ``k`` is OpenAI's choice ``k * n + j``. All are
checked before any is submitted. A client that disconnects cancels every request it opened (they finish
``cancelled`` in the log). Prompts are tokenized here, once, exactly as the engine would (``scoring.engine_prompts``),
and submitted as token ids: so ``max_tokens`` is checked against the prompt's length, and ``echo`` knows its tokens.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tickloom import EngineError, EngineOverloaded, RequestOutput, RequestRejected
from tickloom.prompts import Prompt
from tickloom.request import Request as EngineRequest
from tickloom.tools.serve import fields, scoring, tool_calls, translate
from tickloom.tools.serve.backend import ServedEngine, ServedStream
from tickloom.tools.serve.chunks import ChunkWriter
from tickloom.tools.serve.ending import OpenRequests
from tickloom.tools.serve.guard import BodyAbandoned, BodyLimits, read_body, route_label
from tickloom.tools.serve.info import TOKENIZE_ROUTES, info_routes
from tickloom.tools.serve.metrics import Metrics
from tickloom.tools.serve.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    decode_request,
)
from tickloom.tools.serve.sse import (
    DEFAULT_MAX_PENDING_BYTES,
    DONE,
    EventSink,
    SlowClient,
    SSEResponse,
    event,
    watch_disconnect,
)
from tickloom.tools.serve.translate import Choice, OpenAIRequest

log = logging.getLogger("tickloom.serve")

T = TypeVar("T")

MAX_CHOICES = 1024
"""Engine requests one HTTP request may open (prompts x n)."""

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for ``/v1/completions``; chat defaults to what ``max_seq_len`` leaves."""

DEFAULT_MAX_ANSWER_ENTRIES = 1_000_000
"""What a whole (not streamed) answer may hold: choices x tokens x (1 + logprobs listed per token)."""

ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
                    *TOKENIZE_ROUTES})


@dataclass
class ServerState:
    engine: ServedEngine
    """An ``Engine``, or a ``fleet_backend.FleetBackend``."""
    model_name: str
    request_timeout: float | None = None
    body: BodyLimits = field(default_factory=BodyLimits)
    max_stream_buffer_bytes: int = DEFAULT_MAX_PENDING_BYTES
    """Bytes of events a streamed request may have waiting for its client (``--max-stream-buffer-bytes``)."""
    max_answer_entries: int = DEFAULT_MAX_ANSWER_ENTRIES
    metrics: Metrics = field(init=False)
    draining: bool = False
    failure: str | None = None
    """Why the server no longer serves (the engine failed): ``/health`` says it, new requests get it as a 503."""
    requests: OpenRequests = field(default_factory=OpenRequests)
    created: int = field(default_factory=lambda: int(time.time()))
    """When the server started (``/v1/models``' ``created``)."""
    _token_text: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.engine.stats, self.model_name)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.engine.tokenizer.decode([token_id], False)
        return text


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, media_type="application/json")


def error_response(err: OpenAIError) -> Response:
    return Response(err.body(), status_code=err.status, media_type="application/json")


async def run_until_disconnect(receive: Receive, fn: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run ``fn``; cancel it if the client disconnects. Returns (disconnected, result). ``fn``'s exception is
    raised as itself (not in an exception group)."""
    result: list[T] = []
    failure: list[Exception] = []
    gone = [False]
    async with trio.open_nursery() as nursery:

        def disconnected() -> None:
            gone[0] = True
            nursery.cancel_scope.cancel()

        async def body() -> None:
            try:
                result.append(await fn())
            except Exception as exc:  # re-raised below, outside the nursery's exception group
                failure.append(exc)
            finally:
                nursery.cancel_scope.cancel()

        nursery.start_soon(watch_disconnect, receive, disconnected)
        nursery.start_soon(body)
    if failure:
        raise failure[0]
    return gone[0], result[0] if result else None


class Group:
    """The engine requests of one OpenAI request, one per prompt with ``n`` choices each: started together,
    cancelled together if unfinished."""

    def __init__(self, streams: Sequence[ServedStream], n: int, metrics: Metrics, *, keep: bool = True) -> None:
        self.streams = list(streams)
        self.keep = keep
        """Keep every frame's content in ``choices`` (a whole answer); a stream keeps only finishes and usage."""
        self.n = n
        self.metrics = metrics
        self.started = 0
        self.choices = [Choice(i) for i in range(len(streams) * n)]
        self.errors: list[EngineError] = []

    async def start(self) -> None:
        try:
            for s in self.streams:
                await s.start()
                self.started += 1
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.aclose()
            raise

    async def aclose(self) -> None:
        """Cancel what is unfinished (counted as ``cancelled``: its final frame is never read)."""
        for k, s in enumerate(self.streams[: self.started]):
            await s.aclose()
            for choice in self.choices[k * self.n : (k + 1) * self.n]:
                if choice.finish_reason is None:
                    choice.finish_reason = "cancelled"
                    self.metrics.observe_finish("cancelled", None)

    async def pump(self, on_frame: Callable[[int, RequestOutput], Awaitable[None]] | None) -> None:
        """Feed every frame into its ``Choice`` (``k * n + index`` for stream ``k``; and to ``on_frame``, one at a time,
        in arrival order).

        An ``EngineError`` from a stream is kept in ``errors`` (each stream raises the same crash)."""
        send, receive = trio.open_memory_channel[tuple[int, RequestOutput]](0)

        async def one(k: int, stream: ServedStream, ch: trio.MemorySendChannel[tuple[int, RequestOutput]]) -> None:
            async with ch:
                try:
                    async for out in stream:
                        await ch.send((k * self.n + out.index, out))
                except EngineError as exc:
                    self.errors.append(exc)

        failure: list[Exception] = []
        async with trio.open_nursery() as nursery:
            async with send:
                for i, s in enumerate(self.streams):
                    nursery.start_soon(one, i, s, send.clone())
            async with receive:
                async for i, out in receive:
                    self.choices[i].add(out, keep=self.keep)
                    if out.finished:
                        self.metrics.observe_finish(out.finish_reason, out.usage)
                    if on_frame is not None:
                        try:
                            await on_frame(i, out)
                        except Exception as exc:  # e.g. SlowClient: re-raised below as itself, not in a group
                            failure.append(exc)
                            nursery.cancel_scope.cancel()
                            break
        if failure:
            raise failure[0]


def build_app(state: ServerState) -> Starlette:
    engine = state.engine

    async def health(request: Request) -> Response:
        if state.failure is not None:
            return json_response({"status": "failed", "reason": state.failure}, 503)
        if state.draining:
            return json_response({"status": "draining"}, 503)
        return json_response({"status": "ok"})

    async def metrics(request: Request) -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def generate(request: Request, *, chat: bool) -> Response:
        started = time.monotonic()
        endpoint = request.url.path
        try:
            body = await read_body(request, state.body)
        except BodyAbandoned:
            state.metrics.disconnects.inc()
            return Response(status_code=499)
        req: OpenAIRequest = decode_request(body, fields.CHAT_WIRE if chat else fields.COMPLETION_WIRE)
        del body
        if req.model != state.model_name:
            raise OpenAIError(404, f"the model {req.model!r} does not exist; this server has {state.model_name!r}",
                              param="model", code="model_not_found")
        translate.check_supported(req)
        if state.failure is not None:
            raise OpenAIError(503, f"the server is not serving: {state.failure}", type="server_error",
                              code="engine_failed")
        if state.requests.reason is not None:
            raise state.requests.error()
        if state.draining:
            raise OpenAIError(503, "the server is draining: no new requests", type="server_error",
                              code="engine_overloaded")
        prompts: list[Prompt]
        if isinstance(req, ChatCompletionRequest):
            prompts = [translate.chat_messages(req)]
            default_max = engine.max_seq_len
        else:
            prompts = list(req.prompts())
            default_max = COMPLETION_DEFAULT_MAX_TOKENS
        if len(prompts) * req.n > MAX_CHOICES:
            raise OpenAIError(400, f"{len(prompts)} prompts x n={req.n} is more than {MAX_CHOICES} choices",
                              param="n")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{req.request_id or uuid.uuid4().hex}"
        deadline = req.timeout if req.timeout is not None else state.request_timeout
        max_seq_len = engine.max_seq_len
        try:
            params = translate.sampling_params(req, default_max, max_seq_len)
            echo = isinstance(req, CompletionRequest) and req.echo
            tools = translate.chat_tools(req) if isinstance(req, ChatCompletionRequest) else None
            tokenized = scoring.engine_prompts(engine.tokenizer, prompts, req, max_seq_len, with_text=echo,
                                               tools=tools)
            longest = max(len(p.ids) for p in tokenized)
            translate.check_room(req, longest, max_seq_len)
            if not req.stream:
                with_prompt = echo or req.prompt_logprobs is not None
                check_answer_size(req, len(prompts) * req.n, default_max, state.max_answer_entries,
                                  longest if with_prompt else 0)
            streams = [engine.generate_request(EngineRequest(prompt=p.ids, params=params, deadline=deadline,
                                                             request_id=f"{rid}-{k}", priority=req.priority,
                                                             cache_salt=req.cache_salt or ""))
                       for k, p in enumerate(tokenized)]
        except RequestRejected as exc:
            raise translate.rejected(exc, req) from None
        group = Group(streams, req.n, state.metrics, keep=not req.stream)
        created = int(time.time())
        tool_plan = tool_calls.plan(req) if isinstance(req, ChatCompletionRequest) else None
        writer = ChunkWriter(req, rid, created, state.model_name, state.token_text, tokenized if echo else (),
                             sum(len(p.ids) for p in tokenized), tool_plan)
        try:
            gone, _ = await run_until_disconnect(request.receive, group.start)
        except RequestRejected as exc:
            raise translate.rejected(exc, req) from None
        except (EngineOverloaded, EngineError) as exc:
            raise translate.engine_error(exc) from None
        if gone:
            state.metrics.disconnects.inc()
            return Response(status_code=499)
        if req.stream:
            async def end_stream(sink: EventSink, why: OpenAIError) -> None:
                """Cancel what is unfinished; the stream's last events say ``why``."""
                with trio.CancelScope(shield=True):
                    await group.aclose()
                sink.write_nowait(event(why.body_struct()), last=True)
                sink.write_nowait(DONE, last=True)

            async def produce(sink: EventSink) -> None:
                with state.requests.track() as tracked:
                    try:
                        await writer.start(sink, len(group.choices))
                        with tracked.waiting:
                            await group.pump(lambda i, out: writer.frame(sink, group.choices[i], out))
                    except SlowClient as exc:
                        state.metrics.slow_clients.inc()
                        await end_stream(sink, OpenAIError(429, str(exc), type="server_error",
                                                           code="stream_buffer_full"))
                        raise
                    ended = tracked.ended
                    if ended is not None:
                        await end_stream(sink, ended)
                        return
                    await writer.end(sink, group.choices, group.n, group.errors)

            async def cleanup() -> None:
                await group.aclose()
                state.metrics.duration.labels(endpoint).observe(time.monotonic() - started)

            return SSEResponse(produce, state.metrics.disconnects.inc, cleanup,
                               max_pending_bytes=state.max_stream_buffer_bytes)
        with state.requests.track() as tracked:
            try:
                with tracked.waiting:
                    gone, _ = await run_until_disconnect(request.receive, lambda: group.pump(None))
            finally:
                with trio.CancelScope(shield=True):
                    await group.aclose()
            ended = tracked.ended
        if ended is not None:
            raise ended
        state.metrics.duration.labels(endpoint).observe(time.monotonic() - started)
        if gone:
            state.metrics.disconnects.inc()
            return Response(status_code=499)
        if group.errors:
            raise translate.engine_error(group.errors[0])
        failed = next((c for c in group.choices if c.finish_reason == "error"), None)
        if failed is not None:
            raise OpenAIError(500, f"choice {failed.index} failed: {failed.error}", type="server_error",
                              code="request_failed")
        return json_response(writer.whole(group.choices, group.n))

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *info_routes(engine, state.model_name, state.created, state.body, json_response),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]

    async def openai_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(OpenAIError(exc.status_code, str(exc.detail), type=kind))

    async def internal_error(request: Request, exc: Exception) -> Response:
        # Starlette re-raises the exception after this response, so it is still logged with its traceback.
        return error_response(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    app = Starlette(routes=routes, exception_handlers={OpenAIError: openai_error, HTTPException: http_error,
                                                      Exception: internal_error})
    return app


def check_answer_size(req: OpenAIRequest, choices: int, default_max: int, limit: int, prompt_tokens: int = 0) -> None:
    """Refuse a whole answer larger than ``limit`` entries (choices x tokens x (1 + logprobs listed per token)):
    the server holds all of it until the last token. A stream sends it as it comes. ``prompt_tokens``: the longest
    prompt's tokens, with ``echo`` or ``prompt_logprobs`` (the answer lists them too)."""
    tokens = (req.max_tokens or default_max) + prompt_tokens
    chat_listed = (req.top_logprobs or 0) if isinstance(req, ChatCompletionRequest) and req.logprobs else None
    listed = req.logprobs if isinstance(req, CompletionRequest) else chat_listed
    per_token = 1 if listed is None else 2 + listed  # the token; with logprobs, its own and `listed` others
    if req.prompt_logprobs is not None:
        per_token = max(per_token, 2 + req.prompt_logprobs)
    entries = choices * tokens * per_token
    if entries > limit:
        raise OpenAIError(400, f"a whole answer of {choices} choices x {tokens} tokens x {per_token} entries per "
                               f"token is more than this server holds for one request ({limit} entries, "
                               "--max-answer-entries): ask with stream=true, or for fewer", param="max_tokens",
                          code="answer_too_large")


def with_status_counts(app: ASGIApp, metrics: Metrics) -> ASGIApp:
    """Count HTTP responses by route (every path that is no route counts as one, ``unmatched``) and status."""

    async def counted(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                metrics.http_requests.labels(route_label(scope["path"], ROUTES), str(message["status"])).inc()
            await send(message)

        await app(scope, receive, send_counting)

    return counted
