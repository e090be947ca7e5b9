"""Behavioural tests that kill mutants of the actors area (scripts/mutate.sh --area actors) that the actors' own
tests leave alive: the retire actor's groups of ``n`` choices and abandoned streams, the devices (poisoning, the
copy-out path, the bounded queue), the spill store and its actors, and the step actor (dispatch, the log, the idle
event, its statistics)."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio
import trio.testing

import tickloom.actors.spill as spill_module
import tickloom.actors.step as step_module
from tickloom.actors.device import StubDevice, ThreadDevice, without_requests
from tickloom.actors.mailbox import ChannelOverflow, Envelope, Outbox, Source
from tickloom.actors.retire import ClientStream, GroupStream, RetireActor
from tickloom.actors.spill import SpillActor, SpillStore, host_tag, owner_alive, process_start
from tickloom.actors.step import StepActor
from tickloom.engine.core import CoreConfig, SchedulerCore
from tickloom.engine.core.snapshot import encode_snapshot
from tickloom.engine.model.types import HostKV, StepResult
from tickloom.engine.outputs import RequestOutput
from tickloom.events import (
    NO_SAMPLE,
    NOT_FED,
    BindRequest,
    ClientGone,
    Command,
    DropSpill,
    EmitTokens,
    Finish,
    Input,
    Preempted,
    PrefetchSpill,
    ReleaseRequest,
    RequestArrived,
    RunStep,
    SamplingSpec,
    Shutdown,
    SnapshotRecord,
    SpillDone,
    SpillOut,
    StepDone,
    StepFailed,
    StopMatched,
    SwapIn,
    SwapInFailed,
    SwapInReady,
    TickInputs,
    TickOutputs,
    Usage,
)

# --- the retire actor: groups of n choices, abandoned streams -------------------------------------------------------


class _Letters:
    """Token i decodes to the i-th lowercase letter."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


class _Retire:
    def __init__(self, max_buffered_frames: int = 1024) -> None:
        self.reports: list[Input] = []
        self.actor = RetireActor(_Letters(), self.reports.append, max_buffered_frames, clock=lambda: 5.0)
        self.sent: dict[str, int] = {}

    def group(self, rid: str, n: int, **spec: object) -> GroupStream:
        return self.actor.open_group(rid, [f"{rid}#{i}" for i in range(n)], SamplingSpec(**spec), 2,  # type: ignore[arg-type]
                                     submitted_at=1.0)

    def tokens(self, rid: str, ids: list[int]) -> None:
        start = self.sent.get(rid, 0)
        self.sent[rid] = start + len(ids)
        self.actor.deliver_nowait([EmitTokens([rid] * len(ids), ids, list(range(start, start + len(ids))),
                                              [False] * len(ids))])

    def finish(self, rid: str, reason: str = "length") -> None:
        self.actor.deliver_nowait([Finish(rid, reason, Usage(2, 0, self.sent.get(rid, 0)), "")])  # type: ignore[arg-type]


async def _read(stream: GroupStream) -> list[RequestOutput]:
    return [frame async for frame in stream]


async def test_a_group_reads_its_choices_frames_in_arrival_order_with_their_index() -> None:
    r = _Retire()
    stream = r.group("g", 3)
    assert stream.request_id == "g" and r.actor.open_streams == 3
    r.tokens("g#1", [0])
    r.tokens("g#0", [1])
    r.tokens("g#1", [2])
    r.finish("g#1")
    r.tokens("g#2", [3])
    r.finish("g#0")
    r.finish("g#2", "stop")
    frames = await _read(stream)
    assert [(f.request_id, f.index, f.text_delta, f.finished) for f in frames] == [
        ("g", 1, "a", False), ("g", 0, "b", False), ("g", 1, "c", False), ("g", 1, "", True),
        ("g", 2, "d", False), ("g", 0, "", True), ("g", 2, "", True)]
    assert frames[-1].finish_reason == "stop" and r.actor.open_streams == 0
    assert r.reports == []


async def test_each_choice_of_a_group_reports_its_usage_and_the_prompts_logprobs() -> None:
    r = _Retire()
    stream = r.actor.open_group("g", ["g#0", "g#1"], SamplingSpec(prompt_logprobs=0), 2, submitted_at=1.0,
                                prompt_token_ids=[3, 4])
    r.actor.deliver_nowait([EmitTokens(["g#0", "g#1"], [0, 1], [0, 0], [False, False],
                                       prompt_logprobs=[[-0.5], [-0.5]])])
    r.sent.update({"g#0": 1, "g#1": 1})
    r.finish("g#0")
    r.finish("g#1")
    frames = await _read(stream)
    assert [(f.index, f.prompt_logprobs) for f in frames if not f.finished] == [
        (0, [None, {4: -0.5}]), (1, [None, {4: -0.5}])]
    finals = {f.index: f.usage for f in frames if f.finished}
    assert finals[0] is not None and finals[1] is not None
    assert finals[0].time_to_first_token_s == 4.0 and finals[1].time_to_first_token_s == 4.0
    assert finals[0].completion_tokens == 1 and finals[0].prompt_tokens == 2


async def test_a_group_waits_for_its_last_choice_and_is_woken_by_any() -> None:
    r = _Retire()
    stream = r.group("g", 2)
    got: list[tuple[int, str, bool]] = []

    async def reader() -> None:
        async for frame in stream:
            got.append((frame.index, frame.text_delta, frame.finished))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        r.tokens("g#1", [0])
        await trio.testing.wait_all_tasks_blocked()
        assert got == [(1, "a", False)]
        r.finish("g#1")
        await trio.testing.wait_all_tasks_blocked()
        assert got == [(1, "a", False), (1, "", True)], "one choice finished: the group still waits"
        r.tokens("g#0", [1])
        r.finish("g#0")
    assert got == [(1, "a", False), (1, "", True), (0, "b", False), (0, "", True)]


async def test_a_slow_group_reader_gets_each_choices_frames_coalesced() -> None:
    r = _Retire(max_buffered_frames=1)
    stream = r.group("g", 2)
    r.tokens("g#0", [0])
    r.tokens("g#1", [1])
    r.tokens("g#0", [2])
    r.tokens("g#0", [3])
    r.finish("g#1")
    r.finish("g#0")
    frames = await _read(stream)
    assert [(f.index, f.token_ids, f.text_delta, f.finished) for f in frames] == [
        (0, [0, 2, 3], "acd", True), (1, [1], "b", True)]


async def test_open_group_refuses_a_choice_id_already_open() -> None:
    r = _Retire()
    single = r.actor.open_stream("g#1", SamplingSpec(), 2, submitted_at=1.0)
    with pytest.raises(ValueError, match=r"^a stream for request 'g#1' is already open$"):
        r.group("g", 3)
    assert r.actor.open_streams == 1, "nothing of the refused group was opened"
    r.tokens("g#1", [0])
    r.finish("g#1")
    assert [f.text_delta async for f in single] == ["a", ""]


async def test_closing_a_group_reports_each_unfinished_choice_once() -> None:
    r = _Retire()
    stream = r.group("g", 3)
    r.tokens("g#0", [0])
    r.finish("g#1")
    first = await stream.__anext__()
    assert (first.index, first.text_delta) == (0, "a")
    await stream.aclose()
    stream.close_nowait()
    assert r.reports == [ClientGone("g#0"), ClientGone("g#2")]
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()  # the finished choice's final frame is dropped with the rest
    assert r.actor.open_streams == 0


async def test_a_group_left_with_async_with_cancels_its_choices() -> None:
    r = _Retire()
    async with r.group("g", 2) as stream:
        r.tokens("g#1", [0])
        async for frame in stream:
            assert frame.index == 1
            break
    assert r.reports == [ClientGone("g#0"), ClientGone("g#1")]


