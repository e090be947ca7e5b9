"""The engine for asyncio apps: the same API as ``engine.Engine``, running trio in guest mode on the asyncio loop.

    import asyncio
    from tickloom import EngineConfig, SamplingParams
    from tickloom.asyncio import Engine

    async def main() -> None:
        async with Engine.open(EngineConfig(log_path="run.tlog")) as engine:
            async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
                print(out.text_delta, end="", flush=True)

    asyncio.run(main())

How it works:

- **One asyncio event loop hosts one trio guest run** (``trio.lowlevel.start_guest_run``), started lazily by the
  first ``Engine.open`` on that loop and ended when the last engine on it closes. Several engines in one asyncio
  app share that guest run; each is one trio task in it. There is no second event-loop thread: trio's ticks run
  as callbacks on the asyncio loop (trio's guest mode does keep its own helper thread that waits for I/O).
- Every awaitable call (a stream's next frame, ``cancel``, ``drain``, ``complete``, ``complete_n``) becomes one
  trio task in the guest run's nursery, submitted with ``TrioToken.run_sync_soon``. The task completes an asyncio
  future directly: both sides run on the loop's thread. At most ``MAX_PENDING_CALLS`` calls per loop are in
  flight; more wait on an ``asyncio.Semaphore``, so nothing queues without bound.
- Cancelling the asyncio caller cancels its trio task. Breaking out of ``async for`` (the stream is dropped
  unfinished) cancels the request, as in trio.
- Leaving an ``Engine.open`` block shuts the engine down in order, to the end, even if the task leaving it is
  cancelled meanwhile (a second Ctrl-C, or ``asyncio.run`` cancelling the tasks left when its main coroutine
  returns, as uvicorn's forced exit does): open streams end with the shutdown's error, and the cancellation is
  raised once the engine is down. Cancelled while it opens, the engine is closed as soon as it is open.
- ``generate``, ``stream``'s argument checks and ``stats`` are synchronous and run directly: bad input raises
  ``RequestRejected`` at the call, before any stream opens.

A failure inside a bridged call is raised in its asyncio caller. One whose caller has already gone (it was
cancelled) is passed to the loop's exception handler (``loop.call_exception_handler``), never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar, Unpack

import outcome
import trio

from tickloom import api
from tickloom.config import EngineConfig
from tickloom.engine.core.config import CoreConfig
from tickloom.engine.outputs import RequestOutput
from tickloom.params import SamplingParams
from tickloom.request import Request, RequestOptions
from tickloom.runtime import Runtime

__all__ = ["MAX_PENDING_CALLS", "AsyncEngine", "AsyncRequestStream", "Engine", "GuestRunError"]

T = TypeVar("T")

MAX_PENDING_CALLS = 4096
"""Bridged calls in flight per asyncio loop; further callers wait for a free slot."""


class GuestRunError(RuntimeError):
    """The trio guest run that hosts the engines of this asyncio loop stopped unexpectedly."""


class _GuestHost:
    """One trio guest run on one asyncio loop: starts lazily, ends when its last user leaves."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._users = 0
        self._lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(MAX_PENDING_CALLS)
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._done: asyncio.Future[None] | None = None
        self._retired = False

    # -- lifetime --------------------------------------------------------------------------------------------
    async def acquire(self) -> bool:
        """Count a user in, starting the guest run if none is running; False if this host has been retired."""
        async with self._lock:
            if self._retired:
                return False
            if self._token is None:
                try:
                    await self._start()
                except asyncio.CancelledError:
                    if self._token is not None:  # it started, and no user will come to stop it
                        self._retire()
                        await self._stop_run()
                    raise
            self._users += 1
            return True

    async def release(self) -> None:
        """Count a user out; the last one stops the guest run, waits for it to end (even if cancelled meanwhile, as
        ``_wait_out`` says) and retires this host. Counting out takes no lock, so a cancelled caller cannot leave
        the count, and the guest run, behind; an ``acquire`` after it sees the host retired and makes a new one."""
        self._users -= 1
        if self._users == 0:
            self._retire()
            await self._stop_run()

    def _retire(self) -> None:
        self._retired = True
        if _hosts.get(self._loop) is self:
            del _hosts[self._loop]

    async def _start(self) -> None:
        loop = self._loop
        started: asyncio.Future[None] = loop.create_future()
        done: asyncio.Future[None] = loop.create_future()
        stop = trio.Event()

        async def trio_main() -> None:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._token = trio.lowlevel.current_trio_token()
                if not started.done():
                    started.set_result(None)
                await stop.wait()
                nursery.cancel_scope.cancel()

        def on_done(result: outcome.Outcome[None]) -> None:
            self._token = None
            self._nursery = None
            if isinstance(result, outcome.Error):
                error = GuestRunError(f"the trio guest run ended with {result.error!r}")
                error.__cause__ = result.error
                for fut in (started, done):
                    if not fut.done():
                        fut.set_exception(error)
            else:
                if not started.done():
                    started.set_exception(GuestRunError("the trio guest run ended before it started"))
                if not done.done():
                    done.set_result(None)

        self._stop = stop
        self._done = done
        trio.lowlevel.start_guest_run(
            trio_main,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=loop.call_soon,
            done_callback=on_done,
            host_uses_signal_set_wakeup_fd=True,
        )
        await _wait_out(started)  # prompt; a cancelled caller then stops the run it started

    async def _stop_run(self) -> None:
        stop, done = self._stop, self._done
        assert stop is not None and done is not None
        self.run_soon(stop.set)
        await _wait_out(done)

    # -- calls -----------------------------------------------------------------------------------------------
    def run_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Run a synchronous function in the guest run, soon (thread-safe, never blocks)."""
        if self._token is None:
            raise GuestRunError("no trio guest run is active on this loop")
        self._token.run_sync_soon(fn, *args)

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> tuple[asyncio.Future[T], trio.CancelScope]:
        """Start ``fn(*args)`` as a trio task; its result comes in the future. Cancelling the future's waiter does
        not cancel the task (no asyncio task stands between them): cancel the returned scope for that."""
        fut: asyncio.Future[T] = self._loop.create_future()
        scope = trio.CancelScope()
        self.run_soon(self._spawn, self._run_call, fn, args, fut, scope)
        return fut, scope

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await ``fn(*args)`` as a trio task; cancelling the caller cancels the task."""
        async with self._slots:
            fut, scope = self.submit(fn, *args)
            try:
                return await fut
            except asyncio.CancelledError:
                if self._token is not None:
                    self.run_soon(scope.cancel)
                raise

    def spawn_soon(self, fn: Callable[..., Awaitable[object]], *args: Any) -> None:
        """Start ``fn(*args)`` as a trio task nobody waits for; a failure goes to the loop's exception handler."""
        fut: asyncio.Future[object] = self._loop.create_future()
        fut.cancel()
        self.run_soon(self._spawn, self._run_call, fn, args, fut, trio.CancelScope())

    def _spawn(self, *args: Any) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(*args)

    async def _run_call(self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], fut: asyncio.Future[T],
                        scope: trio.CancelScope) -> None:
        try:
            with scope:
                result = await fn(*args)
                if not fut.done():
                    fut.set_result(result)
                return
            # Only our own scope's cancellation lands here: the asyncio caller was cancelled.
            if not fut.done():
                fut.cancel()
        except Exception as exc:
            if not fut.done():
                fut.set_exception(exc)
            else:
                self._loop.call_exception_handler({
                    "message": f"tickloom: an abandoned call to {getattr(fn, '__qualname__', fn)!r} failed",
                    "exception": exc,
                })
        except BaseException:
            # trio.Cancelled from the guest run ending, or KeyboardInterrupt: tell the caller, then propagate.
            if not fut.done():
                fut.set_exception(GuestRunError("the trio guest run stopped while a call was in flight"))
            raise


