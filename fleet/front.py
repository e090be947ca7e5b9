"""``Fleet``: N engine replicas on Ray behind the logged router, with the ``generate``/``stream`` API of ``Engine``.

    import asyncio, ray
    from tickloom import EngineConfig, SamplingParams
    from tickloom.fleet.front import Fleet, FleetConfig

    async def main() -> None:
        async with Fleet.open(EngineConfig(model="stub"), FleetConfig(replicas=3, fleet_dir="run")) as fleet:
            async for out in fleet.generate("Hello", SamplingParams(max_tokens=32)):
                print(out.text_delta, end="")

    asyncio.run(main())

Why Ray core actors and not Ray Serve: each replica is a stateful engine with an identity (its index: the router's
replica, its log directory), and the fleet needs per-replica logs, streams pulled with backpressure, its own
(logged, replayable) routing, and to notice each death and restart itself. Core actors give exactly that: a handle
per replica, ``max_restarts`` for the restart, ``RayActorError`` on every call in flight when a replica dies. Serve
would put its own router and proxy in front (neither logged nor replayable) and hide which replica answered.

The front end runs on one asyncio loop. Each request: its prompt's block hashes go to the router in a tick with the
pending load reports and finishes; the tick's frame is written; then the request goes to the chosen replica, and its
frames come back by bounded pulls (``FleetConfig.max_frames`` a pull, the replica holding at most
``replica.PULL_BUFFER``). A watcher polls each replica's load every ``load_every`` seconds, and brings a replica that
went down back in once Ray has restarted it. A replica that dies fails the requests open on it with ``ReplicaDied``;
nothing is retried (a request may have streamed tokens already), and the router sends it nothing until it rejoins.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Unpack

import msgspec
from msgspec import Meta

from tickloom import ConfigError, EngineConfig, EngineOverloaded, RequestOutput, RequestRejected, SamplingParams
from tickloom.fleet.logged_router import LoggedRouter
from tickloom.fleet.replica import ReplicaActor
from tickloom.fleet.router_events import MAX_REPLICAS, LoadReport, Lost, Policy, Refuse, Route, RouterConfig
from tickloom.fleet.router_replay import ROUTER_LOG
from tickloom.fleet.wire import Load, Pulled, ReplicaInfo, Submit, Submitted, decode, encode
from tickloom.prompts import Prompt
from tickloom.request import (
    PROMPT_TOKEN_IDS,
    Completing,
    Request,
    RequestIds,
    RequestOptions,
    checked_request,
    request_of,
)
from tickloom.validation import checked, encodable

CLOSE_TIMEOUT = 60.0
"""Seconds a replica gets to close its engine (and its log) before its actor is killed."""


class FleetError(RuntimeError):
    """A fleet-level failure of one request."""


class ReplicaDied(FleetError):
    """The replica serving the request died; the request is lost (not retried)."""


class NoReplica(FleetError):
    """No replica is live to take the request."""


class FleetConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to run a fleet; checked when made (``ConfigError`` names the field)."""

    fleet_dir: Annotated[str, Meta(min_length=1, max_length=4096)]
    """A new or empty directory: ``router.log`` and ``replica-<i>/incarnation-<n>.tlog`` are created in it."""
    replicas: Annotated[int, Meta(ge=1, le=MAX_REPLICAS)] = 2
    policy: Policy = "affinity"
    load_slack: Annotated[int, Meta(ge=0, le=1 << 20)] = 4
    affinity_blocks: Annotated[int, Meta(ge=1, le=4096)] = 64
    max_restarts: Annotated[int, Meta(ge=0, le=1000)] = 3
    """Ray restarts a replica that died this many times."""
    load_every: Annotated[float, Meta(gt=0.0, le=60.0)] = 0.05
    """Seconds between load polls (and rejoin attempts)."""
    max_frames: Annotated[int, Meta(ge=1, le=4096)] = 32
    """Frames one pull brings back at most."""
    snapshot_every: Annotated[int, Meta(ge=0, le=1 << 31)] = 256
    """Router ticks between router snapshots in its log."""
    replica_cpus: Annotated[float, Meta(ge=0.0, le=1024.0)] = 1.0
    replica_gpus: Annotated[float, Meta(ge=0.0, le=1024.0)] = 0.0
    start_timeout: Annotated[float, Meta(gt=0.0, le=86400.0)] = 600.0
    """Seconds a replica may take to start (load its model) before ``Fleet.open`` fails."""

    def __post_init__(self) -> None:
        try:
            msgspec.convert(msgspec.structs.asdict(self), _FleetFields)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"FleetConfig: {exc}") from None