async def test_a_garbage_collected_group_cancels_only_if_a_choice_is_unfinished() -> None:
    r = _Retire()
    stream = r.group("g", 2)
    r.finish("g#0")
    del stream
    gc.collect()
    assert r.reports == [ClientGone("g#1")]
    done = r.group("h", 2)
    r.finish("h#0")
    r.finish("h#1")
    del done
    gc.collect()
    assert r.reports == [ClientGone("g#1")]


async def test_a_fatal_error_raises_in_a_group_at_once() -> None:
    r = _Retire()
    stream = r.group("g", 2)
    r.tokens("g#0", [0])
    error = RuntimeError("device lost")
    raised: list[BaseException] = []

    async def reader() -> None:
        try:
            async for _ in stream:
                pass
        except RuntimeError as exc:
            raised.append(exc)

    r.actor.fail_all(error)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
    assert raised == [error]
    later = r.group("h", 2)
    with pytest.raises(RuntimeError, match="device lost"):
        await later.__anext__()
    assert r.actor.open_streams == 0
    await later.aclose()
    assert r.reports == []


async def test_a_group_error_in_one_choice_raises_even_with_frames_pending() -> None:
    r = _Retire()
    stream = r.group("g", 2)
    r.tokens("g#0", [0])
    r.tokens("g#1", [1])
    stream._group.streams[1].fail(RuntimeError("only this choice"))
    with pytest.raises(RuntimeError, match="only this choice"):
        await stream.__anext__()


@pytest.mark.parametrize("layout", ["alone", "one row among others", "rows among others"])
async def test_logprobs_reach_each_stream_whatever_the_ticks_layout(layout: str) -> None:
    """A tick's columns are split by request: the request alone in the tick, one row of it among other requests'
    rows, or several rows among others. Each stream gets its own tokens, logprobs, top alternatives (only if it
    asked for them), its prompt's logprobs with output 0, and the tick's time."""
    r = _Retire()
    clock = iter([5.0, 6.0, 8.0, 8.0])
    r.actor._clock = lambda: next(clock)
    asks = r.actor.open_stream("x", SamplingSpec(logprobs=1, prompt_logprobs=0), 2, submitted_at=1.0,
                               prompt_token_ids=[3, 4])
    plain = r.actor.open_stream("y", SamplingSpec(), 2, submitted_at=1.0, prompt_token_ids=[3, 4])
    rows = {"alone": ["x", "x"], "one row among others": ["y", "x", "y"],
            "rows among others": ["x", "y", "x"]}[layout]
    xs = [i for i, rid in enumerate(rows) if rid == "x"]
    indices = [0] * len(rows)
    for rid in ("x", "y"):
        for k, i in enumerate([i for i, q in enumerate(rows) if q == rid]):
            indices[i] = k
    r.actor.deliver_nowait([EmitTokens(
        rows, [10 + i for i in range(len(rows))], indices, [False] * len(rows), [-1.0 - i for i in range(len(rows))],
        [[20 + i] for i in range(len(rows))], [[-0.5 - i] for i in range(len(rows))],
        [[-0.25] if indices[i] == 0 else [] for i in range(len(rows))])])
    r.sent = {"x": len(xs), "y": len(rows) - len(xs)}
    r.actor.deliver_nowait([EmitTokens(["x"], [12 + len(rows)], [len(xs)], [False], [-7.0], [[30]], [[-0.1]])])
    r.sent["x"] += 1
    r.finish("x")
    if "y" in rows:
        r.finish("y")
    first, second, last = [f async for f in asks]
    assert first.token_ids == [10 + i for i in xs] and first.logprobs == [-1.0 - i for i in xs]
    assert first.top_logprobs == [{20 + i: -0.5 - i, 10 + i: -1.0 - i} for i in xs]
    assert first.prompt_logprobs == [None, {4: -0.25}] and second.prompt_logprobs is None
    assert second.top_logprobs == [{30: -0.1, 12 + len(rows): -7.0}]
    assert last.usage is not None and last.usage.time_to_first_token_s == 4.0
    assert last.usage.mean_inter_token_latency_s == pytest.approx(1.0 / len(xs))
    if "y" in rows:
        others = [f async for f in plain]
        assert others[0].logprobs == [-1.0 - i for i, rid in enumerate(rows) if rid == "y"]
        assert others[0].top_logprobs is None and others[0].prompt_logprobs is None, "y asked for neither"


async def test_a_closed_stream_is_no_longer_open() -> None:
    r = _Retire()
    stream = r.actor.open_stream("x", SamplingSpec(), 2, submitted_at=1.0)
    await stream.aclose()
    assert r.actor.open_streams == 0 and r.reports == [ClientGone("x")]
    again = r.actor.open_stream("x", SamplingSpec(), 2, submitted_at=1.0)
    stream.close_nowait()  # the old stream's close leaves the new one open
    assert r.actor.open_streams == 1 and r.reports == [ClientGone("x")]
    await again.aclose()


async def test_an_abandoned_stream_ends_without_a_report_and_frees_its_id() -> None:
    r = _Retire()
    stream = r.actor.open_stream("x", SamplingSpec(), 2, submitted_at=1.0)
    r.tokens("x", [0])
    got: list[str] = []

    async def reader(client: ClientStream) -> None:
        async for frame in client:
            got.append(frame.text_delta)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader, stream)
        await trio.testing.wait_all_tasks_blocked()
        r.tokens("x", [1])
        await trio.testing.wait_all_tasks_blocked()
        r.actor.abandon("x")  # the reader wakes and ends
    assert got == ["a", "b"] and r.actor.open_streams == 0
    r.tokens("x", [2])  # nothing to deliver to
    r.actor.abandon("x")
    r.actor.abandon("never-opened")
    del stream
    gc.collect()
    assert r.reports == [], "an abandoned request never reached the core: nothing to cancel"
    again = r.actor.open_stream("x", SamplingSpec(), 2, submitted_at=1.0)
    r.sent["x"] = 0
    r.tokens("x", [3])
    r.finish("x")
    assert [f.text_delta async for f in again] == ["d", ""]


async def test_an_abandoned_stream_drops_its_pending_frames() -> None:
    r = _Retire()
    stream = r.actor.open_stream("x", SamplingSpec(), 2, submitted_at=1.0)
    r.tokens("x", [0, 1])
    r.actor.abandon("x")
    assert [f async for f in stream] == []


async def test_stop_matches_in_a_group_are_reported_per_choice() -> None:
    r = _Retire()
    stream = r.group("g", 2, stop=["b"])
    r.actor.deliver_nowait([EmitTokens(["g#0", "g#1", "g#1"], [0, 0, 1], [0, 0, 1], [False] * 3)])
    assert r.reports == [StopMatched("g#1", 1)]
    await stream.aclose()


# --- the thread device ----------------------------------------------------------------------------------------------



