"""The extra-token path through the real actors (``FaultPlan.stub_extras``): the stub device accepts up to k tokens
after a row's sampled one, as a constraint's forced tokens come. They are the oracle's own next tokens, so every
request's output must be exactly what it is without extras, whatever the arrivals, cancels, stop strings, running
ahead, preemption and swaps; and the run replays."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import trio
from engine_helpers import assert_replays, stub_config

from tickloom import Engine, FaultPlan, SamplingParams
from tickloom.events import LogReader, Preempted, StepDone


async def run_workload(log: Path, seed: int, depth: int, spill: bool, **config_kw: Any
                       ) -> dict[str, tuple[list[int], str]]:
    """Seeded arrivals at random times, some with stop strings, some left early, on the stub under ``config_kw``
    (24 blocks: preemption; ``spill``: swaps); each finished request's tokens and finish reason."""
    rng = random.Random(seed)
    config = stub_config(log, pipeline_depth=depth, num_blocks=24, max_seq_len=128, max_batch_size=8,
                         host_spill_bytes=(1 << 20) if spill else 0, **config_kw)
    results: dict[str, tuple[list[int], str]] = {}
    jobs = [(f"r{i}", rng.uniform(0.0, 0.4), rng.randint(4, 60), rng.random() < 0.2, rng.random() < 0.15)
            for i in range(24)]

    async def one(engine: Engine, rid: str, delay: float, max_tokens: int, stop: bool, leave: bool) -> None:
        await trio.sleep(delay)
        params = SamplingParams(max_tokens=max_tokens, seed=int(rid[1:]), temperature=0.8,
                                stop=["q"] if stop else [])
        tokens: list[int] = []
        reason = ""
        async for out in engine.generate(f"prompt {rid} " * 3, params, request_id=rid):
            tokens += out.token_ids
            reason = out.finish_reason or reason
            if leave and len(tokens) >= 5:
                break
        if not leave:
            results[rid] = (tokens, reason)

    async with Engine.open(config) as engine, trio.open_nursery() as nursery:
        for job in jobs:
            nursery.start_soon(one, engine, *job)
    return results


@pytest.mark.parametrize(("depth", "spill"), [(1, False), (2, False), (2, True)])
async def test_extras_change_no_output_under_any_timing(tmp_path: Path, autojump_clock: trio.testing.MockClock,
                                                        depth: int, spill: bool) -> None:
    for seed in (1, 2):
        plain = await run_workload(tmp_path / f"plain-{seed}.tlog", seed, depth, spill)
        log = tmp_path / f"extras-{seed}.tlog"
        with_extras = await run_workload(log, seed, depth, spill, faults=FaultPlan(stub_extras=3))
        assert with_extras == plain, f"seed {seed}: extras changed an output"
        assert_replays(log)
        with LogReader(log) as reader:
            records = list(reader.ticks())
        extras = sum(len(row) for r in records for i in r.inputs.inputs
                     if isinstance(i, StepDone) and i.extra_token_ids for row in i.extra_token_ids)
        assert extras > 50, "the stub accepted extra tokens"
        if seed == 1:
            preempted = [c for r in records for c in r.outputs.commands if isinstance(c, Preempted)]
            assert preempted, "24 blocks are too few for the burst: the extras path met preemption"
