"""Run the app on hypercorn's trio worker, in the engine's trio run; drain on SIGTERM (or ``shutdown``), then exit.

Shutdown order: mark the server draining (``/health`` answers 503, new requests 503), ``engine.drain`` lets the
running requests finish (at most ``drain_timeout`` seconds), then every request still open is ended with a last
event that says why (``ending.OpenRequests``), then hypercorn stops, then the engine closes its log. A second
signal skips the rest of the drain. With a ``FleetConfig`` the engine is a fleet of replicas on Ray
(``fleet_backend.FleetBackend``), and closing it closes every replica's engine and log and the router log.

If the engine fails (an actor crashes; the log's disk is full), its nursery cancels everything in it, this server
included. The HTTP side runs shielded so that it can still answer: every open stream gets the engine's error as
its last event and ``[DONE]``, ``/health`` and new requests get a 503 naming the failure, and then hypercorn stops
(bounded by ``graceful_timeout``) and the engine's error leaves ``serve``. A cancel from outside, without a
failure, stops the HTTP side at once, as before.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from tickloom import Engine, EngineConfig
from tickloom.tools.serve.activity import AccessLog, report_stats
from tickloom.tools.serve.app import DEFAULT_MAX_ANSWER_ENTRIES, ServerState, build_app, with_status_counts
from tickloom.tools.serve.backend import ServedEngine
from tickloom.tools.serve.guard import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, BodyLimits, require_api_key
from tickloom.tools.serve.sse import DEFAULT_MAX_PENDING_BYTES

if TYPE_CHECKING:
    from tickloom.fleet.front import FleetConfig


FAILURE_LINGER_S = 1.0
"""After the engine failed and the open requests were told: how long the server still answers (503) before it
stops."""


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    """The name clients pass as ``model`` (default: the engine's ``model``)."""
    request_timeout: float | None = None
    """Seconds per request when the request gives no ``timeout`` (None: no deadline)."""
    drain_timeout: float = 30.0
    graceful_timeout: float = 5.0
    handle_signals: bool = False
    """Drain on SIGTERM and SIGINT (only in the main thread)."""
    api_keys: tuple[str, ...] = ()
    """With any, every route but ``/health`` (and ``/metrics`` with ``metrics_open``) needs one as a bearer token."""
    metrics_open: bool = False
    """Serve ``/metrics`` without an API key."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    max_stream_buffer_bytes: int = DEFAULT_MAX_PENDING_BYTES
    max_answer_entries: int = DEFAULT_MAX_ANSWER_ENTRIES
    allowed_origins: tuple[str, ...] = ()
    """Origins a browser may call this server from (CORS; ``*`` for any). Empty: no CORS headers, and a preflight
    gets 405."""
    access_log: bool = True
    """One line per HTTP request to the server's output (``activity.AccessLog``)."""
    stats_interval: float = 10.0
    """Seconds between stats lines (throughput, queues, KV usage) on the server's output; 0: none."""


def default_log_path(directory: str = ".", suffix: str = ".tlog") -> str:
    """A fresh path ``tickloom-serve-<UTC time>-<pid>[-k].tlog``: the engine never reuses a log path (``suffix=""``:
    a fleet's directory)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base = os.path.join(directory, f"tickloom-serve-{stamp}-{os.getpid()}")
    path, k = f"{base}{suffix}", 1
    while os.path.lexists(path):
        path, k = f"{base}-{k}{suffix}", k + 1
    return path


async def serve(config: EngineConfig, options: ServeOptions, *, fleet: FleetConfig | None = None,
                shutdown: trio.Event | None = None, out: TextIO | None = None,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Open an engine (with ``fleet``: a fleet of them on Ray, which must be initialised) and serve it until
    ``shutdown`` is set or a signal arrives (with ``handle_signals``); report the bound addresses through
    ``task_status`` (``nursery.start(serve, ...)`` returns them, e.g. ``["http://127.0.0.1:8000"]``)."""
    if fleet is None:
        async with Engine.open(config) as engine:
            await serve_engine(engine, options, shutdown=shutdown, out=out, task_status=task_status)
        return
    from tickloom.tools.serve.fleet_backend import FleetBackend

    async with FleetBackend.open(config, fleet) as backend:
        logs = f"{fleet.fleet_dir} ({fleet.replicas} replicas on Ray; tickloom replay {fleet.fleet_dir})"
        await serve_engine(backend, options, shutdown=shutdown, out=out, task_status=task_status, logs=logs)


async def serve_engine(engine: ServedEngine, options: ServeOptions, *, shutdown: trio.Event | None = None,
                       out: TextIO | None = None, logs: str | None = None,
                       task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve an open engine, or anything with its surface (``backend.ServedEngine``), as ``serve`` does; shutting
    down drains it. ``logs``: where the startup line says the logs are (default: the engine's ``log_path``)."""
    config = engine.config
    state = ServerState(engine, options.model_name or config.model, options.request_timeout,
                        BodyLimits(options.max_body_bytes, options.body_timeout), options.max_stream_buffer_bytes,
                        options.max_answer_entries)
    open_paths = ("/health", "/metrics") if options.metrics_open else ("/health",)
    app: ASGIApp = require_api_key(build_app(state), options.api_keys, open_paths=open_paths)
    if options.allowed_origins:
        # Outside the key check: a browser's preflight carries no key. Any method and header, no credentials,
        # as vLLM's defaults; a preflight from another origin gets 400 and no CORS headers.
        app = CORSMiddleware(app, allow_origins=list(options.allowed_origins), allow_methods=["*"],
                             allow_headers=["*"])
    app = with_status_counts(app, state.metrics)
    if options.access_log and out is not None:
        app = AccessLog(app, out)
    hconfig = HypercornConfig()
    hconfig.bind = [f"[{options.host}]:{options.port}" if ":" in options.host
                    else f"{options.host}:{options.port}"]
    hconfig.accesslog = None
    # Hypercorn's own errors (an app exception after the response started, a protocol error) go to a logger
    # without handlers of its own: Python's last-resort handler prints WARNING and above to stderr.
    hconfig.errorlog = logging.getLogger("tickloom.serve.http")
    hconfig.graceful_timeout = options.graceful_timeout
    stop = trio.Event()
    drainer = _Drainer(state, engine, stop, options.drain_timeout, options.graceful_timeout, out)
    shield = trio.CancelScope(shield=True)
    failed = trio.Event()
    served = False

    async def watch_outside() -> None:
        """Outside the shield: see the cancel that the engine's failure (or the caller) sends."""
        try:
            await trio.sleep_forever()
        finally:
            failure = engine.failure
            if not served and failure is None:  # a plain cancel: stop serving at once
                shield.cancel()
            elif not served and failure is not None:
                state.failure = str(failure)
                failed.set()

    async with trio.open_nursery() as outside:
        outside.start_soon(watch_outside)
        with shield:
            async with trio.open_nursery() as nursery:

                async def run_http(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
                    await hypercorn_serve(app, hconfig, shutdown_trigger=stop.wait,  # type: ignore[arg-type]
                                          task_status=task_status)
                    nursery.cancel_scope.cancel()

                async def on_failure() -> None:
                    await failed.wait()
                    # The hard bound: the open requests' last events, then hypercorn's graceful stop.
                    shield.deadline = trio.current_time() + 2 * options.graceful_timeout + 1
                    if out is not None:
                        print(f"tickloom serve: the engine failed: {state.failure}; ending the open requests",
                              file=out, flush=True)
                    await drainer.end_open(f"the engine failed: {state.failure}")

                binds: list[str] = await nursery.start(run_http)
                if out is not None:
                    print(f"tickloom serve: model {state.model_name!r} on {', '.join(binds)}; log "
                          f"{logs or config.log_path or 'none'}", file=out, flush=True)
                nursery.start_soon(on_failure)
                if options.stats_interval > 0 and out is not None:
                    nursery.start_soon(report_stats, engine.stats, options.stats_interval, out)
                if options.handle_signals:
                    nursery.start_soon(_on_signals, nursery, drainer, out)
                if shutdown is not None:
                    async def on_shutdown() -> None:
                        await shutdown.wait()
                        await drainer.run()

                    nursery.start_soon(on_shutdown)
                task_status.started(binds)
        served = True
        outside.cancel_scope.cancel()


class _Drainer:
    """Drain once, end what is still open, then stop hypercorn; ``force`` cuts the drain short."""

    def __init__(self, state: ServerState, engine: ServedEngine, stop: trio.Event, timeout: float,
                 graceful_timeout: float, out: TextIO | None) -> None:
        self.state = state
        self.engine = engine
        self.stop = stop
        self.timeout = timeout
        self.graceful_timeout = graceful_timeout
        self.out = out
        self.scope = trio.CancelScope()
        self.started = False
        self.forced = False

    async def run(self) -> None:
        if self.started:
            return
        self.started = True
        self.state.draining = True
        finished = False
        with self.scope:
            finished = await self.engine.drain(self.timeout)
        if self.forced:
            reason = "the server is shutting down: a second signal stopped it before this request finished"
        elif not finished:
            reason = f"the server is shutting down: the drain timed out after {self.timeout:g} s"
            if self.out is not None:
                print(f"tickloom serve: the drain timed out after {self.timeout:g} s; ending the requests left",
                      file=self.out, flush=True)
        else:
            self.stop.set()
            return
        await self.end_open(reason)

    async def end_open(self, reason: str) -> None:
        """Give every open request a last answer that says ``reason``, then stop hypercorn."""
        requests = self.state.requests
        if self.state.failure is not None:
            # The engine's streams end with its error by themselves: give them a moment to say it first.
            with trio.move_on_after(self.graceful_timeout / 2):
                await requests.wait_closed()
        requests.end_all(reason)
        with trio.move_on_after(self.graceful_timeout):
            await requests.wait_closed()
        if self.state.failure is not None:
            # A moment in which /health (and any new request) says why, for whoever watches it, before the exit.
            await trio.sleep(min(FAILURE_LINGER_S, self.graceful_timeout))
        self.stop.set()

    def force(self) -> None:
        self.forced = True
        self.scope.cancel()
        if not self.started:
            self.stop.set()


async def _on_signals(nursery: trio.Nursery, drainer: _Drainer, out: TextIO | None) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not drainer.started:
                if out is not None:
                    print(f"tickloom serve: {name}: draining", file=out, flush=True)
                nursery.start_soon(drainer.run)
            else:
                if out is not None:
                    print(f"tickloom serve: {name} again: stopping now", file=out, flush=True)
                drainer.force()


def run(config: EngineConfig, options: ServeOptions, fleet: FleetConfig | None = None) -> None:
    """Blocking entry point for the CLI: one trio run, signals handled."""
    trio.run(functools.partial(serve, config, options, fleet=fleet, out=sys.stderr))


__all__ = ["ServeOptions", "default_log_path", "run", "serve", "serve_engine"]