_hosts: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _GuestHost] = weakref.WeakKeyDictionary()


async def _wait_out(fut: asyncio.Future[T]) -> T:
    """Wait for ``fut`` to the end even if this task is cancelled meanwhile; then raise the cancellation (or
    ``fut``'s own error), or return its result.

    Why: closing an engine must run its shutdown to the end. A second Ctrl-C, or ``asyncio.run`` cancelling every
    task left when its main coroutine returns (uvicorn's forced exit does that), cancels the task that is closing
    the engine. Giving up then would cancel the trio side with it: the engine's actors would be cancelled under its
    shielded shutdown, which then waits out its whole timeout for them, and the guest run would be left behind.
    The shutdown ends open requests with explicit errors, so it is short; ``asyncio.run`` keeps the loop running
    until the cancelled tasks end.
    """
    cancelled: asyncio.CancelledError | None = None
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None and (fut.cancelled() or fut.exception() is None):
        raise cancelled
    return fut.result()


async def _acquire_host() -> _GuestHost:
    """This loop's guest host, counted in. A host lives while engines use it; the next open makes a new one."""
    loop = asyncio.get_running_loop()
    while True:
        host = _hosts.get(loop)
        if host is None:
            host = _hosts[loop] = _GuestHost(loop)
        if await host.acquire():
            return host