class _Recorder:
    """An executor that records every call; each sampling row of a step samples 100 + its sample index."""

    def __init__(self, fail: dict[str, Exception] | None = None) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.fail = fail or {}

    def _maybe_fail(self, what: str) -> None:
        if what in self.fail:
            raise self.fail[what]

    def bind(self, command: BindRequest) -> None:
        self.calls.append(("bind", command))

    def release(self, request_id: str) -> None:
        self.calls.append(("release", request_id))

    def run_step(self, step: RunStep) -> StepResult:
        self.calls.append(("step", step.step_id, list(step.request_ids)))
        self._maybe_fail(f"step {step.step_id}")
        picks = [k for k in step.sample_indices if k != NO_SAMPLE]
        first = [k == 0 for k in picks]  # the row sampling output 0 carries the prompt's logprobs
        return StepResult([100 + k for k in picks], [-float(k) for k in picks], [[100 + k, 7] for k in picks],
                          [[-float(k), -9.0] for k in picks], [[-0.5] if f else [] for f in first],
                          [[[1, 2]] if f else [] for f in first], [[[-0.5, -1.5]] if f else [] for f in first])

    def copy_out(self, request_id: str, block_ids: list[int], num_tokens: int) -> HostKV:
        self.calls.append(("copy_out", request_id, block_ids, num_tokens))
        self._maybe_fail(f"copy_out {request_id}")
        return HostKV(None, None, num_tokens)

    def copy_in(self, request_id: str, block_ids: list[int], host_kv: HostKV) -> None:
        self.calls.append(("copy_in", request_id, block_ids, host_kv.num_tokens))
        self._maybe_fail(f"copy_in {request_id}")


def _step(step_id: int, rids: list[str], samples: list[int]) -> RunStep:
    n = len(rids)
    return RunStep(step_id, rids, [0] * n, [1] * n, [5] * n, [NOT_FED] * n, samples, [0] * n, [0] * n, [])


class _Device:
    """A ``ThreadDevice`` on a recording executor, with a spill actor over a host-only store."""

    def __init__(self, fail: dict[str, Exception] | None = None, fail_steps: frozenset[int] = frozenset()) -> None:
        self.executor = _Recorder(fail)
        self.send, self.receive = trio.open_memory_channel[Envelope](64)
        self.store = SpillStore(None, host_bytes=1 << 20)
        self.spill = SpillActor(self.store, Outbox(Source.SPILL, self.send.clone()), 16)
        self.device = ThreadDevice(self.executor, Outbox(Source.DEVICE, self.send), self.spill, 16,
                                   fail_steps=fail_steps)

    async def run(self, commands: list[Command], replies: int) -> list[Input]:
        got: list[Input] = []
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.device.run)
                nursery.start_soon(self.spill.run)
                for command in commands:
                    if isinstance(command, SpillOut):
                        self.spill.submit_nowait(command)
                    self.device.submit_nowait(command)
                for _ in range(replies):
                    got.append((await self.receive.receive()).msg)
                await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
        with pytest.raises(trio.WouldBlock):
            self.receive.receive_nowait()  # nothing more than expected was reported
        return got


async def test_the_thread_device_runs_commands_in_order_and_reports_each_step() -> None:
    d = _Device()
    spec = SamplingSpec(max_tokens=3)
    step = RunStep(4, ["a", "b", "c"], [0, 0, 2], [2, 1, 1], [5, 6, 7, 8], [NOT_FED, NOT_FED, 3], [0, NO_SAMPLE, 2],
                   [0, 0, 0], [1, 1, 0], [10, 11])
    [done] = await d.run([BindRequest("a", spec, 11, 2, [9, 8], [5, 6]), step, ReleaseRequest("a")], 1)
    assert d.executor.calls == [("bind", BindRequest("a", spec, 11, 2, [9, 8], [5, 6])), ("step", 4, ["a", "b", "c"]),
                                ("release", "a")]
    assert isinstance(done, StepDone)
    assert (done.step_id, done.request_ids, done.token_ids) == (4, ["a", "c"], [100, 102]), "sampling rows only"
    assert done.logprobs == [-0.0, -2.0] and done.top_token_ids == [[100, 7], [102, 7]]
    assert done.top_logprobs == [[-0.0, -9.0], [-2.0, -9.0]]
    assert done.prompt_logprobs == [[-0.5], []] and done.prompt_top_token_ids == [[[1, 2]], []]
    assert done.prompt_top_logprobs == [[[-0.5, -1.5]], []]
    assert done.step_time_ns >= 0 and d.device.busy_ns == done.step_time_ns


async def test_a_failed_step_poisons_its_requests_until_released() -> None:
    d = _Device(fail={"step 1": ValueError("bad table")})
    wall = time.perf_counter_ns()
    got = await d.run([_step(1, ["a", "b"], [0, 0]), _step(2, ["a", "c", "b"], [1, 0, 1]), ReleaseRequest("a"),
                       _step(3, ["a", "b"], [0, 2]), _step(4, ["b"], [3])], 4)
    assert got[0] == StepFailed(1, "ValueError: bad table")
    assert isinstance(got[1], StepDone) and got[1].request_ids == ["a", "c", "b"]
    assert got[1].token_ids == [0, 100, 0] and got[1].logprobs == [0.0, -0.0, 0.0], "placeholders for a and b"
    assert got[1].top_token_ids == [[], [100, 7], []] and got[1].top_logprobs == [[], [-0.0, -9.0], []]
    assert got[1].prompt_logprobs == [[], [-0.5], []] and got[1].prompt_top_token_ids == [[], [[1, 2]], []]
    assert got[1].prompt_top_logprobs == [[], [[-0.5, -1.5]], []]
    assert isinstance(got[2], StepDone) and got[2].token_ids == [100, 0], "a was released (and bound again)"
    assert isinstance(got[3], StepDone) and got[3].token_ids == [0] and got[3].logprobs is None, \
        "a step of poisoned rows alone never reaches the executor"
    steps = [c for c in d.executor.calls if c[0] == "step"]
    assert steps == [("step", 1, ["a", "b"]), ("step", 2, ["c"]), ("step", 3, ["a"])]
    times = [m.step_time_ns for m in got if isinstance(m, StepDone)]
    assert d.device.busy_ns == sum(times) and all(0 <= t <= time.perf_counter_ns() - wall for t in times), \
        "each step's time is part of the test's own"


async def test_an_injected_fault_fails_only_its_step_before_the_executor() -> None:
    d = _Device(fail_steps=frozenset({2}))
    got = await d.run([_step(1, ["a"], [0]), _step(2, ["a", "b"], [1, 0]), _step(3, ["c"], [0])], 3)
    assert isinstance(got[0], StepDone) and got[0].token_ids == [100]
    assert got[1] == StepFailed(2, "RuntimeError: injected device fault")
    assert isinstance(got[2], StepDone) and got[2].token_ids == [100]
    assert [c[1] for c in d.executor.calls if c[0] == "step"] == [1, 3]
    assert d.device.fail_steps == frozenset({2})


async def test_a_copy_out_goes_to_the_spill_actor_and_its_failure_is_reported() -> None:
    d = _Device(fail={"copy_out y": OSError("device lost")})
    got = await d.run([SpillOut("x", [3, 4], 40), SpillOut("y", [5], 9)], 2)
    assert got == [SpillDone("x", True, "", 0), SpillDone("y", False, "copy out failed: OSError: device lost")]
    assert d.executor.calls == [("copy_out", "x", [3, 4], 40), ("copy_out", "y", [5], 9)]
    assert d.store.held == 1 and d.store.take("x").num_tokens == 40


async def test_a_swap_in_copies_the_host_copy_back_and_a_failed_one_poisons() -> None:
    d = _Device(fail={"copy_in y": RuntimeError("copy failed")})
    d.store.store("x", HostKV(None, None, 24))
    d.store.store("y", HostKV(None, None, 8))
    got = await d.run([SwapIn("x", [7, 8], 24), SwapIn("y", [9], 8), _step(5, ["x", "y"], [3, 1])], 2)
    assert got[0] == SwapInFailed("y", "RuntimeError: copy failed")
    assert isinstance(got[1], StepDone) and got[1].token_ids == [103, 0]
    assert d.executor.calls == [("copy_in", "x", [7, 8], 24), ("copy_in", "y", [9], 8), ("step", 5, ["x"])]
    assert d.store.held == 0, "both host copies were taken"


