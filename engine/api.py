"""``Engine``: the embedded engine. One trio nursery of actors around one ``SchedulerCore``.

    async with Engine.open(EngineConfig(log_path="run.tlog")) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32), deadline=5.0):
            print(out.text_delta, end="")
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any

import msgspec
import trio
from msgspec import Meta

from tickloom.actors.outputs import RequestOutput, RequestUsage
from tickloom.engine.config import EngineConfig
from tickloom.engine.errors import EngineError, EngineOverloaded, RequestRejected
from tickloom.engine.params import (
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    SamplingParams,
    TokenId,
    checked,
    encodable,
    unencodable,
)
from tickloom.engine.runtime import Runtime, build_runtime
from tickloom.events import RequestArrived, RequestCancelled

Prompt = str | list[int] | Sequence[dict[str, Any]]
"""Text, token ids (used as given: no BOS is added) or chat messages (rendered with the model's template)."""


class Engine:
    """Use ``Engine.open(config)``; the constructor only stores the configuration."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._rt: Runtime | None = None
        self._next_id = 0
        self._draining = False

    @classmethod
    @asynccontextmanager
    async def open(cls, config: EngineConfig | None = None) -> AsyncIterator[Engine]:
        """Start the engine's actors; leaving the block shuts down with an explicit error for what is left.

        If an actor crashes, every open stream raises ``EngineError`` naming it, and so does leaving this block.
        """
        engine = cls(config or EngineConfig())
        rt = await build_runtime(engine.config)
        engine._rt = rt
        try:
            async with rt.supervise() as nursery:
                try:
                    yield engine
                finally:
                    with trio.CancelScope(shield=True):
                        await rt.shutdown()
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if rt.fatal is not None:
                raise rt.fatal from group
            # The supervising nursery wraps whatever the caller's block raised; hand back their own exception.
            leaves = [e for e in _leaves(group) if not isinstance(e, trio.Cancelled)]
            if len(leaves) == 1:
                raise leaves[0] from None
            raise
        finally:
            rt.close()
        if rt.fatal is not None:
            raise rt.fatal

    @property
    def runtime(self) -> Runtime:
        if self._rt is None:
            raise EngineError("engine", "the engine is not open: use `async with Engine.open(config)`")
        return self._rt

    # -- requests --------------------------------------------------------------------------------------------
    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        deadline: float | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str = "",
    ) -> RequestStream:
        """Stream a completion. Bad input raises ``RequestRejected`` here, before any stream opens.

        ``deadline`` is seconds from submit. Leaving the ``async for`` early cancels the request; use
        ``async with engine.stream(...)`` for cleanup at a known point.
        """
        arrival, seconds = self._arrival(prompt, SamplingParams() if params is None else params, deadline,
                                         request_id, priority, cache_salt)
        return RequestStream(self, arrival, seconds)

    @asynccontextmanager
    async def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, deadline: float | None = None,
                     request_id: str | None = None, priority: int = 0,
                     cache_salt: str = "") -> AsyncIterator[RequestStream]:
        """Like ``generate``, but the request is cancelled (if unfinished) when the block exits."""
        stream = self.generate(prompt, params, deadline=deadline, request_id=request_id, priority=priority,
                               cache_salt=cache_salt)
        await stream.start()
        try:
            yield stream
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def complete(self, prompt: Prompt, params: SamplingParams | None = None, **kw: Any) -> RequestOutput:
        """Run a request to the end; one ``RequestOutput`` with every token id and the whole text."""
        tokens: list[int] = []
        text, reasoning = [], []
        logprobs: list[float] = []
        any_logprobs = False
        last: RequestOutput | None = None
        async with self.stream(prompt, params, **kw) as stream:
            async for out in stream:
                tokens += out.token_ids
                text.append(out.text_delta)
                reasoning.append(out.reasoning_delta)
                any_logprobs = any_logprobs or out.logprobs is not None
                logprobs += out.logprobs if out.logprobs is not None else [math.nan] * len(out.token_ids)
                last = out
        assert last is not None and last.finished
        return RequestOutput(request_id=last.request_id, token_ids=tokens, text_delta="".join(text),
                             reasoning_delta="".join(reasoning), finished=True, finish_reason=last.finish_reason,
                             usage=last.usage, error=last.error, logprobs=logprobs if any_logprobs else None)

    async def cancel(self, request_id: str) -> None:
        """Cancel a request: it finishes ``cancelled`` with the tokens delivered so far."""
        rid = _request_id(request_id, "request_id")
        await self.runtime.client.send(RequestCancelled(rid))

    async def drain(self, timeout: float = math.inf) -> bool:
        """Stop admitting and let running requests finish; True if all finished within ``timeout`` seconds."""
        seconds: float = checked(timeout, Annotated[float, Meta(ge=0.0)], "drain timeout")  # inf waits for all
        self._draining = True
        rt = self.runtime
        with trio.move_on_after(seconds):
            while rt.live:
                await rt.live_changed.wait()
            return True
        return False

    def stats(self) -> dict[str, Any]:
        """Queues, KV blocks (free, cached, total), ticks, tokens and tokens/s, preemptions, spill bytes."""
        return self.runtime.stats()

    # -- submission ------------------------------------------------------------------------------------------
    def _arrival(self, prompt: Prompt, params: SamplingParams, deadline: float | None, request_id: str | None,
                 priority: int, cache_salt: str) -> tuple[RequestArrived, float | None]:
        """The one validation boundary of a request: every argument is checked, or ``RequestRejected`` names it.

        Returns the arrival (without its ``deadline_ns``, which is measured at submit) and the deadline in seconds.
        """
        rt = self.runtime
        limits = rt.core_config
        args: _RequestArgs = checked({"deadline": deadline, "request_id": request_id, "priority": priority,
                        "cache_salt": cache_salt}, _RequestArgs, "request")
        encodable(args.cache_salt, "cache_salt")
        if args.request_id is not None:
            encodable(args.request_id, "request_id")
        if not isinstance(params, SamplingParams):
            raise RequestRejected(f"params must be SamplingParams, not {type(params).__name__}")
        params.validate()  # again: its lists are mutable, and a subclass may skip __post_init__
        bad_stop = next((t for t in params.stop_token_ids if t >= limits.vocab_size), None)
        if bad_stop is not None:
            raise RequestRejected(f"SamplingParams.stop_token_ids contains {bad_stop}, outside "
                                  f"vocab_size={limits.vocab_size}")
        ids = self._prompt_ids(prompt)
        if len(ids) >= limits.max_seq_len:
            raise RequestRejected(f"the prompt has {len(ids)} tokens; max_seq_len={limits.max_seq_len}")
        rid = args.request_id
        if rid is None:
            rid = f"req-{self._next_id}"
            self._next_id += 1
            while rid in rt.live:  # a caller's own id may look like ours
                rid = f"req-{self._next_id}"
                self._next_id += 1
        elif rid in rt.live:
            raise RequestRejected(f"request_id={rid!r} is already in use")
        arrival = RequestArrived(rid, ids, params.to_spec(), params.seed, args.priority, None, args.cache_salt)
        return arrival, args.deadline

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids: text is tokenized, chat messages rendered first, token ids checked."""
        rt = self.runtime
        limits = rt.core_config
        ids: list[int]
        if isinstance(prompt, str):
            encodable(prompt, "prompt")
            if len(prompt) > MAX_CHARS_PER_TOKEN * limits.max_seq_len:
                raise RequestRejected(f"the prompt has {len(prompt)} characters; it cannot fit "
                                      f"max_seq_len={limits.max_seq_len} tokens")
            ids = rt.tokenize(prompt)
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            messages = [_chat_message(i, m) for i, m in enumerate(prompt)]
            ids = rt.tokenize(messages)
        elif isinstance(prompt, (list, tuple)):
            if len(prompt) >= limits.max_seq_len:
                raise RequestRejected(f"the prompt has {len(prompt)} tokens; max_seq_len={limits.max_seq_len}")
            ids = checked(prompt, list[TokenId], "prompt")
            bad = next((i for i, t in enumerate(ids) if t >= limits.vocab_size), None)
            if bad is not None:
                raise RequestRejected(f"prompt token id {ids[bad]} at position {bad} is outside "
                                      f"vocab_size={limits.vocab_size}")
        else:
            raise RequestRejected("prompt must be a str, a list of token ids, or a list of chat messages, not "
                                  f"{type(prompt).__name__}")
        if not ids:
            raise RequestRejected("the prompt is empty")
        return ids

    async def _submit(self, arrival: RequestArrived, deadline: float | None) -> Any:
        rt = self.runtime
        if rt.fatal is not None:
            raise rt.fatal
        if self._draining or rt.closing:
            raise EngineOverloaded("the engine is draining or shutting down: no new requests")
        deadline_ns = None
        if deadline is not None:
            deadline_ns = rt.now_ns() + int(deadline * 1e9)
            if deadline_ns > INT64_MAX:
                raise RequestRejected(f"deadline={deadline!r} s from now is past what the log can hold")
        await rt.acquire_slot()
        if arrival.request_id in rt.live:
            rt.release_slot()
            raise RequestRejected(f"request_id={arrival.request_id!r} is already in use")
        if deadline is not None:
            # Measured again once a slot is free: the deadline runs from submit, not from the call.
            deadline_ns = min(rt.now_ns() + int(deadline * 1e9), INT64_MAX)
            arrival = RequestArrived(arrival.request_id, arrival.prompt_token_ids, arrival.params, arrival.seed,
                                     arrival.priority, deadline_ns, arrival.cache_salt)
        stream = rt.open_stream(arrival)
        try:
            await rt.client.send(arrival)
        except BaseException:
            # Not sent (a cancelled send sends nothing): the core never saw it, so free its stream, id and slot
            # here, without a ClientGone that could hit a later request reusing the id.
            rt.retire.abandon(arrival.request_id)
            rt.finished(arrival.request_id)
            raise
        return stream


MAX_CHARS_PER_TOKEN = 1024
"""A text prompt longer than this many characters per ``max_seq_len`` token is refused before tokenizing."""

MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024
MAX_DEADLINE_S = 1e9
"""About 31 years: ``deadline_ns`` (submit time plus the deadline) stays far inside int64."""


class _RequestArgs(msgspec.Struct, frozen=True, kw_only=True):
    """The keyword arguments of ``generate``, ``stream`` and ``complete``, with their bounds."""

    deadline: Annotated[float, Meta(gt=0.0, le=MAX_DEADLINE_S)] | None = None
    request_id: Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS)] | None = None
    priority: Annotated[int, Meta(ge=INT32_MIN, le=INT32_MAX)] = 0
    """Lower is more important, as in vLLM; an int32."""
    cache_salt: Annotated[str, Meta(max_length=MAX_CACHE_SALT_CHARS)] = ""