_FleetFields = msgspec.defstruct(
    "FleetConfig", [(f.name, f.type, f.default) for f in msgspec.structs.fields(FleetConfig)],
    kw_only=True, forbid_unknown_fields=True)


def replica_class(max_restarts: int) -> Any:
    import ray

    return ray.remote(max_restarts=max_restarts, max_task_retries=0)(ReplicaActor)


async def _started(index: int, handle: Any, timeout: float) -> bytes:
    try:
        info: bytes = await asyncio.wait_for(handle.start.remote(), timeout)
    except TimeoutError:
        raise FleetError(f"replica {index} did not start within {timeout} s: does the Ray cluster have the CPUs "
                         "(replica_cpus) and GPUs (replica_gpus) for every replica?") from None
    return info


class _Replica:
    def __init__(self, handle: Any, info: ReplicaInfo) -> None:
        self.handle = handle
        self.info = info
        self.incarnation = info.incarnation
        self.live = True
        self.last_load: Load | None = None


class Fleet(Completing):
    """Use ``Fleet.open(engine_config, fleet_config)``. ``complete`` and ``complete_n`` are ``Engine``'s."""

    def __init__(self, engine: EngineConfig, config: FleetConfig) -> None:
        self.engine_config = engine
        self.config = config
        self.replicas: list[_Replica] = []
        self.router: LoggedRouter | None = None
        self._streams: weakref.WeakValueDictionary[str, FleetStream] = weakref.WeakValueDictionary()
        """Open streams; weak, so that a stream its client dropped unfinished is collected and cancels itself."""
        self._ids = RequestIds()
        self._watcher: asyncio.Task[None] | None = None
        self._closing = False
        self.deaths: list[tuple[int, int, str]] = []
        """(replica, incarnation, reason) of each replica that went down."""

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, engine: EngineConfig, config: FleetConfig) -> AsyncIterator[Fleet]:
        """Start the replicas (Ray must be initialised: ``ray.init()`` locally, ``ray.init(address=...)`` on a
        cluster), open the router log, run; on leaving, close every replica's engine and the router log."""
        import ray

        if engine.log_path is not None:
            raise ConfigError("EngineConfig.log_path: a fleet names its replicas' logs (leave it None)")
        if not ray.is_initialized():
            raise ConfigError("Fleet.open: call ray.init() first (ray.init(address=...) for a cluster)")
        fleet_dir = Path(config.fleet_dir)
        fleet_dir.mkdir(parents=True, exist_ok=True)
        fleet = cls(engine, config)
        actor = replica_class(config.max_restarts)
        handles = [actor.options(num_cpus=config.replica_cpus, num_gpus=config.replica_gpus,
                                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}})
                   .remote(i, os.fspath(fleet_dir), msgspec.json.encode(engine)) for i in range(config.replicas)]
        try:
            infos = [decode(await _started(i, h, config.start_timeout), ReplicaInfo) for i, h in enumerate(handles)]
            fleet.replicas = [_Replica(h, info) for h, info in zip(handles, infos, strict=True)]
            block_size = infos[0].block_size
            router_config = RouterConfig.checked({
                "replicas": config.replicas, "policy": config.policy, "block_size": block_size,
                "affinity_blocks": config.affinity_blocks, "load_slack": config.load_slack,
                "cache_blocks": min(max(1, infos[0].num_blocks), 1 << 22)})
            fleet.router = LoggedRouter(router_config, fleet_dir / ROUTER_LOG, time.monotonic_ns,
                                        snapshot_every=config.snapshot_every)
            fleet._watcher = asyncio.get_running_loop().create_task(fleet._watch())
            yield fleet
        finally:
            await fleet._close(handles)

    async def _close(self, handles: list[Any]) -> None:
        import ray

        # Why a flag as well as the cancel: on Python < 3.12 ``asyncio.wait_for`` returns the inner result instead of
        # raising when the cancel lands just as the awaited call completes, so one cancel of the watcher can be
        # swallowed (it then goes on polling, and the await below never ends). The flag ends its loop regardless.
        self._closing = True
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.wait([self._watcher])  # its end, without taking (or hiding) a cancel of this close
        for stream in list(self._streams.values()):
            await stream.aclose()
        for replica in self.replicas:  # empty if they never all started: then there is no engine to close
            # A replica that is down has nothing to close, and one that hangs is killed below.
            with contextlib.suppress(ray.exceptions.RayActorError, TimeoutError):
                await asyncio.wait_for(replica.handle.close.remote(), CLOSE_TIMEOUT)
        if self.router is not None:
            self.router.close()
        for h in handles:
            ray.kill(h, no_restart=True)

    # -- requests --------------------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                 **options: Unpack[RequestOptions]) -> FleetStream:
        """Stream a completion from the replica the router picks. Bad input raises ``RequestRejected`` here."""
        return self.generate_request(request_of(prompt, params, **options))

    def generate_request(self, request: Request) -> FleetStream:
        """``generate`` for a request given as one ``Request``: its prompt is text or token ids (the replica's engine
        tokenizes the text, and checks the token ids against its vocabulary)."""
        request = checked_request(request)
        prompt = request.prompt
        ids: list[int] = []
        if isinstance(prompt, str):
            encodable(prompt, "prompt")
        elif isinstance(prompt, list | tuple) and not any(isinstance(m, dict) for m in prompt):
            prompt = ids = checked(prompt, PROMPT_TOKEN_IDS, "prompt")
        else:
            raise RequestRejected(f"a fleet's prompt is a str or a list of token ids, not {type(prompt).__name__}")
        if not prompt:
            raise RequestRejected("the prompt is empty")
        rid = self._ids.assign(request.request_id, lambda i: i in self._streams)
        stream = FleetStream(self, msgspec.structs.replace(request, prompt=prompt, request_id=rid), ids)
        self._streams[rid] = stream
        return stream

    @contextlib.asynccontextmanager
    async def stream(self, prompt: Prompt, params: SamplingParams | None = None,
                     **options: Unpack[RequestOptions]) -> AsyncIterator[FleetStream]:
        """Like ``generate``; the request is cancelled (if unfinished) when the block exits."""
        stream = self.generate(prompt, params, **options)
        try:
            await stream.start()
            yield stream
        finally:
            await stream.aclose()

    def kill_replica(self, index: int) -> None:
        """Kill replica ``index``'s actor process (chaos, tests); Ray restarts it if restarts are left."""
        import ray

        ray.kill(self.replicas[index].handle, no_restart=False)

    def stats(self) -> dict[str, Any]:
        return {"replicas": [{"index": r.info.index, "live": r.live, "incarnation": r.incarnation,
                              "pid": r.info.pid, "node": r.info.node} for r in self.replicas],
                "open": len(self._streams), "deaths": list(self.deaths)}

    # -- the router and the replicas' fate ------------------------------------------------------------------------
    def _router(self) -> LoggedRouter:
        assert self.router is not None, "the fleet is not open"
        return self.router

    def _apply_lost(self, commands: Sequence[object]) -> None:
        for command in commands:
            if isinstance(command, Lost):
                replica = self.replicas[command.replica]
                for rid in command.request_ids:
                    stream = self._streams.get(rid)
                    if stream is not None:
                        stream.lose(f"replica {command.replica} died (incarnation {stream.incarnation}): request "
                                    f"{rid!r} is lost after {stream.frames_received} frames and is not retried "
                                    f"[{replica.info.node}, pid {replica.info.pid}]")

    def replica_failed(self, index: int, incarnation: int, reason: str) -> None:
        """Replica ``index`` failed in ``incarnation`` (a call raised, or it came back as a new incarnation)."""
        replica = self.replicas[index]
        if not replica.live or replica.incarnation != incarnation:
            return  # already known
        replica.live = False
        replica.last_load = None
        self.deaths.append((index, incarnation, reason))
        self._apply_lost(self._router().down(index, reason))

    def _rejoined(self, index: int, info: ReplicaInfo) -> None:
        replica = self.replicas[index]
        if replica.live:
            self.replica_failed(index, replica.incarnation, f"restarted as incarnation {info.incarnation}")
        replica.info, replica.incarnation, replica.live = info, info.incarnation, True
        self._apply_lost(self._router().up(index, info.incarnation))

    def route(self, stream: FleetStream) -> int:
        """Route ``stream``'s request; the replica index. Raises ``NoReplica`` when none is live."""
        router = self._router()
        commands = router.route(router.arrival(stream.request_id, stream.prompt, stream.request.cache_salt))
        self._apply_lost(commands)
        for command in commands:
            if isinstance(command, Route) and command.request_id == stream.request_id:
                return command.replica
            if isinstance(command, Refuse) and command.request_id == stream.request_id:
                raise NoReplica(f"request {stream.request_id!r}: {command.reason}")
        raise AssertionError(f"the router decided nothing for {stream.request_id!r}")

    def ended(self, stream: FleetStream, routed: bool) -> None:
        """``stream`` ended; ``routed``: the router still has it open (not lost), so it is told once."""
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        if routed and not stream.end_reported:
            stream.end_reported = True
            self._router().finished(stream.request_id)

    async def tokenize(self, text: str) -> list[int]:
        import ray

        for replica in self.replicas:
            if replica.live:
                try:
                    ids: list[int] = await replica.handle.tokenize.remote(text)
                    return ids
                except ray.exceptions.RayActorError as exc:
                    self.replica_failed(replica.info.index, replica.incarnation, f"the actor failed: {exc}")
                except ValueError as exc:
                    raise RequestRejected(f"the prompt cannot be tokenized: {exc}") from None
        raise NoReplica("no replica is live to tokenize the prompt")

    async def _watch(self) -> None:
        """Poll each live replica's load; bring back the ones Ray restarted."""
        import ray

        while not self._closing:
            await asyncio.sleep(self.config.load_every)
            for index, replica in enumerate(self.replicas):
                try:
                    if replica.live:
                        load = decode(await asyncio.wait_for(replica.handle.load.remote(), 10.0), Load)
                        if load.incarnation != replica.incarnation:
                            self._rejoined(index, decode(await replica.handle.start.remote(), ReplicaInfo))
                        elif load != replica.last_load:
                            replica.last_load = load
                            self._router().report(LoadReport(index, load.waiting, load.running, load.free_blocks))
                    else:
                        info = decode(await asyncio.wait_for(replica.handle.start.remote(), 10.0), ReplicaInfo)
                        if info.incarnation > replica.incarnation:
                            self._rejoined(index, info)
                except ray.exceptions.RayActorError as exc:
                    self.replica_failed(index, replica.incarnation, f"the actor failed: {exc}")
                except TimeoutError:
                    continue  # restarting, or busy: asked again next round
            self._router().flush()