async def test_the_device_queue_is_bounded_and_stopping_needs_room() -> None:
    d = _Device()
    device = ThreadDevice(d.executor, Outbox(Source.DEVICE, d.send), None, 2)
    device.submit_nowait(ReleaseRequest("a"))
    device.stop_nowait()
    with pytest.raises(ChannelOverflow, match=r"^device queue overflowed its bound of 2 commands$"):
        device.submit_nowait(ReleaseRequest("b"))
    with pytest.raises(ChannelOverflow, match=r"^device queue is full; cannot stop it$"):
        device.stop_nowait()
    with trio.fail_after(30):
        await device.run()  # runs the release, then stops
    assert d.executor.calls == [("release", "a")]
    assert device.busy_ns == 0


async def test_a_cancelled_device_stops_its_thread_after_the_running_command() -> None:
    d = _Device()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(d.device.run)
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    d.device.submit_nowait(ReleaseRequest("late"))
    await trio.sleep(0.05)
    assert d.executor.calls == [], "the thread has exited"


# --- the spill store: owners, files, the directories it makes --------------------------------------------------------




def test_the_host_tag_is_a_hash_of_the_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spill_module.socket, "gethostname", lambda: "alpha")
    alpha = host_tag()
    monkeypatch.setattr(spill_module.socket, "gethostname", lambda: "beta")
    assert host_tag() != alpha and len(alpha) == 8 and int(alpha, 16) >= 0
    monkeypatch.setattr(spill_module.socket, "gethostname", lambda: "alpha")
    assert host_tag() == alpha


