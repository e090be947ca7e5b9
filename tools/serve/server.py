"""Run the app on hypercorn's trio worker, in the engine's trio run; drain on SIGTERM (or ``shutdown``), then exit.

Shutdown order: mark the server draining (``/health`` answers 503, new requests 503), ``engine.drain`` lets the
running requests finish (at most ``drain_timeout`` seconds), then hypercorn stops, then the engine closes its log.
A second signal skips the rest of the drain. With a ``FleetConfig`` the engine is a fleet of replicas on Ray
(``fleet_backend.FleetBackend``), and closing it closes every replica's engine and log and the router log.
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

from tickloom.engine import Engine, EngineConfig
from tickloom.tools.serve.app import ServerState, build_app, with_status_counts
from tickloom.tools.serve.backend import ServedEngine

if TYPE_CHECKING:
    from tickloom.fleet.front import FleetConfig


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
    state = ServerState(engine, options.model_name or config.model, options.request_timeout)
    app = with_status_counts(build_app(state), state.metrics)
    hconfig = HypercornConfig()
    hconfig.bind = [f"[{options.host}]:{options.port}" if ":" in options.host
                    else f"{options.host}:{options.port}"]
    hconfig.accesslog = None
    # Hypercorn's own errors (an app exception after the response started, a protocol error) go to a logger
    # without handlers of its own: Python's last-resort handler prints WARNING and above to stderr.
    hconfig.errorlog = logging.getLogger("tickloom.serve.http")
    hconfig.graceful_timeout = options.graceful_timeout
    stop = trio.Event()
    drainer = _Drainer(state, engine, stop, options.drain_timeout, out)

    async with trio.open_nursery() as nursery:

        async def run_http(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
            await hypercorn_serve(app, hconfig, shutdown_trigger=stop.wait,  # type: ignore[arg-type]
                                  task_status=task_status)
            nursery.cancel_scope.cancel()

        binds: list[str] = await nursery.start(run_http)
        if out is not None:
            print(f"tickloom serve: model {state.model_name!r} on {', '.join(binds)}; log "
                  f"{logs or config.log_path or 'none'}", file=out, flush=True)
        if options.handle_signals:
            nursery.start_soon(_on_signals, nursery, drainer, out)
        if shutdown is not None:
            async def on_shutdown() -> None:
                await shutdown.wait()
                await drainer.run()

            nursery.start_soon(on_shutdown)
        task_status.started(binds)


class _Drainer:
    """Drain once, then stop hypercorn; ``force`` cuts the drain short."""

    def __init__(self, state: ServerState, engine: ServedEngine, stop: trio.Event, timeout: float,
                 out: TextIO | None) -> None:
        self.state = state
        self.engine = engine
        self.stop = stop
        self.timeout = timeout
        self.out = out
        self.scope = trio.CancelScope()
        self.started = False

    async def run(self) -> None:
        if self.started:
            return
        self.started = True
        self.state.draining = True
        with self.scope:
            finished = await self.engine.drain(self.timeout)
            if not finished and self.out is not None:
                print(f"tickloom serve: the drain timed out after {self.timeout} s; closing the requests left",
                      file=self.out, flush=True)
        self.stop.set()

    def force(self) -> None:
        self.scope.cancel()
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
