"""C01–C04: admission order, validation, the watermark gate and chunked prefill."""

from __future__ import annotations

import pytest
from core_harness import Harness, arrival

from tickloom.engine.core import ConfigError, CoreConfig
from tickloom.events import BindRequest, Finish, RunStep, SamplingSpec, SpillOut


def _bind_ticks(h: Harness) -> dict[str, int]:
    return {c.request_id: t for t, c in h.commands(BindRequest)}


def _finish_ticks(h: Harness) -> dict[str, int]:
    return {c.request_id: t for t, c in h.commands(Finish)}


def test_c01_fcfs_no_overtaking() -> None:
    config = CoreConfig(num_blocks=10, block_size=16, admit_watermark=0, max_seq_len=128, max_prefill_tokens=512)
    h = Harness(config)
    h.step(arrival("r1", 100, 8), arrival("r2", 100, 8), arrival("r3", 10, 8))
    assert list(_bind_ticks(h)) == ["r1"], "r2 (7 blocks) does not fit beside r1 (7 of 10), r3 waits behind it"
    assert [s.request_id for s in h.core.state.waiting] == ["r2", "r3"]
    h.run()
    binds, finishes = _bind_ticks(h), _finish_ticks(h)
    assert list(binds) == ["r1", "r2", "r3"]
    assert binds["r2"] > finishes["r1"], "r2 is admitted only after r1 frees its blocks"
    assert binds["r3"] >= binds["r2"], "r3 never overtakes r2"
    assert all(h.reason(r) == "length" and len(h.output(r)) == 8 for r in ("r1", "r2", "r3"))


def test_c02_config_error_names_both_numbers() -> None:
    with pytest.raises(ConfigError, match=r"num_blocks=8.*max_seq_len=128.*9 blocks"):
        CoreConfig(num_blocks=8, block_size=16, max_seq_len=128)
    with pytest.raises(ConfigError, match="pipeline_depth=3"):
        CoreConfig(num_blocks=64, pipeline_depth=3)


@pytest.mark.parametrize(
    ("prompt", "problem"),
    [
        ([], "empty prompt"),
        (list(range(1, 129)), "prompt of 128 tokens does not fit max_seq_len=128"),
        ([5, 1000, 7], "prompt token id 1000 at position 1 is outside vocab_size=1000"),
        ([5, -1], "prompt token id -1 at position 1 is outside vocab_size=1000"),
    ],
)
def test_c02_invalid_arrival_is_answered_at_once(prompt: list[int], problem: str) -> None:
    h = Harness(CoreConfig(num_blocks=10, max_seq_len=128, vocab_size=1000))
    out = h.step(arrival("bad", prompt, 4), arrival("good", 10, 2))
    finishes = [c for c in out.commands if isinstance(c, Finish)]
    assert [(f.request_id, f.reason) for f in finishes] == [("bad", "error")]
    assert problem in finishes[0].error
    assert "bad" not in h.core.state.seqs
    h.run()
    assert h.reason("good") == "length"


def test_c03_watermark_reserves_output_room() -> None:
    def admitted_together(watermark: int) -> bool:
        config = CoreConfig(num_blocks=10, block_size=16, max_seq_len=128, admit_watermark=watermark)
        h = Harness(config)
        h.step(arrival("r1", 40, 8), arrival("r2", 40, 100))
        return list(_bind_ticks(h)) == ["r1", "r2"]

    assert admitted_together(0), "watermark 0 reserves the prompt only: 3 + 3 blocks"
    assert not admitted_together(64), "r2 reserves blocks(40 + 64) = 7 beside r1's blocks(40 + 8) = 4"


def test_c03_in_flight_demand_counts_unallocated_reservations() -> None:
    # r1 reserves blocks(40 + 24) = 5 but holds 3 after its prefill: 2 more are promised to it.
    config = CoreConfig(num_blocks=10, block_size=16, max_seq_len=128, admit_watermark=24)
    h = Harness(config)
    h.step(arrival("r1", 40, 24))
    assert h.core.state.pool.num_free == 7
    h.step(arrival("r2", 60, 24))  # needs blocks(84) = 6 > 7 free - 2 promised
    assert list(_bind_ticks(h)) == ["r1"]


def test_c03_spill_admission_reclaims_before_swapping() -> None:
    config = CoreConfig(num_blocks=10, block_size=16, max_seq_len=128, spill_enabled=True, max_batch_size=4)
    h = Harness(config)
    h.step(arrival("r0", 64, 1))  # finishes at once; its 4 full blocks stay cached
    h.run()
    h.step(arrival("r1", 40, 30))
    h.step()
    assert h.core.state.pool.num_cached > 0
    h.step(arrival("r2", 80, 2))  # does not fit in free blocks, fits after reclaiming r0's cached blocks
    assert "r2" in _bind_ticks(h)
    assert not h.commands(SpillOut), "reclaiming sufficed: nothing is swapped out"
    h.run()
    assert h.reason("r1") == h.reason("r2") == "length"


def test_c04_chunked_prefill_mixed_steps_in_arrival_order() -> None:
    config = CoreConfig(num_blocks=64, block_size=16, max_seq_len=512, max_prefill_tokens=64)
    h = Harness(config)
    h.step(arrival("r0", 10, 20))
    h.step(arrival("r1", 200, 4), arrival("r2", 100, 4))
    h.run()
    steps = [c for _, c in h.commands(RunStep)]
    chunks = {
        rid: [(s.positions[i], s.num_tokens[i]) for s in steps for i, r in enumerate(s.request_ids) if r == rid]
        for rid in ("r1", "r2")
    }
    assert chunks["r1"][:4] == [(0, 64), (64, 64), (128, 64), (192, 8)]
    assert chunks["r2"][:2] == [(0, 56), (56, 44)], "r2 gets the budget r1 leaves, after r1"
    for s in steps[1:5]:
        assert "r0" in s.request_ids and s.num_tokens[s.request_ids.index("r0")] == 1, "r0 keeps decoding"
    first_token_step = {
        rid: next(s.step_id for s in steps if rid in s.request_ids and s.sample_indices[s.request_ids.index(rid)] == 0)
        for rid in ("r1", "r2")
    }
    assert first_token_step["r1"] < first_token_step["r2"]
    assert all(h.reason(r) == "length" for r in ("r0", "r1", "r2"))


def test_c04_sampling_params_reach_the_executor_once() -> None:
    h = Harness(CoreConfig(num_blocks=16, max_seq_len=128, eos_token_ids=(2, 3)))
    params = SamplingSpec(max_tokens=3, min_tokens=2, stop_token_ids=[7])
    h.step(arrival("r", 20, params=params))
    h.run()
    binds = [c for _, c in h.commands(BindRequest)]
    assert len(binds) == 1 and binds[0].params == params and binds[0].masked_token_ids == [2, 3, 7]