class _ChatMessage(msgspec.Struct, frozen=True):
    role: Annotated[str, Meta(min_length=1, max_length=256)]
    content: str


def _chat_message(index: int, message: dict[Any, Any]) -> dict[str, Any]:
    """One chat message, checked: a str ``role`` and ``content``; other keys (str) are passed to the template."""
    what = f"prompt[{index}]"
    for key in ("role", "content"):
        if key not in message:
            raise RequestRejected(f"{what} has no {key!r}: a chat message needs 'role' and 'content'")
    bad_key = next((k for k in message if not isinstance(k, str)), None)
    if bad_key is not None:
        raise RequestRejected(f"{what} has a non-str key {bad_key!r}")
    checked({"role": message["role"], "content": message["content"]}, _ChatMessage, what)
    bad = unencodable(message)
    if bad is not None:
        raise RequestRejected(f"{what}{bad} is not encodable as UTF-8 (a lone surrogate)")
    return dict(message)


def _request_id(request_id: object, what: str) -> str:
    rid: str = checked(request_id, Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS)], what)
    encodable(rid, what)
    return rid


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return found


class RequestStream:
    """An async iterator of ``RequestOutput`` frames for one request."""

    def __init__(self, engine: Engine, arrival: RequestArrived, deadline: float | None) -> None:
        self.request_id = arrival.request_id
        self._engine = engine
        self._arrival = arrival
        self._deadline = deadline
        self._inner: Any = None
        self._done = False

    async def start(self) -> None:
        if self._inner is None:
            self._inner = await self._engine._submit(self._arrival, self._deadline)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        await self.start()
        try:
            out: RequestOutput = await self._inner.__anext__()
        except StopAsyncIteration:
            self._done = True
            raise
        if out.finished:
            self._done = True
        return out

    async def aclose(self) -> None:
        """Cancel the request if it has not finished (idempotent)."""
        if self._inner is not None:
            await self._inner.aclose()

    def __del__(self) -> None:
        # A plain `async for` left early drops the stream without closing it: report the client gone.
        inner = self._inner
        if inner is not None and not self._done:
            inner.close_nowait()


__all__ = ["Engine", "Prompt", "RequestOutput", "RequestStream", "RequestUsage"]