def _uptime_ticks() -> float:
    return float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_a_process_start_is_its_start_time_in_ticks_even_with_a_parenthesis_in_its_name() -> None:
    """The start time is field 22 of /proc/PID/stat; the process's name before it may hold ") " and spaces."""
    rename = ("import ctypes, sys, time; ctypes.CDLL(None).prctl(15, b'x) 1 2 (3)', 0, 0, 0); "
              "print(flush=True); time.sleep(60)")
    before = _uptime_ticks()
    child = subprocess.Popen([sys.executable, "-c", rename], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"\n"  # renamed
        after = _uptime_ticks()
        assert b"x) 1 2 (3)" in Path(f"/proc/{child.pid}/stat").read_bytes()
        started = process_start(child.pid)
        assert started is not None and before - 1 <= started <= after + 1
        me = process_start(os.getpid())
        assert me is not None and me <= started
    finally:
        child.kill()
        child.wait()
    assert process_start(child.pid) is None


def test_without_proc_a_process_exists_with_an_unknown_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where there is no /proc (not Linux) a live process's start is 0, unknown; a live owner is then alive
    whatever start its directory names."""
    monkeypatch.setattr(spill_module, "_PROC", False)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_start(os.getpid()) == 0
    assert process_start(child.pid) is None
    assert owner_alive(os.getpid(), 12345) and not owner_alive(child.pid, 12345)
    assert spill_module._owner_prefix() == f"tickloom-spill-{host_tag()}-{os.getpid()}-0-"


def test_an_owner_is_alive_only_with_its_start_time_or_an_unknown_one() -> None:
    me = process_start(os.getpid())
    assert me is not None and me > 0
    assert owner_alive(os.getpid(), me) and owner_alive(os.getpid(), 0)
    assert not owner_alive(os.getpid(), me + 1), "a reused pid"


def test_disk_copies_of_two_requests_are_two_files(tmp_path: Path) -> None:
    import torch

    store = SpillStore(tmp_path, host_bytes=0)
    kvs = {rid: HostKV(torch.full((1, 1, 2, 1, 2), float(i)), torch.full((1, 1, 2, 1, 2), -float(i)), 10 + i)
           for i, rid in enumerate(["r1", "r2", "../r3"])}
    for rid, kv in kvs.items():
        store.store(rid, kv)
    assert store.directory is not None and len(list(store.directory.iterdir())) == 3, "inside the directory"
    for rid, kv in kvs.items():
        store.load(rid)
        back = store.take(rid)
        assert back.num_tokens == kv.num_tokens and back.k is not None and kv.k is not None
        assert torch.equal(back.k, kv.k)
    store.close()


def test_the_disk_format_round_trips_a_copy_without_tensors() -> None:
    back = spill_module._deserialize(spill_module._serialize(HostKV(None, None, 37)))
    assert (back.k, back.v, back.num_tokens) == (None, None, 37)


def test_discard_removes_exactly_the_directories_the_store_made(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    store = SpillStore(tmp_path / "a" / "b" / "c", host_bytes=0)
    assert (tmp_path / "a" / "b" / "c").is_dir()
    store.discard()
    assert [p.name for p in tmp_path.iterdir()] == ["a"] and not list((tmp_path / "a").iterdir())
    kept = SpillStore(tmp_path / "x" / "y", host_bytes=0)
    (tmp_path / "x" / "theirs").write_bytes(b"someone else's")
    kept.discard()
    kept.discard()
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["theirs"], "y removed, x kept (not empty)"


def test_a_store_that_cannot_start_removes_what_it_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_bytes(b"not a directory")
    with pytest.raises(OSError):
        SpillStore(tmp_path / "file" / "spill", host_bytes=0)

    def full(**_: object) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spill_module.tempfile, "mkdtemp", full)
    with pytest.raises(OSError, match="No space left"):
        SpillStore(tmp_path / "made" / "here", host_bytes=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"], "the directories it made are gone"


def test_a_cut_step_keeps_its_id_and_the_kept_rows_blocks_in_order() -> None:
    step = RunStep(9, ["a", "dead", "b", "c"], [0, 0, 0, 0], [1, 1, 1, 1], [1, 2, 3, 4], [NOT_FED] * 4, [0, 0, 0, 0],
                   [0, 0, 0, 0], [2, 1, 2, 1], [10, 11, 20, 30, 31, 40])
    cut = without_requests(step, {"dead"})
    assert cut.step_id == 9 and cut.request_ids == ["a", "b", "c"] and cut.token_ids == [1, 3, 4]
    assert cut.num_new_blocks == [2, 2, 1] and cut.new_block_ids == [10, 11, 30, 31, 40]


async def test_a_step_with_no_rows_reports_no_tokens_without_the_executor() -> None:
    d = _Device()
    [done] = await d.run([RunStep(3, [], [], [], [], [], [], [], [], [])], 1)
    assert done == StepDone(3, [], [], done.step_time_ns) and d.executor.calls == []


@pytest.mark.parametrize("command", [SpillOut("r", [1], 16), SwapIn("r", [1], 16)])
async def test_a_device_without_a_spill_store_refuses_spill_commands(command: Command) -> None:
    executor = _Recorder()
    send, _receive = trio.open_memory_channel[Envelope](4)
    device = ThreadDevice(executor, Outbox(Source.DEVICE, send), None, 4)
    device.submit_nowait(command)
    name = type(command).__name__
    errors: list[str] = []
    try:
        with trio.fail_after(30):
            await device.run()
    except* AssertionError as group:
        errors += [str(e) for e in group.exceptions]
    assert errors == [f"{name} without a spill store"]
    assert executor.calls == []


# --- the stub device ------------------------------------------------------------------------------------------------


async def test_the_stub_devices_token_is_the_token_its_step_samples(
        autojump_clock: trio.testing.MockClock) -> None:
    send, receive = trio.open_memory_channel[Envelope](16)
    device = StubDevice(Outbox(Source.DEVICE, send), None, 8, vocab_size=50, step_time=lambda _s: 0.25,
                        avoid=(3, 4), script={"b": {1: 42}})
    spec = SamplingSpec(max_tokens=4, temperature=1.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(device.run)
        device.submit_nowait(BindRequest("a", spec, 5, 2, [], [7, 8]))
        device.submit_nowait(BindRequest("b", spec, 6, 2, [], [7, 9]))
        device.submit_nowait(RunStep(0, ["a", "b"], [0, 0], [2, 2], [7, 8, 7, 9], [NOT_FED] * 2, [0, 0], [0, 0],
                                     [1, 1], [1, 2]))
        device.submit_nowait(RunStep(1, ["a", "b"], [2, 2], [1, 1], [0, 0], [0, 0], [1, 1], [1, 1], [0, 0], []))
        first = (await receive.receive()).msg
        second = (await receive.receive()).msg
        nursery.cancel_scope.cancel()
    assert isinstance(first, StepDone) and isinstance(second, StepDone)
    assert first.token_ids == [device.token("a", 0), device.token("b", 0)]
    assert second.token_ids == [device.token("a", 1), 42] and device.token("b", 1) == 42
    assert first.step_time_ns == 250_000_000 and device.busy_ns == 500_000_000
    assert not set(first.token_ids + second.token_ids[:1]) & {3, 4}, "the avoided ids are never sampled"
    assert all(0 <= t < 50 for t in first.token_ids + second.token_ids)
    assert device.token("a", 0) != device.token("a", 1) or device.token("a", 2) != device.token("a", 0)


# --- the step actor -------------------------------------------------------------------------------------------------


CORE = CoreConfig(num_blocks=24, block_size=8, max_batch_size=6, max_seq_len=96, max_prefill_tokens=32,
                  max_batch_tokens=48, pipeline_depth=2, spill_enabled=True, preempt_immunity_tokens=2,
                  eos_token_ids=(1,), vocab_size=400)


class _Journal:
    """Every actor's side of the step actor, writing what it is handed into one list, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []
        self.steps: list[RunStep] = []
        self.writer = self
        self.outputs: list[TickOutputs] = []
        self.snapshots: list[SnapshotRecord] = []

    # the device, deadline, spill and swap-in actors
    def submit_nowait(self, command: Command) -> None:
        if isinstance(command, RunStep):
            self.steps.append(command)
        self.events.append(("submit", type(command).__name__))

    # the retire actor
    def deliver_nowait(self, commands: list[Command]) -> None:
        self.events.append(("deliver", *[type(c).__name__ for c in commands]))

    # the log actor and its writer
    def append_tick(self, inputs: TickInputs, outputs: TickOutputs, encoded: bytes | None = None) -> int:
        self.outputs.append(outputs)
        self.events.append(("tick", inputs.tick, inputs.now_ns, *[type(i).__name__ for i in inputs.inputs]))
        return 100

    def append_snapshot(self, snapshot: SnapshotRecord) -> int:
        self.snapshots.append(snapshot)
        self.events.append(("snapshot", snapshot.tick))
        return 7

    async def sync(self) -> None:
        self.events.append(("sync",))

    def flush(self) -> None:
        self.events.append(("flush",))

    def flush_if_large(self) -> None:
        self.events.append(("flush_if_large",))


class _Clock:
    """A thread CPU clock that advances 1000 ns per reading."""

    def __init__(self) -> None:
        self.now = 0

    def thread_time_ns(self) -> int:
        self.now += 1000
        return self.now


def _actor(journal: _Journal, *, log: bool = True, **kw: object) -> StepActor:
    _send, receive = trio.open_memory_channel[Envelope](8)
    return StepActor(SchedulerCore(CORE), receive, device=journal, deadlines=journal, retire=journal,  # type: ignore[arg-type]
                     spill=journal, swap_in=journal, log=journal if log else None, **kw)  # type: ignore[arg-type]


def _arrival(rid: str, max_tokens: int = 2) -> RequestArrived:
    return RequestArrived(rid, [5, 6, 7], SamplingSpec(max_tokens=max_tokens), seed=3)


async def test_each_tick_is_logged_before_its_tokens_reach_a_client(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(step_module, "time", clock)
    j = _Journal()
    now = iter(range(1000, 10**6, 1000))
    actor = _actor(j, clock_ns=lambda: next(now))
    assert await actor.run_tick([_arrival("r")]) is True, "run ahead: the pipeline has room for a second step"
    assert await actor.run_tick([]) is False
    [s0, s1] = j.steps
    await actor.run_tick([StepDone(s0.step_id, ["r"], [9])])
    await actor.run_tick([StepDone(s1.step_id, ["r"], [10])])
    ticks = [e for e in j.events if e[0] == "tick"]
    assert ticks == [("tick", 0, 1000, "RequestArrived"), ("tick", 1, 2000), ("tick", 2, 3000, "StepDone"),
                     ("tick", 3, 4000, "StepDone")]
    assert actor.tick == 4 and actor.stats.ticks == 4
    # ticks 0 and 1: nothing for a client, the log's own flush policy; ticks 2 and 3: written out first
    before_tokens = j.events[:j.events.index(ticks[2])]
    assert before_tokens.count(("flush_if_large",)) == 2 and ("flush",) not in before_tokens
    for tick in (ticks[2], ticks[3]):
        rest = j.events[j.events.index(tick) + 1:]
        deliver = next(i for i, e in enumerate(rest) if e[0] == "deliver")
        assert rest[deliver - 1] == ("flush",), "the frame is handed to the OS just before the delivery"
        assert all(e[0] == "submit" for e in rest[:deliver - 1]), "the other commands left first"
    assert [e for e in j.events if e[0] == "deliver"] == [("deliver", "EmitTokens"),
                                                            ("deliver", "EmitTokens", "Finish")]
    assert ("flush_if_large",) not in j.events[j.events.index(ticks[2]):]
    stats = actor.stats
    assert (stats.steps, stats.rows, stats.tokens) == (2, 2, 2)
    assert stats.log_bytes == 400 and stats.log_ns == 1000 * (4 + 2), "4 appends and 2 flushes for clients"
    assert (stats.preemptions, stats.swaps) == (0, 0)
    assert ("sync",) not in j.events and ("snapshot", 1) not in j.events


async def test_a_snapshot_every_n_ticks_and_an_fsync_each_tick_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_module, "time", _Clock())
    j = _Journal()
    actor = _actor(j, fsync="tick", snapshot_every=2)
    await actor.run_tick([_arrival("r", 6)])
    assert j.snapshots == []
    await actor.run_tick([])
    [snapshot] = j.snapshots
    assert snapshot.tick == 1 and snapshot.digest == j.outputs[1].digest
    assert snapshot.state == encode_snapshot(actor.core.snapshot())
    await actor.run_tick([])
    await actor.run_tick([])
    assert [s.tick for s in j.snapshots] == [1, 3]
    assert [e[0] for e in j.events if e[0] in ("tick", "snapshot", "sync")] == [
        "tick", "sync", "tick", "snapshot", "sync", "tick", "sync", "tick", "snapshot", "sync"]
    assert actor.stats.log_bytes == 4 * 100 + 2 * 7 and actor.stats.log_ns == 4 * 1000


async def test_without_a_log_nothing_is_flushed_and_ticks_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_module, "time", _Clock())
    j = _Journal()
    actor = _actor(j, log=False, fsync="tick", snapshot_every=1)
    await actor.run_tick([_arrival("r", 1)])
    [step] = j.steps
    await actor.run_tick([StepDone(step.step_id, ["r"], [9])])
    assert [e for e in j.events if e[0] not in ("submit", "deliver")] == []
    assert ("deliver", "EmitTokens", "Finish") in j.events
    assert actor.stats.log_ns == 0 and actor.stats.log_bytes == 0 and actor.stats.ticks == 2


