"""The decode lane is an optimisation only: with and without it, the core's outputs are byte-identical.

Each workload runs twice, once as the core runs and once with the lane standing down every time (the general
plan alone, which is the specification), and every tick's encoded ``TickOutputs`` must match. Each run also
checks that the lane really planned a good share of the steps, so the comparison cannot pass vacuously.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from test_core_blast import BLAST_RUNS, blast_config, random_config, run_blast

import tickloom.engine.core.planner as planner
from tickloom.engine.core import CoreConfig
from tickloom.engine.core.state import CoreState, DecodeLane
from tickloom.events import TickOutputs, encode


def _run(
    monkeypatch: pytest.MonkeyPatch, workload: Callable[[], list[TickOutputs]], use_lane: bool
) -> tuple[list[bytes], int]:
    real = planner.plan_lane_decode
    planned_by_lane = 0

    def counting(state: CoreState, lane: DecodeLane) -> object:
        nonlocal planned_by_lane
        planned = real(state, lane) if use_lane else None
        planned_by_lane += planned is not None
        return planned

    with monkeypatch.context() as patch:
        patch.setattr(planner, "plan_lane_decode", counting)
        outputs = workload()
    return [encode(out) for out in outputs], planned_by_lane


def _assert_same(monkeypatch: pytest.MonkeyPatch, workload: Callable[[], list[TickOutputs]], share: float) -> None:
    with_lane, lane_steps = _run(monkeypatch, workload, use_lane=True)
    general, none = _run(monkeypatch, workload, use_lane=False)
    assert none == 0
    print(f"the lane planned {lane_steps} steps in {len(general)} ticks")
    assert lane_steps >= share * len(general), f"the lane planned only {lane_steps} steps in {len(general)} ticks"
    for tick, (a, b) in enumerate(zip(with_lane, general, strict=True)):
        assert a == b, f"tick {tick}: the lane planned differently from the general plan"


def _blast(seed: int, ticks: int, config: CoreConfig) -> Callable[[], list[TickOutputs]]:
    return lambda: run_blast(seed, ticks, config, shutdown=seed % 3 == 0).outputs


@pytest.mark.parametrize("seed", range(3100, 3124))
def test_lane_matches_the_general_plan_under_random_configs(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _assert_same(monkeypatch, _blast(seed, 500, random_config(seed)), share=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3300, 3312))
def test_lane_matches_the_general_plan_in_long_random_config_runs(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _assert_same(monkeypatch, _blast(seed, 3000, random_config(seed)), share=0.2)


@pytest.mark.parametrize(("depth", "spill", "caching", "blocks"),
                         [(1, False, True, 40), (2, False, True, 40), (1, True, True, 24), (2, True, False, 32)])
def test_lane_matches_the_general_plan_under_pressure(
    depth: int, spill: bool, caching: bool, blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _assert_same(monkeypatch, _blast(3200 + depth, 1500, blast_config(depth, spill, caching, blocks)), share=0.4)


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "ticks", "depth", "spill", "caching", "blocks", "shutdown"), BLAST_RUNS)
def test_lane_matches_the_general_plan_in_the_c26_blasts(
    seed: int, ticks: int, depth: int, spill: bool, caching: bool, blocks: int, shutdown: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """C26's 20,000 ticks: long enough for the rare cases (a resume whose whole history hits the cache)."""
    config = blast_config(depth, spill, caching, blocks)
    _assert_same(monkeypatch, lambda: run_blast(seed, ticks, config, shutdown=shutdown).outputs, share=0.3)


@pytest.mark.parametrize("depth", [1, 2])
def test_lane_matches_the_general_plan_in_the_steady_state(depth: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tickloom bench core``'s workload at a small N: the lane should plan nearly every step."""
    from tickloom.tools.bench.core import _Workload

    def workload() -> list[TickOutputs]:
        work = _Workload(24, depth, seed=random.Random(depth).randrange(1000))
        outputs: list[TickOutputs] = []
        tick = work.core.tick

        def recording(tick_inputs: object) -> TickOutputs:
            out = tick(tick_inputs)  # type: ignore[arg-type]
            outputs.append(out)
            return out

        work.core.tick = recording  # type: ignore[method-assign]
        for _ in range(300):
            work.step(None)
        return outputs

    _assert_same(monkeypatch, workload, share=0.8)
