"""One replica: an ``Engine`` (``tickloom.asyncio``) in a Ray actor, with its own log in the fleet directory.

Each start of the actor (the first, and each restart Ray makes after a crash, up to ``max_restarts``) is an
incarnation with a new log, ``<fleet dir>/replica-<i>/incarnation-<n>.tlog``: ``n`` is the first number whose log
does not exist yet, and the engine creates it with ``O_EXCL``, so a restart never touches the log of the start
that died (which ends at its last whole frame and replays as it is).

Streams come back by bounded pulls: a pump task per request moves the engine's frames into a queue of at most
``PULL_BUFFER`` frames, and ``pull`` hands over what is there (at least one frame, at most ``max_frames``). A
request whose client does not pull stops its pump once the queue is full.

The log directory must be reachable where the replica runs: on one machine any path, on a cluster a shared file
system (or a node-local path collected afterwards by path).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

import msgspec

from tickloom import EngineConfig, EngineOverloaded, RequestOutput, RequestRejected
from tickloom.fleet.router_replay import incarnation_log, replica_dir
from tickloom.fleet.wire import Load, Pulled, ReplicaInfo, Submit, Submitted, decode, encode
from tickloom.prompts import tokenize

PULL_BUFFER = 64
"""Frames a replica holds for one request before its pump waits for the front end to pull."""


def next_incarnation(fleet_dir: str, index: int) -> int:
    """The first incarnation number whose log does not exist yet."""
    n = 0
    while os.path.lexists(incarnation_log(fleet_dir, index, n)):
        n += 1
    return n


class _Pump:
    """Moves one request's frames from the engine's stream into a bounded queue."""

    def __init__(self, stream: Any, choices: int) -> None:
        self.stream = stream
        self.choices = choices
        self.queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue(PULL_BUFFER)
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        try:
            async for out in self.stream:
                await self.queue.put(out)
            await self.queue.put(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the front end by ``pull`` as the stream's error
            await self.queue.put(exc)


class ReplicaActor:
    """The body of the Ray actor (``front.replica_class`` wraps it with ``ray.remote``)."""

    def __init__(self, index: int, fleet_dir: str, engine_config_json: bytes) -> None:
        self.index = index
        self.fleet_dir = fleet_dir
        os.makedirs(replica_dir(fleet_dir, index), exist_ok=True)
        self.incarnation = next_incarnation(fleet_dir, index)
        self.log_path = str(incarnation_log(fleet_dir, index, self.incarnation))
        config = msgspec.json.decode(engine_config_json, type=EngineConfig)
        self.config = msgspec.structs.replace(config, log_path=self.log_path)
        self._engine: Any = None
        self._opened: contextlib.AsyncExitStack | None = None
        self._pumps: dict[str, _Pump] = {}
        self._start_lock = asyncio.Lock()

    async def start(self) -> bytes:
        """Open the engine (once per incarnation); its ``ReplicaInfo``."""
        async with self._start_lock:
            if self._engine is None:
                if self.config.model != "stub":
                    import torch

                    torch.set_num_threads(self.config.threads or 1)
                from tickloom.asyncio import Engine

                stack = contextlib.AsyncExitStack()
                self._engine = await stack.enter_async_context(Engine.open(self.config))
                self._opened = stack
        core = self._engine.core_config
        return encode(ReplicaInfo(self.index, self.incarnation, os.getpid(), socket.gethostname(), self.log_path,
                                  core.block_size, core.num_blocks))

    async def tokenize(self, prompt: str) -> list[int]:
        await self.start()
        return tokenize(self._engine.tokenizer, prompt)

    async def load(self) -> bytes:
        await self.start()
        stats = self._engine.stats()
        return encode(Load(self.incarnation, stats["waiting"], stats["running"], stats["blocks_free"]))

    async def submit(self, data: bytes) -> bytes:
        request = decode(data, Submit)
        if request.incarnation != self.incarnation:
            return encode(Submitted(self.incarnation, stale=True))
        await self.start()
        try:
            stream = self._engine.generate_request(request.request)
            await stream.start()
        except RequestRejected as exc:
            return encode(Submitted(self.incarnation, rejected=str(exc)))
        except EngineOverloaded as exc:
            return encode(Submitted(self.incarnation, overloaded=str(exc)))
        pump = _Pump(stream, request.request.params.n)
        pump.task = asyncio.get_running_loop().create_task(pump.run())
        self._pumps[stream.request_id] = pump
        return encode(Submitted(self.incarnation))

    async def pull(self, request_id: str, max_frames: int) -> bytes:
        pump = self._pumps.get(request_id)
        if pump is None:
            return encode(Pulled(self.incarnation, unknown=True))
        items = [await pump.queue.get()]
        while len(items) < max_frames and not pump.queue.empty():
            items.append(pump.queue.get_nowait())
        frames = [item for item in items if isinstance(item, RequestOutput)]
        ended = [item for item in items if not isinstance(item, RequestOutput)]
        error = None
        if ended or (frames and frames[-1].finished and pump.choices == 1):
            if self._pumps.get(request_id) is pump:  # ``cancel`` may have removed it while this pull waited
                del self._pumps[request_id]
            if ended and isinstance(ended[0], BaseException):
                error = f"{type(ended[0]).__name__}: {ended[0]}"
        return encode(Pulled(self.incarnation, frames, error=error))

    async def cancel(self, request_id: str) -> None:
        pump = self._pumps.pop(request_id, None)
        if pump is not None:
            await pump.stream.aclose()
            if pump.task is not None:
                pump.task.cancel()
            if not pump.queue.full():  # a full queue has no pull waiting on it
                pump.queue.put_nowait(None)  # ends a pull still waiting (its caller went away)

    async def close(self) -> None:
        """Close the engine (its log ends with its last tick)."""
        for rid in list(self._pumps):
            await self.cancel(rid)
        if self._opened is not None:
            stack, self._opened, self._engine = self._opened, None, None
            await stack.aclose()
