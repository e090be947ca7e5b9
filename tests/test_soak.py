"""Soaks: many requests through the real actors, with everything that can end a request mixed in.

Each request gets a random prompt length, output length and priority, and one fate: it runs to the end, the
app cancels it, its client walks away mid-stream, or it has a deadline (a few expire, most do not). On top of
that the device fails chosen steps, the spill store fails chosen writes and swap-in reads, and the KV pool is
small enough that preemption and swapping happen all the time.

What must hold afterwards:
- every request ends exactly once in the log (one ``Finish``), with a reason its fate allows;
- every client that stayed saw exactly one terminal frame, whose usage counts the tokens it received, and no
  frame after it;
- an ``error`` finish is explained by an injected fault (a failed step that carried the request, or its
  failed swap-in);
- blocks, queues, submit slots, deadline watches and spill files are back to their baseline;
- the log replays ``identical``.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from engine_helpers import assert_replays, stub_config

from tickloom import Engine, EngineConfig, FaultPlan, RequestOutput, SamplingParams
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.events import PROPOSE, Finish, LogReader, RunStep

FATES = ("normal", "cancel", "disconnect", "deadline_short", "deadline_long")
FATE_WEIGHTS = (45, 15, 15, 8, 17)
NORMAL = {"length", "stop"}
ALLOWED = {
    "normal": NORMAL,
    "cancel": NORMAL | {"cancelled"},
    "disconnect": NORMAL | {"cancelled"},
    "deadline_short": NORMAL | {"timeout"},
    "deadline_long": NORMAL,
}


@attrs.define
class Plan:
    rid: str
    fate: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    after: float
    """Seconds until the client acts: cancels, or the deadline; for a disconnect, tokens before leaving."""


@attrs.define
class Seen:
    frames: list[RequestOutput] = attrs.Factory(list)
    left_early: bool = False


def _plans(rng: random.Random, n: int, prompt_of: Any, max_tokens: int) -> list[Plan]:
    plans = []
    for i in range(n):
        fate = rng.choices(FATES, FATE_WEIGHTS)[0]
        stop = [rng.choice("abcdefgh") + rng.choice("abcdefgh")] if rng.random() < 0.1 else []
        params = SamplingParams(max_tokens=rng.randint(1, max_tokens), seed=rng.randrange(1 << 32), stop=stop,
                                min_tokens=0, temperature=rng.choice([0.0, 0.7, 1.0]))
        after = {"cancel": rng.uniform(0.0, 0.3), "disconnect": rng.randint(0, 6),
                 "deadline_short": rng.uniform(0.01, 0.4), "deadline_long": 3600.0}.get(fate, 0.0)
        plans.append(Plan(f"r{i}", fate, prompt_of(rng), params, rng.randrange(4), after))
    return plans


async def _client(engine: Engine, plan: Plan, seen: Seen) -> None:
    deadline = plan.after if plan.fate.startswith("deadline") else None
    async with trio.open_nursery() as nursery:
        if plan.fate == "cancel":
            async def cancel_later() -> None:
                await trio.sleep(plan.after)
                await engine.cancel(plan.rid)

            nursery.start_soon(cancel_later)
        async with engine.stream(plan.prompt, plan.params, deadline=deadline, request_id=plan.rid,
                                 priority=plan.priority) as stream:
            async for out in stream:
                seen.frames.append(out)
                received = sum(len(f.token_ids) for f in seen.frames)
                if plan.fate == "disconnect" and received >= plan.after and not out.finished:
                    seen.left_early = True
                    break
        nursery.cancel_scope.cancel()


async def _soak(config: EngineConfig, plans: list[Plan], concurrency: int, pace: float) -> dict[str, Seen]:
    seen = {plan.rid: Seen() for plan in plans}
    limit = trio.CapacityLimiter(concurrency)
    async with Engine.open(config) as engine:
        async def one(plan: Plan) -> None:
            async with limit:
                await _client(engine, plan, seen[plan.rid])

        async with trio.open_nursery() as nursery:
            for plan in plans:
                nursery.start_soon(one, plan)
                await trio.sleep(pace)
        await trio.sleep(0.5)  # the last cancellations and releases reach the core
        rt = engine.runtime
        # The spill actors write and delete in worker threads, and MockClock's autojump moves virtual time on while
        # a thread works: the sleep above can end before the last DropSpill's delete has run. So wait, in real
        # time and boundedly, for the spill threads to go quiet before counting what they hold.
        for _ in range(500):
            if rt.store is None or rt.store.held == 0:
                break
            await trio.to_thread.run_sync(time.sleep, 0.01)
        stats = engine.stats()
        assert not rt.live, "every request ended"
        assert (stats["waiting"], stats["running"], stats["preempted"], stats["swapped"]) == (0, 0, 0, 0), stats
        assert stats["blocks_free"] + stats["blocks_cached"] == stats["blocks_total"], stats
        assert rt.deadlines.watched == 0, "no deadline watch outlives its request"
        assert rt.store is None or rt.store.held == 0, "no spilled copy outlives its request"
        print(f"preemptions {stats['preemptions']}, swaps {stats['swaps']}, ticks {stats['ticks']}")
    return seen


def _check(log: Path, plans: list[Plan], seen: dict[str, Seen], faults: FaultPlan) -> Counter[str]:
    finishes: dict[str, list[Finish]] = {}
    carried: dict[int, set[str]] = {}
    with LogReader(log) as reader:
        for tick in reader.ticks():
            for command in tick.outputs.commands:
                if isinstance(command, Finish):
                    finishes.setdefault(command.request_id, []).append(command)
                elif isinstance(command, RunStep):
                    carried[command.step_id] = set(command.request_ids)
    failed_with: dict[str, set[int]] = {}
    for step in faults.fail_steps:
        for rid in carried.get(step, set()) | carried.get(step + 1, set()):
            failed_with.setdefault(rid, set()).add(step)
    reasons: Counter[str] = Counter()
    for plan in plans:
        ends = finishes.get(plan.rid, [])
        assert len(ends) == 1, f"{plan.rid} ({plan.fate}) ended {len(ends)} times"
        end = ends[0]
        reasons[end.reason] += 1
        if end.reason == "error":
            by_step = any(f"step {s} failed" in end.error for s in failed_with.get(plan.rid, ()))
            by_swap = plan.rid in faults.fail_swap_in and "swap-in failed" in end.error
            assert by_step or by_swap, f"{plan.rid}: an error no fault explains: {end.error}"
        else:
            assert end.reason in ALLOWED[plan.fate], (plan.rid, plan.fate, end.reason)
        if end.reason == "stop" and not plan.params.stop:
            assert not plan.params.ignore_eos, plan.rid
        frames = seen[plan.rid].frames
        if seen[plan.rid].left_early:
            assert not any(f.finished for f in frames), f"{plan.rid} left before its end"
            continue
        assert frames and frames[-1].finished, f"{plan.rid}'s stream ended without a terminal frame"
        assert sum(f.finished for f in frames) == 1, f"{plan.rid} got more than one terminal frame"
        last = frames[-1]
        tokens = sum(len(f.token_ids) for f in frames)
        assert last.finish_reason == end.reason, (plan.rid, last.finish_reason, end.reason)
        assert last.usage is not None and last.usage.completion_tokens == tokens, (plan.rid, last.usage, tokens)
        if end.reason == "length":
            assert tokens == plan.params.max_tokens, (plan.rid, tokens)
    return reasons


@pytest.mark.slow
@pytest.mark.parametrize("speculative_tokens", [0, 4])
async def test_soak_1000_requests_on_the_stub(tmp_path: Path, autojump_clock: trio.testing.MockClock,
                                              speculative_tokens: int) -> None:
    rng = random.Random(20261201)
    plans = _plans(rng, 1000, lambda r: "".join(r.choice("abcdefghij ") for _ in range(r.randint(1, 70))), 48)
    faults = FaultPlan(fail_steps=[40, 333, 901, 1777, 2600], fail_spill=[p.rid for p in plans[::37]],
                       fail_swap_in=[p.rid for p in plans[5::41]])
    log = tmp_path / "soak.tlog"
    spill = tmp_path / "spill"
    # 24 blocks of 16 tokens hold about four long sequences: preemption and swapping never stop.
    config = stub_config(log, num_blocks=24, max_seq_len=128, max_batch_size=12, spill_dir=str(spill),
                         host_spill_bytes=2048, faults=faults, stub_step_time=0.01,
                         speculative_tokens=speculative_tokens, speculative_max_running=12)
    seen = await _soak(config, plans, concurrency=48, pace=0.004)
    reasons = _check(log, plans, seen, faults)
    print(f"soak: {len(plans)} requests, finishes {dict(reasons)}")
    fates = Counter(plan.fate for plan in plans)
    assert reasons["length"] > 300 and reasons["cancelled"] > 50 and reasons["timeout"] > 5, (reasons, fates)
    assert reasons["error"] > 0, "the injected faults ended some requests"
    assert not any(spill.rglob("*.kv")) and not [p for p in spill.rglob("*") if p.is_file()], "spill files removed"
    with LogReader(log) as reader:
        commands = [c for t in reader.ticks() for c in t.outputs.commands]
    preempts = sum(1 for c in commands if type(c).__name__ == "Preempted")
    assert preempts > 20, "the pool forced preemption"
    slots = sum(c.token_ids.count(PROPOSE) for c in commands if isinstance(c, RunStep))
    assert (slots > 1000) == (speculative_tokens > 0), "with speculation on, rows carried proposal slots"
    assert_replays(log)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), dtype="float32", seed=5)


@pytest.mark.slow
@pytest.mark.parametrize("speculative_tokens", [0, 3])
async def test_soak_on_the_tiny_model(tiny_model: Path, tmp_path: Path, speculative_tokens: int) -> None:
    rng = random.Random(7)
    plans = _plans(rng, 80, lambda r: [r.randrange(5, 500) for _ in range(r.randint(1, 40))], 24)
    for plan in plans:  # real time: a few ms per step, so short deadlines and cancels land mid-run
        if plan.fate in ("cancel", "deadline_short"):
            plan.after /= 4
    faults = FaultPlan(fail_steps=[30, 95], fail_spill=[p.rid for p in plans[::9]],
                       fail_swap_in=[p.rid for p in plans[4::11]])
    log = tmp_path / "tiny.tlog"
    config = EngineConfig(model=str(tiny_model), dtype="float32", max_seq_len=96, num_blocks=12, max_batch_size=8,
                          log_path=str(log), spill_dir=str(tmp_path / "spill"), host_spill_bytes=4096,
                          faults=faults, speculative_tokens=speculative_tokens, speculative_max_running=8)
    seen = await _soak(config, plans, concurrency=16, pace=0.002)
    reasons = _check(log, plans, seen, faults)
    print(f"tiny soak: {len(plans)} requests, finishes {dict(reasons)}")
    assert reasons["length"] + reasons["stop"] > 20
    assert_replays(log)
