"""The Perfetto trace of a real run keeps the Trace Event Format's nesting rule on every track: two complete ("X")
slices on one (pid, tid) are either disjoint or one contains the other. Running ahead (``pipeline_depth=2``) step
t+1 starts before step t ends, so the steps need more than one track; every step still appears exactly once."""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from engine_helpers import stub_config
from replay_helpers import record_everything

from tickloom import Engine, SamplingParams
from tickloom.events import LogReader, RunStep
from tickloom.replay.trace import perfetto_trace


async def _run(log: Path, depth: int) -> None:
    async with Engine.open(stub_config(log, pipeline_depth=depth, max_batch_size=4)) as engine:

        async def one(i: int) -> None:
            await trio.sleep(0.013 * i)
            params = SamplingParams(max_tokens=5 + 3 * (i % 5), seed=i)
            async for _ in engine.generate("prompt " * (1 + i % 7), params, request_id=f"r{i:02d}"):
                pass

        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(one, i)


def _overlaps_without_nesting(a: dict[str, Any], b: dict[str, Any]) -> bool:
    a0, a1 = a["ts"], a["ts"] + a["dur"]
    b0, b1 = b["ts"], b["ts"] + b["dur"]
    disjoint = a1 <= b0 or b1 <= a0
    nested = (a0 <= b0 and b1 <= a1) or (b0 <= a0 and a1 <= b1)
    return not (disjoint or nested)


def bad_pairs(trace: dict[str, Any]) -> list[tuple[str, str]]:
    """Pairs of X slices on one (pid, tid) that overlap without one containing the other."""
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            tracks[(event["pid"], event["tid"])].append(event)
    return [(a["name"], b["name"]) for slices in tracks.values() for a, b in itertools.combinations(slices, 2)
            if _overlaps_without_nesting(a, b)]


@pytest.mark.parametrize("depth", [1, 2])
async def test_every_track_nests(depth: int, tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    await _run(log, depth)
    with LogReader(log) as reader:
        step_ids = sorted(c.step_id for t in reader.ticks() for c in t.outputs.commands if isinstance(c, RunStep))
    assert len(step_ids) > 10
    trace = perfetto_trace(log)
    steps = sorted(int(e["name"].split()[1]) for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "step")
    assert steps == step_ids, "every step appears exactly once"
    assert bad_pairs(trace) == []
    if depth == 2:
        step_tids = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"}
        assert len(step_tids) > 1, "running ahead, steps overlap, so they take more than one track"


def test_the_checker_sees_a_crossing() -> None:
    crossing = {"traceEvents": [{"ph": "X", "name": "a", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
                                {"ph": "X", "name": "b", "ts": 5, "dur": 10, "pid": 1, "tid": 1},
                                {"ph": "X", "name": "c", "ts": 5, "dur": 10, "pid": 1, "tid": 2},
                                {"ph": "X", "name": "d", "ts": 6, "dur": 2, "pid": 1, "tid": 2},
                                {"ph": "X", "name": "e", "ts": 15, "dur": 2, "pid": 1, "tid": 2}]}
    assert bad_pairs(crossing) == [("a", "b")]


def test_spills_and_prefetches_nest_too(tmp_path: Path) -> None:
    """The recorded scenario with preemption, spills and swap-ins (concurrent I/O may overlap as steps do)."""
    log = tmp_path / "everything.tlog"
    record_everything(log)
    trace = perfetto_trace(log)
    assert bad_pairs(trace) == []
    names = {e["name"].split()[0] for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "io"}
    assert names == {"spill", "prefetch"}
