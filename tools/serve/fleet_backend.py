"""``FleetBackend``: a ``fleet.front.Fleet`` (asyncio) behind the trio server, with the engine's surface
(``backend.ServedEngine``): ``config``, ``tokenizer``, ``max_seq_len``, ``stats()``, ``generate_request()`` and
``drain()``.

    async with FleetBackend.open(EngineConfig(model="stub"), FleetConfig(replicas=2, fleet_dir="run")) as backend:
        await serve_engine(backend, ServeOptions(port=8000))

The fleet runs on its own asyncio loop in a thread of its own; every call into it is a coroutine submitted to that
loop, and trio waits for its ``concurrent.futures.Future`` through a ``trio.Event`` set from the loop's thread (no
trio worker thread is held per waiting request). Prompts are tokenized here, with the model's tokenizer loaded in
this process as the engine's runtime loads it (``load_tokenizer``: the tokenizer files alone, no weights), so a
replica receives token ids (chat messages rendered here with the model's template) and ``token_text`` needs no
round trip. ``stats()`` sums the replicas' last load reports (queues, free and total KV blocks) and counts the
live replicas.

Ray is the optional extra ``tickloom[fleet]`` (``tickloom serve --replicas`` says so if it is missing).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Annotated, Any, Generic, NoReturn, TypeVar

import msgspec
import trio
from msgspec import Meta

from tickloom import EngineConfig, EngineError, EngineOverloaded, RequestOutput, RequestRejected
from tickloom.fleet.front import Fleet, FleetConfig, FleetError, FleetStream, NoReplica, ReplicaDied
from tickloom.prompts import Prompt, text_prompt_ids
from tickloom.request import Request, checked_request
from tickloom.tools.serve.backend import BackendRequestError, ReplicaUnavailable
from tickloom.validation import checked

log = logging.getLogger("tickloom.serve")

T = TypeVar("T")


def load_tokenizer(config: EngineConfig) -> tuple[Any, int]:
    """The model's tokenizer (its chat template replaced by ``config.chat_template``, if given) and the context its
    engines run with (``max_seq_len`` capped at the model's), as ``tickloom.runtime.build_runtime`` loads and caps
    them, without the weights."""
    if config.model == "stub":
        from tickloom.engine.model.stub import StubTokenizer

        return StubTokenizer(config.stub_vocab_size), config.max_seq_len
    from tickloom.engine.model.config import ModelConfig
    from tickloom.engine.model.convert import resolve_model
    from tickloom.engine.model.tokenizer import TokenizerWrapper

    directory = resolve_model(config.model)
    tokenizer = TokenizerWrapper.from_dir(directory)
    if config.chat_template is not None:  # the template's text: EngineConfig read and compiled it
        tokenizer.replace_chat_template(config.chat_template)
    context = ModelConfig.from_file(directory / "config.json").max_position_embeddings
    return tokenizer, min(config.max_seq_len, context)


class _Pending(Generic[T]):
    """One coroutine running on the fleet's loop; trio waits for it on ``done``, set from the loop's thread."""

    def __init__(self, future: concurrent.futures.Future[T], token: trio.lowlevel.TrioToken) -> None:
        self.future = future
        self.done = trio.Event()
        self._token = token
        future.add_done_callback(self._wake)  # runs now if it is already done

    def _wake(self, _: object) -> None:
        with contextlib.suppress(trio.RunFinishedError):  # the trio run is over: nobody is waiting
            self._token.run_sync_soon(self.done.set)


def _report(future: concurrent.futures.Future[Any]) -> None:
    """Log the failure of a call nobody waits for any more."""
    if not future.cancelled() and future.exception() is not None:
        log.error("closing an abandoned fleet request failed", exc_info=future.exception())


def _translated(exc: BaseException) -> BaseException:
    """The fleet's failure of one request as the server knows engine failures (``EngineError``s)."""
    if isinstance(exc, ReplicaDied | NoReplica):
        return ReplicaUnavailable(str(exc))
    if isinstance(exc, FleetError):
        return BackendRequestError(str(exc))
    if isinstance(exc, RequestRejected | EngineOverloaded | EngineError) or not isinstance(exc, Exception):
        return exc
    if isinstance(exc, concurrent.futures.CancelledError):
        return BackendRequestError("the fleet closed while the request was open")
    return BackendRequestError(f"{type(exc).__name__}: {exc}")


def _raise(exc: BaseException) -> NoReturn:
    mapped = _translated(exc)
    if mapped is exc:
        raise exc
    raise mapped from exc


class _Remote:
    """A request's side on the fleet's loop. Every method runs on that loop, so its fields need no lock."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.stream: FleetStream | None = None
        self.starting: asyncio.Task[Any] | None = None
        self.pulling: asyncio.Task[Any] | None = None

    async def start(self, fleet: Fleet) -> None:
        self.starting = asyncio.current_task()
        self.stream = fleet.generate_request(self.request)
        await self.stream.start()

    async def next(self) -> RequestOutput | None:
        assert self.stream is not None
        self.pulling = asyncio.current_task()
        try:
            return await self.stream.__anext__()
        except StopAsyncIteration:
            return None

    async def close(self) -> None:
        # Why: the trio side has left; what is still in flight here is settled before the request is cancelled.
        # - A start is waited for, never cancelled: cancelling the await would not recall a submit already sent,
        #   and the replica would run the request for nobody. A start is one route and one Ray call, so it is short.
        # - A pull is cancelled: it may wait as long as the request is queued, and its frames are for nobody. The
        #   replica's own pull ends once ``FleetStream.aclose`` cancels the request there.
        # A result left here was never taken by the trio side (it takes it and ends, or closes first).
        for task, cancel in ((self.starting, False), (self.pulling, True)):
            if task is None:
                continue
            if not task.done():
                if cancel:
                    task.cancel()
                await asyncio.wait([task])
            if not task.cancelled() and task.exception() is not None:
                log.info("a fleet request whose client left failed: %s", task.exception())
        if self.stream is not None:
            await self.stream.aclose()


class FleetRequestStream:
    """The trio side of one fleet request: ``start``, ``async for`` (one frame per call into the loop, so the
    replica's bounded buffer is the only buffer), ``aclose``. A ``ReplicaDied`` or ``NoReplica`` raises as
    ``ReplicaUnavailable``, another fleet failure as ``BackendRequestError``; ``RequestRejected`` and
    ``EngineOverloaded`` as they are."""

    def __init__(self, backend: FleetBackend, remote: _Remote) -> None:
        self._backend = backend
        self._remote = remote
        self._choices = remote.request.params.n
        self._starting: _Pending[None] | None = None
        self._pulling: _Pending[RequestOutput | None] | None = None
        self._finals = 0
        self._ended = False
        """The end was seen (the last final frame, the end of iteration, an error) or the stream was closed."""
        self._closed = False

    async def start(self) -> None:
        backend = self._backend
        if self._starting is None:
            if self._closed:
                raise BackendRequestError("the request's stream is closed")
            if backend.draining:
                raise EngineOverloaded("the fleet is draining: no new requests")
            self._starting = backend.submit(self._remote.start(backend.fleet))
            backend.opened(self)
        try:
            await self._starting.done.wait()
        except trio.Cancelled:
            # Cut short, it cannot be known whether the replica took the request: close it (after the start).
            self._closed = True
            self._end()
            backend.abandon(self._remote)
            raise
        try:
            self._starting.future.result()
        except BaseException as exc:
            self._end()
            _raise(exc)

    def __aiter__(self) -> FleetRequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        await self.start()
        if self._pulling is None:
            self._pulling = self._backend.submit(self._remote.next())
        pulling = self._pulling
        await pulling.done.wait()  # a wait cut short leaves the pull running: the next call takes its frame
        self._pulling = None
        try:
            out = pulling.future.result()
        except BaseException as exc:
            self._end()
            _raise(exc)
        if out is None:
            self._end()
            raise StopAsyncIteration
        if out.finished:
            self._finals += 1
            if self._finals == self._choices:
                self._end()
        return out

    async def aclose(self) -> None:
        """Cancel the request if it has not finished (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._starting is None or (self._ended and self._pulling is None):
            self._end()
            return
        closing = self._backend.submit(self._remote.close())
        try:
            await closing.done.wait()
        except trio.Cancelled:
            closing.future.add_done_callback(_report)  # the close goes on, on the loop
            raise
        finally:
            self._end()
        closing.future.result()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._backend.ended(self)

    def __del__(self) -> None:
        # Dropped unfinished (an ``async for`` left early): cancel the request, as ``Engine``'s streams do.
        if self.__dict__.get("_starting") is not None and not self.__dict__.get("_ended", True):
            self._backend.abandon(self._remote)


class FleetBackend:
    """Use ``FleetBackend.open(engine_config, fleet_config)`` in a trio run (Ray initialised first)."""

    def __init__(self, config: EngineConfig, fleet_config: FleetConfig) -> None:
        self.config = config
        self.fleet_config = fleet_config
        self.tokenizer: Any = None
        """The model's tokenizer, loaded here at open (``load_tokenizer``)."""
        self.max_seq_len = config.max_seq_len
        """The context the replicas' engines run with: ``config.max_seq_len`` capped at the model's (at open)."""
        self.draining = False
        self._fleet: Fleet | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="tickloom-fleet-loop", daemon=True)
        self._stop = asyncio.Event()
        self._token = trio.lowlevel.current_trio_token()
        self._open: weakref.WeakSet[FleetRequestStream] = weakref.WeakSet()
        """Started streams not yet ended (weak: a stream dropped unfinished is collected and cancels itself)."""
        self._changed = trio.Event()

    @classmethod
    @asynccontextmanager
    async def open(cls, config: EngineConfig, fleet_config: FleetConfig) -> AsyncIterator[FleetBackend]:
        """Start the fleet's loop and ``Fleet.open`` on it; on leaving, close the fleet (every replica's engine and
        log, the router log) and stop the loop."""
        backend = cls(config, fleet_config)
        backend._thread.start()
        opened: concurrent.futures.Future[Fleet] = concurrent.futures.Future()
        host = backend.submit(backend._host(opened))

        def host_done(future: concurrent.futures.Future[None]) -> None:
            if not opened.done():  # Fleet.open failed, or was cancelled
                if future.cancelled():
                    opened.cancel()
                else:
                    opened.set_exception(future.exception() or FleetError("the fleet closed before it opened"))

        host.future.add_done_callback(host_done)
        try:
            ready = _Pending(opened, backend._token)
            await ready.done.wait()
            backend._fleet = opened.result()
            backend.tokenizer, backend.max_seq_len = await trio.to_thread.run_sync(load_tokenizer, config)
            yield backend
        finally:
            with trio.CancelScope(shield=True):
                await backend._close(host, opened.done() and not opened.cancelled() and opened.exception() is None)

    async def _host(self, opened: concurrent.futures.Future[Fleet]) -> None:
        async with Fleet.open(self.config, self.fleet_config) as fleet:
            opened.set_result(fleet)
            await self._stop.wait()

    async def _close(self, host: _Pending[None], was_open: bool) -> None:
        if was_open:
            self._loop.call_soon_threadsafe(self._stop.set)
        else:
            host.future.cancel()  # interrupted while opening: Fleet.open's own cleanup closes what started
        await host.done.wait()
        self._loop.call_soon_threadsafe(self._loop.stop)
        await trio.to_thread.run_sync(self._thread.join)
        error = None if host.future.cancelled() else host.future.exception()
        if was_open and error is not None:
            raise error  # closing the fleet failed

    def _run_loop(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            # As asyncio.run ends: cancel what is left (a request abandoned at the very end), report its failures.
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            for task in left:
                if not task.cancelled() and task.exception() is not None:
                    loop.call_exception_handler({"message": "a fleet task failed at close",
                                                 "exception": task.exception(), "task": task})
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    # -- calls into the loop -----------------------------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> _Pending[T]:
        """Run ``coro`` on the fleet's loop (thread-safe; never blocks)."""
        return _Pending(asyncio.run_coroutine_threadsafe(coro, self._loop), self._token)

    async def on_loop(self, fn: Callable[[Fleet], T]) -> T:
        """``fn(fleet)`` run on the fleet's loop (e.g. ``lambda f: f.kill_replica(1)``, for tests and chaos)."""
        fleet = self.fleet

        async def call() -> T:
            return fn(fleet)

        pending = self.submit(call())
        await pending.done.wait()
        return pending.future.result()

    def abandon(self, remote: _Remote) -> None:
        """Close ``remote`` on the loop without waiting (thread-safe: ``__del__`` may run in any thread)."""
        coro = remote.close()
        try:
            asyncio.run_coroutine_threadsafe(coro, self._loop).add_done_callback(_report)
        except RuntimeError:  # the loop is closed: the fleet, and its requests, are gone
            coro.close()
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._wake)

    # -- the engine's surface ----------------------------------------------------------------------------------
    @property
    def fleet(self) -> Fleet:
        """The fleet; touch it only on its loop (``on_loop``)."""
        if self._fleet is None:
            raise EngineError("fleet", "the fleet is not open: use `async with FleetBackend.open(...)`")
        return self._fleet

    def generate_request(self, request: Request) -> FleetRequestStream:
        """A stream of one request on the replica the router picks. The request is checked and its prompt tokenized
        here (``RequestRejected``); the fleet, then the replica's engine, check it again when they take it."""
        request = checked_request(request)
        ids = self._prompt_ids(request.prompt)
        return FleetRequestStream(self, _Remote(msgspec.structs.replace(request, prompt=ids)))

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        """Text and chat messages tokenized here, as the engine does (``tickloom.prompts``); token ids are passed on,
        and the replica's engine checks them."""
        ids = text_prompt_ids(self.tokenizer, prompt, self.max_seq_len)
        if ids is not None:
            return ids
        assert isinstance(prompt, list | tuple)  # text_prompt_ids refuses anything else
        return list(prompt)

    @property
    def failure(self) -> EngineError | None:
        """Always None: a replica that dies fails only its own requests (503 ``replica_unavailable``), and the
        fleet serves on with the others."""
        return None

    def stats(self) -> dict[str, Any]:
        """The live replicas' last load reports summed, and the replicas live. Read from this thread: the loop only
        ever replaces a replica's ``last_load`` and ``info`` (frozen structs) and ``live``, each read whole."""
        replicas = list(self.fleet.replicas)
        live = [r for r in replicas if r.live]
        loads = [load for r in live if (load := r.last_load) is not None]
        return {"waiting": sum(load.waiting for load in loads), "running": sum(load.running for load in loads),
                "blocks_free": sum(load.free_blocks for load in loads),
                "blocks_total": sum(r.info.num_blocks for r in live), "replicas": len(replicas),
                "replicas_live": len(live), "open": len(self._open)}

    async def drain(self, timeout: float = math.inf) -> bool:
        """Stop taking requests; True once every open stream has ended, False after ``timeout`` seconds."""
        seconds: float = checked(timeout, Annotated[float, Meta(ge=0.0)], "drain timeout")  # inf waits for all
        self.draining = True
        with trio.move_on_after(seconds):
            while len(self._open):
                await self._changed.wait()
            return True
        return False

    # -- open streams ------------------------------------------------------------------------------------------
    def opened(self, stream: FleetRequestStream) -> None:
        self._open.add(stream)

    def ended(self, stream: FleetRequestStream) -> None:
        self._open.discard(stream)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


__all__ = ["FleetBackend", "FleetRequestStream", "load_tokenizer"]