async def test_the_default_clock_is_trio_time_in_nanoseconds(autojump_clock: trio.testing.MockClock) -> None:
    j = _Journal()
    actor = _actor(j)
    await trio.sleep(2.5)
    await actor.run_tick([])
    assert j.events[0] == ("tick", 0, int(trio.current_time() * 1e9)) and trio.current_time() >= 2.5


async def test_idle_is_set_exactly_while_no_request_is_live() -> None:
    j = _Journal()
    actor = _actor(j)
    assert not actor.idle.is_set()
    await actor.run_tick([])
    first = actor.idle
    assert first.is_set()
    await actor.run_tick([_arrival("r", 1)])
    assert first.is_set() and not actor.idle.is_set(), "a fresh event: the old one's waiters were woken"
    busy = actor.idle
    await actor.run_tick([])
    assert actor.idle is busy and not busy.is_set()
    await actor.run_tick([StepDone(j.steps[0].step_id, ["r"], [9])])
    assert actor.idle is busy and busy.is_set()


async def test_the_run_loop_sorts_a_batch_ticks_again_when_asked_and_reports_shutdown(
        autojump_clock: trio.testing.MockClock) -> None:
    j = _Journal()
    send, receive = trio.open_memory_channel[Envelope](8)
    actor = StepActor(SchedulerCore(CORE), receive, device=j, deadlines=j, retire=j, spill=j, swap_in=j,  # type: ignore[arg-type]
                      log=j)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        await trio.testing.wait_all_tasks_blocked()
        assert j.events == [], "no input, no tick"
        send.send_nowait(Envelope(int(Source.RETIRE), 1, _arrival("late")))
        send.send_nowait(Envelope(int(Source.CLIENT), 2, _arrival("b")))
        send.send_nowait(Envelope(int(Source.CLIENT), 1, _arrival("a")))
        await trio.testing.wait_all_tasks_blocked()
        ticks = [e for e in j.events if e[0] == "tick"]
        assert [t[3:] for t in ticks] == [("RequestArrived",) * 3, ()], "one batch, then a tick of its own"
        assert [o.commands[0].request_id for o in j.outputs[:1]] == ["a"]  # type: ignore[attr-defined]
        assert not actor.shut_down.is_set()
        send.send_nowait(Envelope(int(Source.CLIENT), 3, Shutdown()))
        await trio.testing.wait_all_tasks_blocked()
        assert actor.shut_down.is_set()
        nursery.cancel_scope.cancel()


async def test_preemptions_and_swaps_are_counted() -> None:
    j = _Journal()
    actor = _actor(j)
    actor.dispatch([Preempted("a", "swap"), Preempted("b", "recompute"), Preempted("c", "swap")])
    assert (actor.stats.preemptions, actor.stats.swaps) == (3, 2)


# --- the spill store's tiers and the spill actor --------------------------------------------------------------------


def _sized(n: int, seed: int) -> HostKV:
    import torch

    return HostKV(torch.full((n,), float(seed)), torch.full((n,), -float(seed)), seed)


@pytest.mark.parametrize("seed", range(6))
def test_the_tiers_follow_the_host_byte_budget(tmp_path: Path, seed: int) -> None:
    """Random stores, loads, takes and drops against a model of the two tiers: a copy stays in the host tier while
    the budget allows (a copy that fits exactly too), a copy read back from disk counts against it, and what leaves
    the host tier frees its bytes."""
    import random

    rng = random.Random(seed)
    store = SpillStore(tmp_path, host_bytes=4 * 64)
    host: dict[str, int] = {}
    disk: set[str] = set()
    spilled = disk_bytes = 0
    sizes: dict[str, int] = {}
    for i in range(40):
        op = rng.choice(["store", "store", "load", "take", "drop"])
        if op == "store":
            rid, kv = f"r{i}", _sized(rng.choice([8, 16, 32]), i)
            size = kv.nbytes()
            assert store.store(rid, kv) == size
            sizes[rid] = size
            spilled += size
            if sum(host.values()) + size <= 4 * 64:
                host[rid] = size
            else:
                disk.add(rid)
                disk_bytes += len(spill_module._serialize(kv))
        elif op == "load" and disk - host.keys():
            rid = rng.choice(sorted(disk - host.keys()))
            store.load(rid)
            host[rid] = sizes[rid]
        elif op == "take" and host:
            rid = rng.choice(sorted(host))
            assert store.take(rid).nbytes() == host.pop(rid)
        elif op == "drop" and host.keys() | disk:
            rid = rng.choice(sorted(host.keys() | disk))
            store.drop(rid)
            host.pop(rid, None)
            disk.discard(rid)
        assert store.directory is not None and len(list(store.directory.iterdir())) == len(disk)
        assert store.held == len(host.keys() | disk)
        assert (store.spilled_bytes, store.disk_bytes) == (spilled, disk_bytes)
    store.close()


def test_the_host_tier_alone_refuses_a_copy_past_its_budget_naming_both_sizes() -> None:
    store = SpillStore(None, host_bytes=128)
    store.store("a", _sized(8, 1))  # 64 bytes
    store.store("b", _sized(8, 2))  # exactly full
    with pytest.raises(OSError) as info:
        store.store("c", _sized(1, 3))
    assert str(info.value) == ("host spill tier full (128 + 8 > 128 bytes) and no spill directory is configured")
    store.take("a")
    store.store("c", _sized(8, 3))
    assert store.held == 2 and store.spilled_bytes == 192


def test_loading_an_unknown_copy_names_the_request(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, host_bytes=0)
    with pytest.raises(KeyError) as info:
        store.load("gone")
    assert info.value.args == ("no spilled KV for 'gone'",)
    store.close()


def test_a_spill_file_removed_behind_the_stores_back_is_no_error(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, host_bytes=0)
    store.store("a", _sized(4, 1))
    store.store("b", _sized(4, 2))
    assert store.directory is not None
    for path in store.directory.iterdir():
        path.unlink()  # a temporary-file cleaner
    store.drop("a")
    store.close()
    assert not tmp_path.joinpath(store.directory.name).exists()


