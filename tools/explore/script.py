"""The actor-level explorer's scripts: what the clients do and which faults strike, drawn from one seed.

``make_script(seed, faults)`` draws the engine's setup and a list of actions from one ``random.Random(seed)``:
clients that submit (with deadlines, stop strings, priorities, sampling seeds), cancel (half of the cancels land at
another request's arrival, when admitting it may swap the cancelled one out), or leave the stream early; with
``faults`` also failed steps, failed spill writes and swap-in reads, an actor crash, jittered step times, slow
copies and spill I/O, and late retire reports. Shrinking keeps a subset of the actions (``Script.subset``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import msgspec

from tickloom import EngineConfig, FaultPlan
from tickloom.tools.explore.checks import Expect, Monitor

CRASHABLE = ("step", "device", "deadlines", "retire", "spill", "swap-in", "log")


# -- the actions ----------------------------------------------------------------------------------------------------
class Submit(msgspec.Struct, frozen=True, tag="submit"):
    rid: str
    at: float
    prompt: list[int]
    max_tokens: int
    seed: int | None
    temperature: float
    priority: int
    deadline: float | None
    stop: list[str]
    stop_token_ids: list[int]


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    rid: str
    at: float


class Disconnect(msgspec.Struct, frozen=True, tag="disconnect"):
    rid: str
    after_tokens: int
    """Leave the stream once this many tokens arrived (0: right after submitting)."""


class FailStep(msgspec.Struct, frozen=True, tag="fail_step"):
    step: int


class FailSpill(msgspec.Struct, frozen=True, tag="fail_spill"):
    rid: str


class FailSwapIn(msgspec.Struct, frozen=True, tag="fail_swap_in"):
    rid: str


class Crash(msgspec.Struct, frozen=True, tag="crash"):
    actor: str
    after: float


Action = Submit | Cancel | Disconnect | FailStep | FailSpill | FailSwapIn | Crash


class Setup(msgspec.Struct, frozen=True):
    block_size: int
    num_blocks: int
    max_seq_len: int
    max_batch_size: int
    pipeline_depth: int
    max_waiting: int
    overload: str
    spill: bool
    prefix_caching: bool
    immunity: int
    snapshot_every: int
    step_time: float
    step_jitter: float
    """Each step takes ``step_time * (1 ± step_jitter)``, drawn per step id."""
    copy_delay: float
    """The stub device's copies out reach the spill actor up to this many seconds late (a slow device-to-host copy,
    which the real device does asynchronously too)."""
    io_delay: float
    """Spill writes, drops and swap-in reads take up to this many (virtual) seconds."""
    report_delay: float
    speculative_tokens: int = 0
    """Proposal slots per decode row (the stub device accepts a stable share): drawn for half the seeds with
    faults, from a generator of its own, so that the seeds without faults run as they always have."""


class Script(msgspec.Struct, frozen=True):
    seed: int
    faults: bool
    setup: Setup
    actions: list[Action]

    def subset(self, keep: Sequence[int]) -> Script:
        return Script(self.seed, self.faults, self.setup, [self.actions[i] for i in sorted(set(keep))])


def make_script(seed: int, faults: bool) -> Script:
    """The setup and the actions of ``seed``, all drawn from one ``random.Random(seed)``."""
    rng = random.Random(seed)
    block_size = rng.choice([4, 8, 16])
    max_seq_len = 64
    per_seq = max_seq_len // block_size + 1
    setup = Setup(
        block_size=block_size, num_blocks=rng.randint(per_seq, 3 * per_seq), max_seq_len=max_seq_len,
        max_batch_size=rng.randint(1, 6), pipeline_depth=rng.choice([1, 2]), max_waiting=rng.randint(0, 6),
        overload=rng.choice(["wait", "wait", "wait", "reject"]), spill=rng.random() < 0.6,
        prefix_caching=rng.random() < 0.7, immunity=rng.choice([0, 2, 8, 64]),
        snapshot_every=rng.choice([0, 0, 5]), step_time=0.01,
        step_jitter=rng.choice([0.0, 0.5, 0.9]) if faults else 0.0,
        copy_delay=rng.choice([0.0, 0.003, 0.015] + ([0.05] if faults else [])),
        io_delay=rng.choice([0.0, 0.005, 0.03]) if faults else 0.0,
        report_delay=rng.choice([0.0, 0.0, 0.02, 0.05]) if faults else 0.0,
        speculative_tokens=random.Random(f"speculation-{seed}").choice([0, 0, 2, 4]) if faults else 0,
    )
    bases = [[rng.randrange(95) for _ in range(rng.randint(1, 24))] for _ in range(3)]
    actions: list[Action] = []
    cancels: list[int] = []
    for i in range(rng.randint(1, 12)):
        rid = f"r{i}"
        prompt = (rng.choice(bases) if rng.random() < 0.5 else [])[: max_seq_len // 2]
        prompt = prompt + [rng.randrange(95) for _ in range(rng.randint(0 if prompt else 1, 16))]
        at = round(rng.uniform(0.0, 0.3), 4)
        roll = rng.random()
        actions.append(Submit(
            rid=rid, at=at, prompt=prompt, max_tokens=rng.randint(1, 40),
            seed=rng.randrange(1 << 32) if rng.random() < 0.8 else None, temperature=rng.choice([0.0, 1.0]),
            priority=rng.randrange(3),
            deadline=round(rng.uniform(0.005, 0.6), 4) if roll < 0.35 else None,
            stop=[rng.choice("abcdefgh") + rng.choice("abcdefgh")] if rng.random() < 0.1 else [],
            stop_token_ids=[rng.randrange(95)] if rng.random() < 0.2 else [],
        ))
        if rng.random() < 0.25:
            cancels.append(len(actions))
            actions.append(Cancel(rid, at))
        if rng.random() < 0.2:
            actions.append(Disconnect(rid, rng.randint(0, 6)))
        if faults and rng.random() < 0.1:
            actions.append(FailSpill(rid))
        if faults and rng.random() < 0.1:
            actions.append(FailSwapIn(rid))
    submits = [a.at for a in actions if isinstance(a, Submit)]
    for i in cancels:  # half of them at another arrival: when admitting it may swap the cancelled request out
        start = actions[i].at  # type: ignore[union-attr]
        late = max(start, rng.choice(submits)) if rng.random() < 0.5 else start + rng.uniform(0.0, 0.3)
        actions[i] = Cancel(actions[i].rid, round(late + rng.uniform(0.0, 0.02), 4))  # type: ignore[union-attr]
    if faults:
        actions += [FailStep(rng.randrange(60)) for _ in range(rng.choice([0, 0, 1, 2]))]
        if rng.random() < 0.15:
            actions.append(Crash(rng.choice(CRASHABLE), round(rng.uniform(0.0, 0.4), 4)))
    return Script(seed, faults, setup, actions)


def engine_config(script: Script, log_path: Path) -> EngineConfig:
    s = script.setup
    acts = script.actions
    crash = next((a for a in acts if isinstance(a, Crash)), None)
    plan = FaultPlan(
        fail_steps=sorted({a.step for a in acts if isinstance(a, FailStep)}),
        fail_spill=sorted({a.rid for a in acts if isinstance(a, FailSpill)}),
        fail_swap_in=sorted({a.rid for a in acts if isinstance(a, FailSwapIn)}),
        crash_actor=crash.actor if crash is not None else None,  # type: ignore[arg-type]
        crash_after=crash.after if crash is not None else 0.0, report_delay=s.report_delay,
    )
    return EngineConfig(
        model="stub", log_path=str(log_path), fsync="never", num_blocks=s.num_blocks, block_size=s.block_size,
        max_seq_len=s.max_seq_len, max_batch_size=s.max_batch_size, pipeline_depth=s.pipeline_depth,  # type: ignore[arg-type]
        max_waiting=s.max_waiting + s.max_batch_size, overload=s.overload,  # type: ignore[arg-type]
        host_spill_bytes=1 << 30 if s.spill else 0, spill_dir=None, prefix_caching=s.prefix_caching,
        preempt_immunity_tokens=s.immunity, speculative_tokens=s.speculative_tokens,
        speculative_max_running=4,  # speculation among batch mixes, not only at a batch's tail
        snapshot_every=s.snapshot_every, stub_step_time=s.step_time, faults=plan,
    )


def time_bound(script: Script) -> float:
    """Virtual seconds within which every request must have ended (faults heal: each fails one thing once)."""
    s = script.setup
    subs = [a for a in script.actions if isinstance(a, Submit)]
    last = max((getattr(a, "at", 0.0) for a in script.actions), default=0.0)
    work = sum(a.max_tokens + len(a.prompt) // s.block_size + 4 for a in subs)
    return last + 2.0 + s.report_delay * 4 * len(subs) + 3 * work * s.step_time * (1 + s.step_jitter) + 20 * s.io_delay


def monitor_for(script: Script) -> Monitor:
    acts = script.actions
    cancellable = {a.rid for a in acts if isinstance(a, Cancel | Disconnect)}
    swap_fails = {a.rid for a in acts if isinstance(a, FailSwapIn)}
    requests = {a.rid: Expect(len(a.prompt), a.max_tokens, a.deadline is not None, bool(a.stop),
                              bool(a.stop_token_ids), a.rid in cancellable, a.rid in swap_fails)
                for a in acts if isinstance(a, Submit)}
    crash = next((a.actor for a in acts if isinstance(a, Crash)), None)
    return Monitor(requests, frozenset(a.step for a in acts if isinstance(a, FailStep)), crash,
                   script.setup.max_seq_len)
