"""``Engine``: the embedded engine. One trio nursery of actors around one ``SchedulerCore``.

    async with Engine.open(EngineConfig(log_path="run.tlog")) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32), deadline=5.0):
            print(out.text_delta, end="")
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any, Unpack

import msgspec
import trio
from msgspec import Meta

from tickloom.actors.retire import ClientStream, GroupStream
from tickloom.config import EngineConfig
from tickloom.engine.core.config import CoreConfig
from tickloom.engine.errors import EngineError, EngineOverloaded, RequestRejected
from tickloom.engine.outputs import RequestOutput, RequestUsage
from tickloom.events import RequestArrived, RequestCancelled
from tickloom.events.types import INT64_MAX, Structured
from tickloom.params import SamplingParams
from tickloom.prompts import Prompt, text_prompt_ids
from tickloom.request import (
    PROMPT_TOKEN_IDS,
    Completing,
    Request,
    RequestId,
    RequestIds,
    RequestOptions,
    checked_request,
    request_of,
)
from tickloom.runtime import Runtime, build_runtime
from tickloom.validation import checked


class Engine(Completing):
    """Use ``Engine.open(config)``; the constructor only stores the configuration."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._rt: Runtime | None = None
        self._ids = RequestIds()
        self._draining = False
        self._groups: dict[str, list[str]] = {}
        """request id -> its choices' core ids, for ``n > 1`` requests (pruned once none is live)."""

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
    def failure(self) -> EngineError | None:
        """The error the engine failed with (an actor crashed), or None while it works (or before it opens)."""
        return None if self._rt is None else self._rt.fatal

    @property
    def runtime(self) -> Runtime:
        if self._rt is None:
            raise EngineError("engine", "the engine is not open: use `async with Engine.open(config)`")
        return self._rt

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (``decode`` turns token ids into text)."""
        return self.runtime.tokenizer

    @property
    def core_config(self) -> CoreConfig:
        """The scheduler's configuration as the engine derived it when it opened: KV blocks, block size, vocabulary,
        ``max_seq_len``."""
        return self.runtime.core_config

    @property
    def max_seq_len(self) -> int:
        """The context this engine runs with, prompt and output together: ``EngineConfig.max_seq_len`` capped at the
        model's context when it loaded."""
        return self.runtime.core_config.max_seq_len

    # -- requests --------------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                 **options: Unpack[RequestOptions]) -> RequestStream:
        """Stream a completion. Bad input raises ``RequestRejected`` here, before any stream opens.

        The keywords are ``RequestOptions`` (``deadline`` in seconds from submit, ``request_id``, ``priority``,
        ``cache_salt``); ``generate_request`` takes them as one ``Request``. Leaving the ``async for`` early cancels
        the request; use ``async with engine.stream(...)`` for cleanup at a known point.

        With ``params.n > 1`` the one stream yields the frames of all ``n`` choices as they come, each with its
        ``index`` (and the request's id); it ends once every choice has finished, and leaving it early cancels
        them all. The choices are ``n`` core requests, logged and replayed one by one: ``<id>/<i>``, seeded
        ``seed + i`` when ``params.seed`` is given (else the core derives a seed from each id), arriving together
        so that they share the prompt's KV through the prefix cache.
        """
        return self.generate_request(request_of(prompt, params, **options))

    def generate_request(self, request: Request) -> RequestStream:
        """``generate`` for a request given as one ``Request``."""
        rid, arrivals, seconds = self._arrivals(checked_request(request))
        return RequestStream(self, rid, arrivals, seconds)

    @asynccontextmanager
    async def stream(self, prompt: Prompt, params: SamplingParams | None = None,
                     **options: Unpack[RequestOptions]) -> AsyncIterator[RequestStream]:
        """Like ``generate``, but the request is cancelled (if unfinished) when the block exits."""
        stream = self.generate(prompt, params, **options)
        await stream.start()
        try:
            yield stream
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def cancel(self, request_id: str) -> None:
        """Cancel a request: it finishes ``cancelled`` with the tokens delivered so far (every choice of an ``n > 1``
        request when given its id; one choice when given ``<id>/<i>``)."""
        rid: str = checked(request_id, RequestId, "request_id")
        for core_id in self._live_group(rid) or [rid]:
            await self.runtime.client.send(RequestCancelled(core_id))

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
    def _live_group(self, request_id: str) -> list[str] | None:
        """The core ids of the live ``n > 1`` request ``request_id``, or None (a finished group is forgotten)."""
        ids = self._groups.get(request_id)
        if ids is not None and not any(rid in self.runtime.live for rid in ids):
            del self._groups[request_id]
            ids = None
        return ids

    def _taken(self, rid: str, ids: Sequence[str]) -> bool:
        live = self.runtime.live
        return self._live_group(rid) is not None or any(i in live or self._live_group(i) for i in ids)

    def _arrivals(self, request: Request) -> tuple[str, list[RequestArrived], float | None]:
        """What the engine itself checks of a checked ``request`` (``RequestRejected`` names it): the params against
        the vocabulary, ``n`` against the open slots, the prompt.

        Returns the request's id, its arrivals (one per choice, without ``deadline_ns``, which is measured at
        submit) and the deadline in seconds.
        """
        rt = self.runtime
        limits = rt.core_config
        params = request.params
        params.check_vocabulary(limits.vocab_size)
        n = params.n
        if n > rt.max_slots:
            raise RequestRejected(f"SamplingParams.n={n} is more than the engine holds open at once "
                                  f"({rt.max_slots}: max_waiting)")
        ids = self._prompt_ids(request.prompt, _kept_tokens(params.truncate_prompt_tokens, limits.max_seq_len))
        if len(ids) >= limits.max_seq_len:
            raise RequestRejected(f"the prompt has {len(ids)} tokens; max_seq_len={limits.max_seq_len}")
        rid = self._ids.assign(request.request_id, lambda i: self._taken(i, choice_ids(i, n)))
        spec = params.to_spec()
        if spec.structured is not None:
            self._check_structured(spec.structured)
        arrivals = [RequestArrived(core_id, ids, spec, None if params.seed is None else params.seed + i,
                                   request.priority, None, request.cache_salt)
                    for i, core_id in enumerate(choice_ids(rid, n))]
        return rid, arrivals, request.deadline

    def _check_structured(self, structured: Structured) -> None:
        """Compile the constraint for this model's tokenizer before anything is logged (cached for the device)."""
        constraints = self.runtime.constraints
        if constraints is None:
            where = "the stub model" if self.runtime.config.model == "stub" else "a tensor-parallel engine"
            raise RequestRejected(f"SamplingParams.structured: {where} runs no structured-output constraints")
        try:
            constraints.check(structured)
        except ValueError as exc:
            raise RequestRejected(f"SamplingParams.{exc}") from None

    def _prompt_ids(self, prompt: Prompt, keep: int | None = None) -> list[int]:
        """The prompt's token ids: text is tokenized, chat messages rendered first, token ids checked; only the last
        ``keep`` of them when given (``SamplingParams.truncate_prompt_tokens``)."""
        rt = self.runtime
        limits = rt.core_config
        ids = text_prompt_ids(rt.tokenizer, prompt, limits.max_seq_len)
        if ids is None:  # token ids
            assert isinstance(prompt, list | tuple)
            if keep is not None:
                prompt = prompt[-keep:]
            if len(prompt) >= limits.max_seq_len:
                raise RequestRejected(f"the prompt has {len(prompt)} tokens; max_seq_len={limits.max_seq_len}")
            ids = checked(prompt, PROMPT_TOKEN_IDS, "prompt")
            bad = next((i for i, t in enumerate(ids) if t >= limits.vocab_size), None)
            if bad is not None:
                raise RequestRejected(f"prompt token id {ids[bad]} at position {bad} is outside "
                                      f"vocab_size={limits.vocab_size}")
        if not ids:
            raise RequestRejected("the prompt is empty")
        return ids if keep is None else ids[-keep:]

    async def _submit(self, request_id: str, arrivals: list[RequestArrived], deadline: float | None) -> Any:
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
        await rt.acquire_slots(len(arrivals))
        if self._taken(request_id, [a.request_id for a in arrivals]):
            for _ in arrivals:
                rt.release_slot()
            raise RequestRejected(f"request_id={request_id!r} is already in use")
        if deadline is not None:
            # Measured again once a slot is free: the deadline runs from submit, not from the call.
            deadline_ns = min(rt.now_ns() + int(deadline * 1e9), INT64_MAX)
            arrivals = [msgspec.structs.replace(a, deadline_ns=deadline_ns) for a in arrivals]
        stream: ClientStream | GroupStream
        if len(arrivals) == 1:
            stream = rt.open_stream(arrivals[0])
        else:
            stream = rt.open_group(request_id, arrivals)
            if len(self._groups) > len(rt.live) + 64:  # keeps the table bounded by the live requests
                self._groups = {k: v for k, v in self._groups.items() if any(i in rt.live for i in v)}
            self._groups[request_id] = [a.request_id for a in arrivals]
        sent = 0
        try:
            for arrival in arrivals:
                await rt.client.send(arrival)
                sent += 1
        except BaseException:
            # Not sent (a cancelled send sends nothing): the core never saw these, so free their streams, ids and
            # slots here, without a ClientGone that could hit a later request reusing an id. Choices already sent
            # are cancelled by closing the stream.
            for arrival in arrivals[sent:]:
                rt.retire.abandon(arrival.request_id)
                rt.finished(arrival.request_id)
            if sent:
                stream.close_nowait()
            raise
        return stream