def test_a_directory_made_by_someone_else_meanwhile_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the store's look and its mkdir, another process makes the same directory: it is theirs, so the
    store goes on below it, and a failed start leaves it."""
    theirs = tmp_path / "theirs"
    real = os.path.lexists

    def racing(path: object) -> bool:
        if Path(str(path)) == theirs and not real(theirs):
            theirs.mkdir()  # made at the same moment
            return False
        return real(path)  # type: ignore[arg-type]

    monkeypatch.setattr(spill_module.os.path, "lexists", racing)
    store = SpillStore(theirs / "mine", host_bytes=0)
    store.discard()
    assert theirs.is_dir() and not (theirs / "mine").exists()
    blocked = tmp_path / "blocked"

    def file_meanwhile(path: object) -> bool:
        if Path(str(path)) == blocked and not real(blocked):
            blocked.write_bytes(b"a file")
            return False
        return real(path)  # type: ignore[arg-type]

    monkeypatch.setattr(spill_module.os.path, "lexists", file_meanwhile)
    with pytest.raises(FileExistsError):
        SpillStore(blocked / "mine", host_bytes=0)
    assert blocked.read_bytes() == b"a file"


async def test_the_spill_actor_reports_injected_write_errors_and_is_bounded(
        autojump_clock: trio.testing.MockClock) -> None:
    send, receive = trio.open_memory_channel[Envelope](16)
    store = SpillStore(None, host_bytes=1 << 20)
    spill = SpillActor(store, Outbox(Source.SPILL, send), 2,
                       fault=lambda rid: "disk on fire" if rid == "bad" else None)
    spill.submit_nowait(SpillOut("ok", [1], 16))
    spill.submit_nowait(SpillOut("bad", [2], 16))
    with pytest.raises(ChannelOverflow, match=r"^spill actor overflowed its bound of 2$"):
        spill.accept_nowait("ok", _sized(4, 1))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(spill.run)
        await trio.testing.wait_all_tasks_blocked()
        spill.accept_nowait("ok", _sized(4, 1))
        spill.accept_nowait("bad", _sized(4, 2))
        got = [(await receive.receive()).msg, (await receive.receive()).msg]
        nursery.cancel_scope.cancel()
    assert got == [SpillDone("ok", True, "", 32), SpillDone("bad", False, "spill write failed: disk on fire")]
    assert store.held == 1


async def test_a_request_id_used_again_after_its_drop_spills_normally(autojump_clock: trio.testing.MockClock) -> None:
    """A client may reuse a request id once the request has ended: the earlier drop, which overtook its copy, must
    not discard the new request's copy."""
    send, receive = trio.open_memory_channel[Envelope](16)
    store = SpillStore(None, host_bytes=1 << 20)
    spill = SpillActor(store, Outbox(Source.SPILL, send), 16)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(spill.run)
        spill.submit_nowait(SpillOut("r", [1], 16))
        spill.submit_nowait(DropSpill("r"))
        spill.accept_nowait("r", _sized(4, 1))  # discarded: the request ended
        spill.submit_nowait(SpillOut("r", [2], 16))  # the id, used again by a new request
        spill.accept_nowait("r", _sized(4, 2))
        got = (await receive.receive()).msg
        nursery.cancel_scope.cancel()
    assert got == SpillDone("r", True, "", 32) and store.take("r").num_tokens == 2


# --- the stub device's rules: poisoning, tables, spills ----------------------------------------------------------


def _row_step(step_id: int, rids: list[str], positions: list[int], samples: list[int],
              new_blocks: dict[str, list[int]] | None = None, starts: dict[str, int] | None = None) -> RunStep:
    """One token per row; each row's table cut to ``starts`` (0 if not named) entries, then ``new_blocks`` appended."""
    new_blocks, starts = new_blocks or {}, starts or {}
    n = len(rids)
    return RunStep(step_id, rids, positions, [1] * n, [5] * n, [NOT_FED] * n, samples,
                   [starts.get(r, 0) for r in rids],
                   [len(new_blocks.get(r, [])) for r in rids], [b for r in rids for b in new_blocks.get(r, [])])


async def test_the_stub_device_poisons_checks_tables_and_hands_over_copies(
        autojump_clock: trio.testing.MockClock) -> None:
    send, receive = trio.open_memory_channel[Envelope](32)
    store = SpillStore(None, host_bytes=1 << 20)
    spill = SpillActor(store, Outbox(Source.SPILL, send.clone()), 16)
    device = StubDevice(Outbox(Source.DEVICE, send), spill, 16, vocab_size=64, step_time=lambda s: 0.5,
                        fail_steps=frozenset({1}), block_size=4)
    spec = SamplingSpec(max_tokens=8)
    replies: list[Input] = []

    async def expect(*commands: Command, count: int = 1) -> list[Input]:
        for command in commands:
            if isinstance(command, SpillOut):
                spill.submit_nowait(command)
            device.submit_nowait(command)
        got = [(await receive.receive()).msg for _ in range(count)]
        replies.extend(got)
        return got

    async with trio.open_nursery() as nursery:
        nursery.start_soon(device.run)
        nursery.start_soon(spill.run)
        device.submit_nowait(BindRequest("a", spec, 1, 1, [], [9]))
        device.submit_nowait(BindRequest("b", spec, 2, 1, [], [8]))
        [done] = await expect(_row_step(0, ["a", "b"], [0, 0], [0, 0], {"a": [10], "b": [11]}))
        assert done == StepDone(0, ["a", "b"], [device.token("a", 0), device.token("b", 0)], 500_000_000,
                                done.logprobs)
        assert device.tables.block_table("a") == [10] and device.tables.block_table("b") == [11]
        failed = await expect(_row_step(1, ["a"], [1], [1], starts={"a": 1}))
        assert failed == [StepFailed(1, "RuntimeError: scripted device fault")]
        [cut] = await expect(_row_step(2, ["a", "b"], [1, 1], [1, 1], starts={"a": 1, "b": 1}))
        assert isinstance(cut, StepDone) and cut.token_ids == [0, device.token("b", 1)], "a is poisoned"
        assert cut.request_ids == ["a", "b"]
        [uncovered] = await expect(_row_step(3, ["b"], [4], [2], starts={"b": 1}))
        assert uncovered == StepFailed(3, "ValueError: row 0: positions up to 4 need 2 blocks, block table has 1")
        device.submit_nowait(ReleaseRequest("a"))
        device.submit_nowait(BindRequest("a", spec, 7, 1, [], [9]))
        [again] = await expect(_row_step(4, ["a"], [0], [0], {"a": [12]}))
        assert again == StepDone(4, ["a"], [device.token("a", 0)], 500_000_000, again.logprobs)
        assert device.released == ["a"] and device.seeds["a"] == 7
        [spilled] = await expect(SpillOut("a", [12], 1))
        assert spilled == SpillDone("a", True, "", 0) and store.held == 1
        device.submit_nowait(SwapIn("a", [20, 21], 1))
        [missing] = await expect(SwapIn("c", [22], 1))
        assert missing == SwapInFailed("c", "no host copy: 'c'")
        assert store.held == 0 and device.tables.block_table("a") == [20, 21], "the copy went back into the table"
        device.submit_nowait(BindRequest("c", spec, 3, 1, [], [9]))
        [poisoned] = await expect(_row_step(5, ["c", "a"], [0, 1], [0, 1], {"c": [30]}, {"a": 2}))
        assert isinstance(poisoned, StepDone) and poisoned.token_ids == [0, device.token("a", 1)]
        device.submit_nowait(ReleaseRequest("c"))
        await trio.testing.wait_all_tasks_blocked()
        assert device.released == ["a", "c"] and "c" not in device.specs and not device.tables.is_bound("c")
        nursery.cancel_scope.cancel()
    assert device.busy_ns == 6 * 500_000_000


async def test_the_stub_devices_queue_is_bounded_and_closes() -> None:
    send, _receive = trio.open_memory_channel[Envelope](4)
    device = StubDevice(Outbox(Source.DEVICE, send), None, 1, vocab_size=8, step_time=lambda s: 0.0)
    device.submit_nowait(ReleaseRequest("a"))
    with pytest.raises(ChannelOverflow, match=r"^device queue overflowed its bound of 1 commands$"):
        device.submit_nowait(ReleaseRequest("b"))
    device.stop_nowait()
    with trio.fail_after(5):
        await device.run()  # the queued release runs, then the closed queue ends it
    assert device.released == ["a"]