async def _hold_open(config: EngineConfig, opened: asyncio.Future[api.Engine], closing: trio.Event) -> None:
    """The trio task behind one asyncio ``Engine.open`` block: open, hand the engine over, wait to be closed.

    Closing is ``closing.set()``, also while the engine opens, never a cancellation of this task. A cancellation
    that lands once the actors run (the opening may have no checkpoint after it: none at all for the stub, only
    the model load in a thread, which runs to its end anyway) would cancel them under the engine's shielded
    shutdown, which would then wait out its whole timeout. An engine whose opener gave up is closed as it opens.
    """
    async with api.Engine.open(config) as engine:
        if not closing.is_set():
            opened.set_result(engine)
            await closing.wait()


class AsyncEngine:
    """``engine.Engine`` for asyncio, public as ``tickloom.asyncio.Engine``. Use ``async with Engine.open(config) as
    engine:``."""

    def __init__(self, inner: api.Engine, host: _GuestHost) -> None:
        self._inner = inner
        self._host = host

    @classmethod
    @asynccontextmanager
    async def open(cls, config: EngineConfig | None = None) -> AsyncIterator[AsyncEngine]:
        """Start the engine in this loop's trio guest run; leaving the block shuts it down.

        If an actor crashes, every open stream raises ``EngineError`` naming it, and so does leaving this block.
        """
        host = await _acquire_host()
        try:
            closing = trio.Event()
            opened: asyncio.Future[api.Engine] = asyncio.get_running_loop().create_future()
            # Not through ``call``: cancelling this block must close the engine in order, not cancel its task.
            held, _ = host.submit(_hold_open, config or EngineConfig(), opened, closing)
            try:
                first: list[asyncio.Future[Any]] = [opened, held]
                await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                host.run_soon(closing.set)  # it closes as soon as it is open
                await _wait_out(held)
                raise
            if not opened.done():
                await _wait_out(held)  # opening failed: raises its error
                raise AssertionError("the engine task ended without opening the engine")
            try:
                yield cls(opened.result(), host)
            finally:
                host.run_soon(closing.set)
                await _wait_out(held)
        finally:
            await host.release()

    @property
    def config(self) -> EngineConfig:
        return self._inner.config

    @property
    def runtime(self) -> Runtime:
        """The trio-side runtime (for stats and tests); touch its trio objects only from the guest run."""
        return self._inner.runtime

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, as ``engine.Engine.tokenizer``."""
        return self._inner.tokenizer

    @property
    def core_config(self) -> CoreConfig:
        """The scheduler's configuration as the engine derived it, as ``engine.Engine.core_config``."""
        return self._inner.core_config

    # -- requests --------------------------------------------------------------------------------------------
    def generate(self, prompt: api.Prompt, params: SamplingParams | None = None,
                 **options: Unpack[RequestOptions]) -> AsyncRequestStream:
        """Stream a completion, as ``engine.Engine.generate``. Leaving the ``async for`` early cancels it."""
        return AsyncRequestStream(self._inner.generate(prompt, params, **options), self._host)

    def generate_request(self, request: Request) -> AsyncRequestStream:
        """``generate`` for a request given as one ``Request``."""
        return AsyncRequestStream(self._inner.generate_request(request), self._host)

    @asynccontextmanager
    async def stream(self, prompt: api.Prompt, params: SamplingParams | None = None,
                     **options: Unpack[RequestOptions]) -> AsyncIterator[AsyncRequestStream]:
        """Like ``generate``, but the request is cancelled (if unfinished) when the block exits."""
        stream = self.generate(prompt, params, **options)
        try:
            await stream.start()
            yield stream
        except BaseException:
            stream.close_soon()  # do not wait while unwinding (this task may be being cancelled)
            raise
        else:
            await stream.aclose()

    async def complete(self, prompt: api.Prompt, params: SamplingParams | None = None,
                       **options: Unpack[RequestOptions]) -> RequestOutput:
        """Run a request to the end; one ``RequestOutput`` with every token id and the whole text."""
        return await self._host.call(functools.partial(self._inner.complete, prompt, params, **options))

    async def complete_n(self, prompt: api.Prompt, params: SamplingParams | None = None,
                         **options: Unpack[RequestOptions]) -> list[RequestOutput]:
        """Run a request's ``params.n`` choices to the end; one ``RequestOutput`` per choice, ordered by ``index``."""
        return await self._host.call(functools.partial(self._inner.complete_n, prompt, params, **options))

    async def cancel(self, request_id: str) -> None:
        """Cancel a request: it finishes ``cancelled`` with the tokens delivered so far."""
        await self._host.call(self._inner.cancel, request_id)

    async def drain(self, timeout: float = math.inf) -> bool:
        """Stop admitting and let running requests finish; True if all finished within ``timeout`` seconds."""
        return await self._host.call(self._inner.drain, timeout)

    def stats(self) -> dict[str, Any]:
        """Queues, KV blocks (free, cached, total), ticks, tokens and tokens/s, preemptions, spill bytes."""
        return self._inner.stats()