class FleetStream:
    """An async iterator of ``RequestOutput`` frames of one request, from the replica the router chose."""

    def __init__(self, fleet: Fleet, request: Request, prompt: list[int]) -> None:
        assert request.request_id is not None
        self.fleet = fleet
        self.request_id = request.request_id
        self.request = request
        """The checked request, its id given; a text prompt becomes token ids at ``start``."""
        self.prompt = prompt
        """The prompt's token ids (empty until a text prompt is tokenized)."""
        self.replica: int | None = None
        self.incarnation = -1
        self.frames_received = 0
        self._ready: collections.deque[RequestOutput] = collections.deque()
        self._started = False
        self._done = False
        self._error: BaseException | None = None
        self._final_frames = 0
        self.end_reported = False

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        try:
            if isinstance(self.request.prompt, str):
                self.prompt = await self.fleet.tokenize(self.request.prompt)
                self.request = msgspec.structs.replace(self.request, prompt=self.prompt)
            await self._submit()
        except BaseException:
            self._finish(routed=self.replica is not None)
            raise

    async def _submit(self) -> None:
        import ray

        fleet = self.fleet
        index = fleet.route(self)
        replica = fleet.replicas[index]
        self.replica, self.incarnation = index, replica.incarnation
        try:
            answer = decode(await replica.handle.submit.remote(encode(Submit(self.request, replica.incarnation))),
                            Submitted)
        except ray.exceptions.RayActorError as exc:
            fleet.replica_failed(index, self.incarnation, f"the actor failed: {exc}")
            raise self._lost_error() from None
        if answer.stale:
            fleet.replica_failed(index, self.incarnation, f"restarted as incarnation {answer.incarnation}")
            raise self._lost_error()
        if answer.rejected is not None:
            raise RequestRejected(answer.rejected)
        if answer.overloaded is not None:
            raise EngineOverloaded(answer.overloaded)

    def _lost_error(self) -> BaseException:
        return self._error or ReplicaDied(f"replica {self.replica} died before request {self.request_id!r} reached "
                                          "it; it is not retried")

    def lose(self, message: str) -> None:
        """The router declared this request lost with its replica."""
        if not self._done and self._error is None:
            self._error = ReplicaDied(message)
            self.fleet.ended(self, routed=False)

    def _finish(self, routed: bool) -> None:
        self._done = True
        self.fleet.ended(self, routed)

    def __aiter__(self) -> FleetStream:
        return self

    async def __anext__(self) -> RequestOutput:
        import ray

        await self.start()
        if not self._ready and not self._done:
            if self._error is not None:
                self._done = True
                raise self._error
            assert self.replica is not None
            replica = self.fleet.replicas[self.replica]
            try:
                pulled = decode(await replica.handle.pull.remote(self.request_id, self.fleet.config.max_frames),
                                Pulled)
            except ray.exceptions.RayActorError as exc:
                self.fleet.replica_failed(self.replica, self.incarnation, f"the actor failed: {exc}")
                self._done = True
                raise self._lost_error() from None
            if self._error is not None:  # lost while this pull was in flight
                self._done = True
                raise self._error
            if pulled.unknown or pulled.incarnation != self.incarnation:
                self.fleet.replica_failed(self.replica, self.incarnation,
                                          f"restarted as incarnation {pulled.incarnation}")
                self._done = True
                raise self._lost_error()
            if pulled.error is not None:
                self._finish(routed=True)
                raise FleetError(f"request {self.request_id!r} on replica {self.replica}: {pulled.error}")
            self._ready.extend(pulled.frames)
            self.frames_received += len(pulled.frames)
        if not self._ready:
            raise StopAsyncIteration
        out = self._ready.popleft()
        if out.finished:
            self._final_frames += 1
            if self._final_frames == self.request.params.n:
                self._finish(routed=True)
        return out

    def __del__(self) -> None:
        # A plain `async for` left early drops the stream unfinished: cancel the request, as ``Engine`` does.
        if self.__dict__.get("_started") and not self.__dict__.get("_done", True):
            with contextlib.suppress(RuntimeError):  # no running loop: the fleet, and its replicas, are gone
                asyncio.get_running_loop().create_task(self.aclose())

    async def aclose(self) -> None:
        """Cancel the request if it has not finished (idempotent)."""
        import ray

        if self._done:
            return
        self._done = True
        if self.replica is not None and self._error is None:
            with contextlib.suppress(ray.exceptions.RayActorError):  # a dead replica has cancelled it already
                await self.fleet.replicas[self.replica].handle.cancel.remote(self.request_id)
        self.fleet.ended(self, routed=self.replica is not None and self._error is None)