async def test_the_stub_device_samples_what_the_stub_executor_samples(autojump_clock: trio.testing.MockClock) -> None:
    """The stub device and the stub executor are the same model: same tokens, logprobs and prompt logprobs, so a
    stub engine's log re-runs on the executor."""
    from tickloom.engine.model.stub import StubExecutor

    send, receive = trio.open_memory_channel[Envelope](16)
    device = StubDevice(Outbox(Source.DEVICE, send), None, 8, vocab_size=40, step_time=lambda _s: 3.0,
                        avoid=(1,), block_size=4)
    executor = StubExecutor(vocab_size=40, block_size=4, avoid=(1,))
    binds = [BindRequest("a", SamplingSpec(max_tokens=4, logprobs=2, prompt_logprobs=1, temperature=0.7), 5, 3, [],
                         [7, 8, 9]),
             BindRequest("b", SamplingSpec(max_tokens=4, temperature=1.3), 6, 2, [], [3, 4])]
    steps = [RunStep(0, ["a", "b"], [0, 0], [3, 2], [7, 8, 9, 3, 4], [NOT_FED] * 2, [0, 0], [0, 0], [1, 1], [1, 2]),
             RunStep(1, ["a", "b"], [3, 2], [1, 1], [0, 0], [0, 0], [1, 1], [1, 1], [0, 0], [])]
    for bind in binds:
        executor.bind(bind)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(device.run)
        for command in [*binds, *steps]:
            device.submit_nowait(command)
        got = [(await receive.receive()).msg for _ in steps]
        nursery.cancel_scope.cancel()
    for step, done in zip(steps, got, strict=True):
        want = executor.run_step(step)
        assert done == StepDone(step.step_id, ["a", "b"], want.token_ids, 3_000_000_000, want.logprobs,
                                want.top_token_ids, want.top_logprobs, want.prompt_logprobs,
                                want.prompt_top_token_ids, want.prompt_top_logprobs)
    assert isinstance(got[0], StepDone) and got[0].prompt_logprobs and got[0].prompt_logprobs[0], "a asked for them"
    assert device.busy_ns == 6_000_000_000
    narrow = StubDevice(Outbox(Source.DEVICE, send), None, 8, vocab_size=3, step_time=lambda _s: 0.0, avoid=(0, 1))
    narrow.seeds["r"] = 1
    assert [narrow.token("r", i) for i in range(8)] == [2] * 8, "never an avoided token"


async def test_the_swap_in_actor_reports_injected_read_errors_and_is_bounded(
        autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    from tickloom.actors.spill import SwapInActor

    send, receive = trio.open_memory_channel[Envelope](16)
    store = SpillStore(tmp_path, host_bytes=0)
    store.store("ok", _sized(4, 1))
    store.store("bad", _sized(4, 2))
    swap_in = SwapInActor(store, Outbox(Source.SWAP_IN, send), 1,
                          fault=lambda rid: "sector unreadable" if rid == "bad" else None)
    swap_in.submit_nowait(PrefetchSpill("bad"))
    with pytest.raises(ChannelOverflow, match=r"^swap-in actor overflowed its bound of 1$"):
        swap_in.submit_nowait(PrefetchSpill("ok"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(swap_in.run)
        await trio.testing.wait_all_tasks_blocked()
        swap_in.submit_nowait(PrefetchSpill("ok"))
        got = [(await receive.receive()).msg, (await receive.receive()).msg]
        nursery.cancel_scope.cancel()
    assert got == [SwapInFailed("bad", "sector unreadable"), SwapInReady("ok")]
    assert store.take("ok").num_tokens == 1
    store.close()


def test_a_request_spilled_to_disk_again_reads_back_its_newer_copy(tmp_path: Path) -> None:
    """Swapped in, then out again before its first copy was dropped: the second, smaller copy overwrites the
    file, and reads back whole."""
    import torch

    store = SpillStore(tmp_path, host_bytes=0)
    store.store("r", _sized(64, 1))
    store.load("r")
    store.take("r")
    store.store("r", _sized(2, 2))
    store.load("r")
    back = store.take("r")
    assert back.num_tokens == 2 and back.k is not None and torch.equal(back.k, _sized(2, 2).k)  # type: ignore[arg-type]
    store.close()


def test_a_store_without_a_directory_removed_nothing() -> None:
    assert SpillStore(None, host_bytes=0).removed_stale == []


def test_probing_a_process_without_proc_never_signals_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spill_module, "_PROC", False)
    script = "import signal, time; signal.signal(signal.SIGHUP, signal.SIG_DFL); print(flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"\n"
        assert process_start(child.pid) == 0
        time.sleep(0.2)
        assert child.poll() is None, "still running"
    finally:
        child.kill()
        child.wait()

    def not_yours(pid: int, signal: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(spill_module.os, "kill", not_yours)
    assert process_start(child.pid) == 0, "another user's process exists"


def test_a_stale_directory_claimed_by_another_store_first_does_not_stop_the_sweep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    stale = []
    for suffix in ("a", "b"):
        path = tmp_path / f"tickloom-spill-{host_tag()}-{child.pid}-7-{suffix}"
        path.mkdir()
        stale.append(path)
    real = os.rename
    calls: list[str] = []

    def raced(src: str, dst: object) -> None:
        calls.append(src)
        if len(calls) == 1:
            shutil.rmtree(src)  # the other store renamed (and removed) it first
            raise FileNotFoundError(2, "No such file or directory")
        real(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(spill_module.os, "rename", raced)
    store = SpillStore(tmp_path, host_bytes=0)
    assert len(calls) == 2 and len(store.removed_stale) == 1 and not any(p.exists() for p in stale)
    store.close()


async def test_a_retire_actor_buffers_1024_frames_per_stream_by_default() -> None:
    actor = RetireActor(_Letters(), [].append, clock=lambda: 5.0)
    stream = actor.open_stream("x", SamplingSpec(), 2, submitted_at=1.0)
    for i in range(1025):
        actor.deliver_nowait([EmitTokens(["x"], [0], [i], [False])])
    actor.deliver_nowait([Finish("x", "length", Usage(2, 0, 1025), "")])
    frames = [f async for f in stream]
    assert len(frames) == 1024 and frames[-1].finished and len(frames[-1].token_ids) == 2, "the last two merged"
    assert all(f.index == 0 and f.request_id == "x" for f in frames)
    with pytest.raises(ValueError) as info:
        RetireActor(_Letters(), [].append, 0)
    assert str(info.value) == "max_buffered_frames must be at least 1, got 0"


async def test_prompt_logprobs_a_device_did_not_report_are_none_for_a_longer_prompt() -> None:
    r = _Retire()
    spec = SamplingSpec(prompt_logprobs=0)
    lone = r.actor.open_stream("x", spec, 3, submitted_at=1.0, prompt_token_ids=[5, 6, 7])
    group = r.actor.open_group("g", ["g#0"], spec, 3, submitted_at=1.0, prompt_token_ids=[5, 6, 7])
    r.actor.deliver_nowait([EmitTokens(["x", "g#0"], [0, 1], [0, 0], [False, False])])
    assert (await lone.__anext__()).prompt_logprobs is None
    assert (await group.__anext__()).prompt_logprobs is None


async def test_a_stream_opened_after_a_fatal_error_keeps_its_id() -> None:
    r = _Retire()
    r.actor.fail_all(RuntimeError("gone"))
    stream = r.actor.open_stream("late", SamplingSpec(), 2, submitted_at=1.0)
    assert stream.request_id == "late"
    with pytest.raises(RuntimeError, match="gone"):
        await stream.__anext__()


def test_tokens_out_of_order_are_a_protocol_error_naming_the_request() -> None:
    from tickloom.actors.streams import StreamProtocolError

    r = _Retire()
    stream = r.actor.open_stream("x", SamplingSpec(), 2, submitted_at=1.0)
    with pytest.raises(StreamProtocolError, match=r"^'x': expected token index 0, got 5$"):
        r.actor.deliver_nowait([EmitTokens(["x"], [0], [5], [False])])
    assert stream.request_id == "x"