def _kept_tokens(truncate: int | None, max_seq_len: int) -> int | None:
    """How many of the prompt's last tokens ``truncate_prompt_tokens`` keeps (-1: all that leave room for one more)."""
    if truncate == 0:
        raise RequestRejected("SamplingParams.truncate_prompt_tokens=0 would keep no prompt token: give k >= 1, or -1 "
                              "for the last max_seq_len - 1")
    return max_seq_len - 1 if truncate == -1 else truncate


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return found


def choice_ids(request_id: str, n: int) -> list[str]:
    """The core request ids of a request's ``n`` choices: the id itself for one, ``<id>/<i>`` for several."""
    return [request_id] if n == 1 else [f"{request_id}/{i}" for i in range(n)]


class RequestStream:
    """An async iterator of ``RequestOutput`` frames for one request (all its choices, when ``n > 1``)."""

    def __init__(self, engine: Engine, request_id: str, arrivals: list[RequestArrived],
                 deadline: float | None) -> None:
        self.request_id = request_id
        self._engine = engine
        self._arrivals = arrivals
        self._deadline = deadline
        self._inner: Any = None
        self._done = False

    @property
    def choices(self) -> int:
        """``SamplingParams.n``: the stream ends after this many final frames."""
        return len(self._arrivals)

    async def start(self) -> None:
        if self._inner is None:
            self._inner = await self._engine._submit(self.request_id, self._arrivals, self._deadline)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        await self.start()
        try:
            out: RequestOutput = await self._inner.__anext__()
        except StopAsyncIteration:
            self._done = True
            raise
        if out.finished and self.choices == 1:
            self._done = True
        if out.logprobs is not None and not self._arrivals[0].params.logprobs:
            # A batch computes logprobs for every row once one of them asks: only those that asked get them.
            out = msgspec.structs.replace(out, logprobs=None)
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


__all__ = ["Engine", "Prompt", "Request", "RequestOutput", "RequestStream", "RequestUsage", "choice_ids"]
