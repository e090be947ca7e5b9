"""C23 and C24: the golden swap-out/swap-in and requeue runs, after the reference scheduler's trace harness."""

from __future__ import annotations

from core_harness import Harness, arrival

from tickloom.engine.core import CoreConfig
from tickloom.events import DropSpill, Finish, Preempted, RequestCancelled, RunStep, SpillOut, SwapIn


def unpressured_output(request_id: str, prompt: int, max_tokens: int) -> list[int]:
    h = Harness(CoreConfig(num_blocks=64, block_size=16, max_seq_len=128))
    h.step(arrival(request_id, prompt, max_tokens))
    h.run()
    return h.output(request_id)


def _c23_before_r2() -> Harness:
    """C23's setup: r0 and r1 running, two ticks in."""
    config = CoreConfig(
        num_blocks=10, block_size=16, spill_enabled=True, admit_watermark=0, max_batch_size=4,
        max_seq_len=128, pipeline_depth=1, max_prefill_tokens=64,
    )
    h = Harness(config)
    h.step(arrival("r0", 20, 60), arrival("r1", 40, 8))
    h.step()
    return h


def test_c23_golden_swap_out_swap_in() -> None:
    h = _c23_before_r2()
    assert h.core.state.pool.num_free == 5
    out = h.step(arrival("r2", 100, 4))
    kinds = [type(c).__name__ for c in out.commands]
    assert "SpillOut" in kinds and kinds.index("SpillOut") < kinds.index("RunStep")
    spill = next(c for c in out.commands if isinstance(c, SpillOut))
    assert spill.request_id == "r1" and len(spill.block_ids) == 3
    step = next(c for c in out.commands if isinstance(c, RunStep))
    assert "r2" in step.request_ids and "r1" not in step.request_ids
    next_step = next(c for c in h.step().commands if isinstance(c, RunStep))
    assert set(spill.block_ids) & set(next_step.new_block_ids), "r1's blocks go to r2 after the SpillOut"
    h.run()

    order: list[str] = []
    for _, c in h.commands():
        if isinstance(c, SpillOut) and c.request_id == "r1":
            order.append("SpillOut(r1)")
        elif isinstance(c, RunStep) and "r2" in c.request_ids and c.positions[c.request_ids.index("r2")] == 0:
            order.append("prefill(r2)")
        elif isinstance(c, Finish) and c.request_id in ("r1", "r2"):
            order.append(f"Finish({c.request_id})")
        elif isinstance(c, SwapIn):
            order.append(f"SwapIn({c.request_id})")
    assert order == ["SpillOut(r1)", "prefill(r2)", "Finish(r2)", "SwapIn(r1)", "Finish(r1)"]
    finish_r2 = next(t for t, c in h.commands(Finish) if c.request_id == "r2")
    swap_in = next(t for t, c in h.commands(SwapIn))
    assert swap_in == finish_r2, "r1 is swapped in at the end of the tick in which r2 finishes"
    assert h.reason("r1") == "length" and h.output("r1") == unpressured_output("r1", 40, 8)
    assert h.reason("r0") == "length" and len(h.output("r0")) == 60
    assert not [c for _, c in h.commands(Preempted) if c.request_id == "r0"], "r0 is never preempted"


def _c23_until_swap_out() -> Harness:
    h = _c23_before_r2()
    h.step(arrival("r2", 100, 4))
    assert [c.request_id for _, c in h.commands(SpillOut)] == ["r1"]
    return h


def test_c23_a_swapped_in_request_drops_its_spill_entry_once_its_first_step_settles() -> None:
    h = _c23_until_swap_out()
    h.run()
    ticks = {type(c).__name__: t for t, c in h.commands() if getattr(c, "request_id", None) == "r1"}
    drops = [t for t, c in h.commands(DropSpill)]
    assert [c.request_id for _, c in h.commands(DropSpill)] == ["r1"], "dropped exactly once"
    assert ticks["SwapIn"] < drops[0] < ticks["Finish"]
    first_step = next(t for t, c in h.commands(RunStep) if t > ticks["SwapIn"] and "r1" in c.request_ids)
    assert drops[0] == first_step + 1, "in the tick that settles r1's first step after the swap-in"


def test_c12_a_request_that_ends_while_swapped_out_drops_its_spill_entry() -> None:
    h = _c23_until_swap_out()
    out = h.step(RequestCancelled("r1"))
    finish = next(c for c in out.commands if isinstance(c, Finish))
    assert finish.request_id == "r1" and finish.reason == "cancelled"
    assert DropSpill("r1") in out.commands
    h.run()
    assert [c.request_id for _, c in h.commands(DropSpill)] == ["r1"]
    assert not h.commands(SwapIn)


def test_c24_golden_requeue() -> None:
    config = CoreConfig(num_blocks=6, block_size=16, spill_enabled=False, admit_watermark=0, max_seq_len=64)
    h = Harness(config)
    h.step(arrival("r1", 15, 40), arrival("r2", 15, 40), arrival("r3", 15, 40))
    h.run()
    preempts = [c for _, c in h.commands(Preempted)]
    assert preempts and preempts[0] == Preempted("r3", "requeue"), "the first victim is the latest admitted"
    assert all(p.mode == "requeue" for p in preempts)
    for rid in ("r1", "r2", "r3"):
        assert h.reason(rid) == "length"
        assert h.output(rid) == unpressured_output(rid, 15, 40)
