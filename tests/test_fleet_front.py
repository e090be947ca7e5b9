"""The fleet front end without a Ray cluster: the load watcher stops even when its cancel is swallowed; ``complete``
and the request checks are the engine's.

On Python < 3.12, ``asyncio.wait_for`` returns the awaited call's result instead of raising ``CancelledError`` when
the cancel lands in the same loop iteration as the call completes. The watcher polls each replica's load through
``wait_for``, so a fleet closing at that moment waited for the watcher forever (seen once in CI: every request had
finished, and ``Fleet.open``'s exit hung)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from tickloom import Engine, EngineConfig, RequestOutput, RequestRejected, SamplingParams
from tickloom.fleet.front import Fleet, FleetConfig, _Replica
from tickloom.fleet.logged_router import LoggedRouter
from tickloom.fleet.router_events import RouterConfig
from tickloom.fleet.wire import Load, Pulled, ReplicaInfo, Submit, Submitted, decode, encode
from tickloom.request import Request, joined_output

pytest.importorskip("ray")  # the watcher catches Ray's actor errors


class _Call:
    def __init__(self, make: Any) -> None:
        self.make = make

    def remote(self, *args: Any) -> Any:
        return self.make()


class _Router:
    """What the watcher and ``_close`` call on the router."""

    def report(self, load: object) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_fleet_closes_when_the_watchers_cancel_lands_as_a_load_call_completes(tmp_path: Any) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        fleet = Fleet(EngineConfig(model="stub"), FleetConfig(replicas=1, fleet_dir=str(tmp_path), load_every=0.01))
        load = encode(Load(0, 0, 0, 8))
        answered = 0

        def load_call() -> asyncio.Future[bytes]:
            # The first call completes in the same callback that closes the fleet, so the watcher's cancel arrives
            # as its wait_for is woken by the result; later calls answer at once.
            nonlocal answered
            answered += 1
            future: asyncio.Future[bytes] = loop.create_future()
            if answered == 1:
                def complete_and_close() -> None:
                    future.set_result(load)
                    closing.append(loop.create_task(fleet._close([])))
                loop.call_soon(complete_and_close)
            else:
                future.set_result(load)
            return future

        async def closed() -> None:
            return None

        handle = type("Handle", (), {"load": _Call(load_call), "close": _Call(closed)})()
        fleet.replicas = [_Replica(handle, ReplicaInfo(0, 0, 1, "here", "log", 16, 8))]
        fleet.router = _Router()  # type: ignore[assignment]
        closing: list[asyncio.Task[None]] = []
        fleet._watcher = loop.create_task(fleet._watch())
        while not closing:
            await asyncio.sleep(0.005)
        # a hang detector, not a timing bound: without the flag the close never ends (asyncio.wait cancels nothing)
        done, _ = await asyncio.wait(closing, timeout=30)
        assert done, "closing the fleet waits for a watcher that never stops"
        assert fleet._watcher.done()

    asyncio.run(main())


# -- complete: the engine's, not a copy (it kept only the last frame's logprobs, and took n > 1) ------------------
class _FakeReplica:
    """A replica's actor calls, answered from a script: each pull hands over the next batch of frames."""

    def __init__(self, batches: list[list[RequestOutput]]) -> None:
        self.batches = batches
        self.submitted: list[Submit] = []
        self.submit = _Call(self._submit)
        self.pull = _Call(self._pull)
        self.cancel = _Call(self._cancel)

    async def _submit(self, data: bytes) -> bytes:
        self.submitted.append(decode(data, Submit))
        return encode(Submitted(0))

    async def _pull(self, request_id: str, max_frames: int) -> bytes:
        return encode(Pulled(0, self.batches.pop(0)))

    async def _cancel(self, request_id: str) -> None:
        return None


class _ArgsCall(_Call):
    def remote(self, *args: Any) -> Any:
        return self.make(*args)