class AsyncRequestStream:
    """An async iterator of ``RequestOutput`` frames for one request (asyncio side)."""

    def __init__(self, inner: api.RequestStream, host: _GuestHost) -> None:
        self.request_id = inner.request_id
        self._inner = inner
        self._host = host
        self._finished = False
        """The final frame (or the end) has been pulled from the engine."""
        self._closed = False
        self._ready: deque[RequestOutput | None] = deque()
        """Frames pulled but not yet returned: at most one per concurrent ``__anext__`` (each pulls only when this
        is empty), so one in normal use."""

    async def start(self) -> None:
        """Submit the request now (iteration does it on the first frame otherwise)."""
        await self._host.call(self._inner.start)

    def __aiter__(self) -> AsyncRequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        if not self._ready:
            if self._finished:
                raise StopAsyncIteration
            try:
                await self._host.call(self._pull)
            except asyncio.CancelledError:
                raise  # only this wait was cancelled: the stream goes on (dropping it cancels the request)
            except BaseException:
                self._finished = True  # the stream raised (e.g. EngineError): it is over
                raise
        out = self._ready.popleft()
        if out is None:
            raise StopAsyncIteration
        return out

    async def _pull(self) -> None:
        """Trio side: move the next frame (None at the end) into ``_ready``. A frame pulled for a wait that was
        cancelled meanwhile stays there for the next ``__anext__``, so cancelling a wait never loses a frame."""
        try:
            out: RequestOutput | None = await self._inner.__anext__()
        except StopAsyncIteration:
            out = None
        if out is None or (out.finished and self._inner.choices == 1):  # n choices: the end comes as None
            self._finished = True
        self._ready.append(out)

    async def aclose(self) -> None:
        """Cancel the request if it has not finished (idempotent)."""
        if not self._closed:
            self._closed = True
            await self._host.call(self._inner.aclose)

    def close_soon(self) -> None:
        """``aclose`` without waiting: the request is cancelled soon if it has not finished (idempotent)."""
        if not self._closed:
            self._closed = True
            if not self._finished:
                # If the guest run is gone, so is the engine, and with it the request.
                with contextlib.suppress(GuestRunError, trio.RunFinishedError):
                    self._host.spawn_soon(self._inner.aclose)

    def __del__(self) -> None:
        # A plain `async for` left early drops the stream without closing it: cancel the request in trio.
        if not self.__dict__.get("_closed", True) and not self.__dict__.get("_finished", True):
            self.close_soon()


Engine = AsyncEngine
"""The public name (``tickloom.asyncio.Engine``): the asyncio ``Engine``, spelled like ``tickloom.Engine`` so that an
app switches by its import alone. The class is named ``AsyncEngine`` so that a traceback or a repr says which."""
