"""Behavioural tests that kill mutants of the devices (scripts/mutate.sh --area actors) that their own tests leave
alive: the thread device (order, poisoning, injected faults, the copy-out path, the bounded queue, cancellation) and the
stub device (its tokens, poisoning, tables, copies, its queue)."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from tickloom.actors.device import StubDevice, ThreadDevice, without_requests
from tickloom.actors.mailbox import ChannelOverflow, Envelope, Outbox, Source
from tickloom.actors.spill import SpillActor, SpillStore
from tickloom.engine.model.types import HostKV, StepResult
from tickloom.events import (
    NO_SAMPLE,
    NOT_FED,
    BindRequest,
    Command,
    Input,
    ReleaseRequest,
    RunStep,
    SamplingSpec,
    SpillDone,
    SpillOut,
    StepDone,
    StepFailed,
    SwapIn,
    SwapInFailed,
)

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