def _fleet_of(tmp_path: Path, replica: _FakeReplica) -> Fleet:
    fleet = Fleet(EngineConfig(model="stub"), FleetConfig(replicas=1, fleet_dir=str(tmp_path)))
    for name in ("submit", "pull", "cancel"):
        setattr(replica, name, _ArgsCall(getattr(replica, f"_{name}")))
    fleet.replicas = [_Replica(replica, ReplicaInfo(0, 0, 1, "here", "log", 16, 8))]
    fleet.router = LoggedRouter(RouterConfig.checked({"replicas": 1, "block_size": 16}), None, time.monotonic_ns)
    return fleet


def _frame(tokens: list[int], finished: bool = False, **kw: Any) -> RequestOutput:
    return RequestOutput(request_id="r", token_ids=tokens, text_delta="".join(f"<{t}>" for t in tokens),
                         logprobs=[-0.5 * t for t in tokens], top_logprobs=[{t: -0.5 * t} for t in tokens],
                         finished=finished, finish_reason="length" if finished else None, **kw)


def test_fleet_complete_joins_every_frames_logprobs_as_the_engine_does(tmp_path: Path) -> None:
    frames = [_frame([1, 2], prompt_logprobs=[None, {3: -1.0}]), _frame([3]), _frame([4, 5], finished=True)]
    replica = _FakeReplica([frames[:2], frames[2:]])

    async def main() -> RequestOutput:
        fleet = _fleet_of(tmp_path, replica)
        return await fleet.complete([3, 3, 3], SamplingParams(max_tokens=5, logprobs=0), request_id="r",
                                    deadline=5, priority=-2, cache_salt="salt")

    out = asyncio.run(main())
    assert out == joined_output(frames)
    assert out.token_ids == [1, 2, 3, 4, 5] and out.text_delta == "<1><2><3><4><5>"
    assert out.logprobs == [-0.5, -1.0, -1.5, -2.0, -2.5], "every frame's logprobs, not the last frame's alone"
    assert out.top_logprobs is not None and len(out.top_logprobs) == 5
    assert out.prompt_logprobs == [None, {3: -1.0}], "the prompt logprobs come on the first frame"
    [submit] = replica.submitted
    assert submit.request == Request(prompt=[3, 3, 3], params=SamplingParams(max_tokens=5, logprobs=0), deadline=5.0,
                                     request_id="r", priority=-2, cache_salt="salt"), "the replica gets the Request"


def test_fleet_complete_refuses_n_above_one_as_the_engine_does(tmp_path: Path) -> None:
    async def fleet_refusal() -> RequestRejected:
        fleet = _fleet_of(tmp_path, _FakeReplica([]))
        with pytest.raises(RequestRejected) as refused:
            await fleet.complete([3, 3], SamplingParams(n=2))
        return refused.value

    async def engine_refusal() -> RequestRejected:
        async with Engine.open(EngineConfig(model="stub")) as engine:
            with pytest.raises(RequestRejected) as refused:
                await engine.complete([3, 3], SamplingParams(n=2))
            return refused.value

    fleet_error, engine_error = asyncio.run(fleet_refusal()), trio.run(engine_refusal)
    assert type(fleet_error) is type(engine_error) is RequestRejected
    assert str(engine_error) == "SamplingParams.n=2: complete() returns one output; use Engine.complete_n() for n > 1"
    assert str(fleet_error) == str(engine_error).replace("Engine.", "Fleet.")


def test_fleet_checks_a_request_as_the_engine_does(tmp_path: Path) -> None:
    fleet = _fleet_of(tmp_path, _FakeReplica([]))
    for name, options in [("deadline", {"deadline": 0}), ("request_id", {"request_id": "x" * 257}),
                          ("priority", {"priority": 2**31}), ("cache_salt", {"cache_salt": "\udc00"})]:
        with pytest.raises(RequestRejected, match=name):
            fleet.generate([1], **options)
    with pytest.raises(RequestRejected, match="params must be SamplingParams"):
        fleet.generate([1], {"max_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(RequestRejected, match="prompt"):
        fleet.generate([1, -1])
    with pytest.raises(RequestRejected, match="a str or a list of token ids"):
        fleet.generate([{"role": "user", "content": "hi"}])
    first, second = fleet.generate([1]), fleet.generate([1])
    assert (first.request_id, second.request_id) == ("req-0", "req-1")
    with pytest.raises(RequestRejected, match="already in use"):
        fleet.generate([1], request_id="req-0")
