"""E01 and E08: the engine on a real (tiny, random, float64) model, on trio's real clock."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from engine_helpers import assert_replays

from tickloom import Engine, EngineConfig, FaultPlan, RequestOutput, SamplingParams
from tickloom.engine.model.tiny import write_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), dtype="float64", seed=3)


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 500 + 5 for j in range(6 + (i * 5) % 23)] for i in range(n)]


async def _run_all(config: EngineConfig, prompts: list[list[int]], max_tokens: int) -> dict[int, RequestOutput]:
    results: dict[int, RequestOutput] = {}
    async with Engine.open(config) as engine:
        async with trio.open_nursery() as nursery:
            async def one(i: int) -> None:
                params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
                results[i] = await engine.complete(prompts[i], params, request_id=f"r{i}")

            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        stats = engine.stats()
    results[-1] = RequestOutput(request_id="stats", token_ids=[stats["preemptions"], stats["swaps"]])
    return results


async def test_e01_concurrent_generation_equals_alone(tiny_model: Path, tmp_path: Path) -> None:
    prompts = _prompts(32)
    config = EngineConfig(model=str(tiny_model), dtype="float64", max_seq_len=128, num_blocks=512,
                          max_batch_size=32, log_path=str(tmp_path / "batch.tlog"))
    together = await _run_all(config, prompts, 8)
    alone_config = EngineConfig(model=str(tiny_model), dtype="float64", max_seq_len=128, num_blocks=512,
                                max_batch_size=1, log_path=str(tmp_path / "alone.tlog"), prefix_caching=False)
    alone = await _run_all(alone_config, prompts, 8)
    for i in range(32):
        assert together[i].finish_reason == "length" and len(together[i].token_ids) == 8
        assert together[i].token_ids == alone[i].token_ids, f"request {i} differs when batched"
    assert_replays(tmp_path / "batch.tlog")
    assert_replays(tmp_path / "alone.tlog")


@pytest.mark.slow
async def test_e08_memory_pressure_with_and_without_spill(tiny_model: Path, tmp_path: Path) -> None:
    prompts = [p[:20] + [9] * (20 - len(p[:20])) for p in _prompts(16)]  # 20-token prompts
    roomy = EngineConfig(model=str(tiny_model), dtype="float64", max_seq_len=128, num_blocks=256,
                         max_batch_size=16)
    reference = await _run_all(roomy, prompts, 40)
    # 60 tokens take 4 blocks: 17 blocks hold 4 sequences at a time.
    common = dict(model=str(tiny_model), dtype="float64", max_seq_len=128, num_blocks=17, max_batch_size=16)
    with_spill = await _run_all(
        EngineConfig(**common, spill_dir=str(tmp_path / "spill"), host_spill_bytes=4096,  # type: ignore[arg-type]
                     log_path=str(tmp_path / "spill.tlog")),
        prompts, 40,
    )
    without = await _run_all(EngineConfig(**common, log_path=str(tmp_path / "requeue.tlog")),  # type: ignore[arg-type]
                             prompts, 40)
    preemptions, swaps = with_spill[-1].token_ids
    assert swaps > 0 and preemptions > swaps, "both swap and recompute preemptions happened"
    assert without[-1].token_ids[0] > 0 and without[-1].token_ids[1] == 0
    for i in range(16):
        assert with_spill[i].token_ids == reference[i].token_ids, f"request {i} differs after swapping"
        assert without[i].token_ids == reference[i].token_ids, f"request {i} differs after recompute"
    assert not list((tmp_path / "spill").iterdir()), "spill files are removed"
    assert_replays(tmp_path / "spill.tlog")
    assert_replays(tmp_path / "requeue.tlog")


async def test_e05_step_failure_on_the_real_executor(tiny_model: Path, tmp_path: Path) -> None:
    """A failed step ends its requests, and with them the rows of the next step fed from it; the rest go on."""
    log = tmp_path / "fail.tlog"
    config = EngineConfig(model=str(tiny_model), dtype="float64", max_seq_len=128, num_blocks=64, max_batch_size=4,
                          pipeline_depth=2, log_path=str(log), faults=FaultPlan(fail_steps=[3]))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    async with Engine.open(config) as engine:
        first = await engine.complete([5, 6, 7, 8], params, request_id="victim")
        later = await engine.complete([9, 10, 11], params, request_id="after")
    assert first.finish_reason == "error" and "step 3 failed: RuntimeError: injected device fault" in (first.error
                                                                                                       or "")
    assert later.finish_reason == "length" and len(later.token_ids) == 6
    assert_replays(log)
