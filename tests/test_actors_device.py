"""The device's poisoning of a failed step's (or failed swap-in's) requests: rows cut out of later steps,
placeholders put back."""

from __future__ import annotations

import pytest
import trio

from tickloom.actors.device import ThreadDevice, with_placeholders, without_requests
from tickloom.actors.mailbox import Envelope, Outbox, Source
from tickloom.actors.spill import SpillActor, SpillStore
from tickloom.engine.model.stub import StubExecutor
from tickloom.engine.model.tables import step_inputs, step_of
from tickloom.engine.model.types import StepResult
from tickloom.events import NO_SAMPLE, NOT_FED, BindRequest, RunStep, SamplingSpec, StepDone, SwapIn, SwapInFailed

STEP = RunStep(
    step_id=7, request_ids=["a", "dead", "b"], positions=[10, 3, 0], num_tokens=[1, 1, 3], token_ids=[5, 6, 7, 8, 9],
    fed_from=[6, 6, NOT_FED], sample_indices=[4, 2, NO_SAMPLE], block_starts=[1, 1, 0], num_new_blocks=[0, 1, 2],
    new_block_ids=[40, 41, 42],
)


def test_rows_of_dead_requests_are_cut_from_every_column() -> None:
    cut = without_requests(STEP, {"dead"})
    assert cut.request_ids == ["a", "b"] and cut.positions == [10, 0] and cut.num_tokens == [1, 3]
    assert cut.token_ids == [5, 7, 8, 9] and cut.fed_from == [6, NOT_FED]
    assert cut.sample_indices == [4, NO_SAMPLE] and cut.block_starts == [1, 0] and cut.num_new_blocks == [0, 2]
    assert cut.new_block_ids == [41, 42], "the dead row's new block is dropped, the others keep theirs"
    assert step_inputs(cut) == [-1, 7, 8, 9], "a fed row takes the token sampled before it"


def test_a_step_from_columns_marks_fed_rows_and_reads_back_alike() -> None:
    """``step_of`` (tests and benchmarks) and ``step_inputs`` (every executor) are each other's inverse: a fed row
    is one whose first input is the token its request sampled, whatever step it was planned in."""
    for step_id in (0, 1, 9):
        step = step_of(["a", "b", "c"], [4, 0, 7], [1, 2, 1], [-1, 3, 4, -1], [1, 0, 2], [1, 0, 2], [0, 1, 0], [5],
                       step_id=step_id)
        assert step.step_id == step_id and step.token_ids == [0, 3, 4, 0]
        assert [f != NOT_FED for f in step.fed_from] == [True, False, True]
        assert step_inputs(step) == [-1, 3, 4, -1]
    assert step_inputs(STEP) == [-1, -1, 7, 8, 9]


def test_placeholders_fill_the_dead_rows_in_row_order() -> None:
    step = RunStep(7, ["a", "dead", "b"], [1, 1, 1], [1, 1, 1], [1, 1, 1], [NOT_FED] * 3, [0, 0, 0], [0, 0, 0],
                   [0, 0, 0], [])
    live = StepResult([11, 33], [-0.5, -0.25], [[11], [33]], [[-0.5], [-0.25]])
    wide = with_placeholders(step, {"dead"}, live)
    assert wide.token_ids == [11, 0, 33]
    assert wide.logprobs == [-0.5, 0.0, -0.25] and wide.top_token_ids == [[11], [], [33]]
    assert with_placeholders(step, {"a", "dead", "b"}, None).token_ids == [0, 0, 0], "all dead: no executor call"


async def test_a_failed_swap_in_poisons_its_request_and_spares_the_rest_of_the_next_step() -> None:
    """Soak regression: a ``DropSpill`` (the request was cancelled) reached the spill actor while the request's
    ``SwapIn`` still waited in the device's queue, so the SwapIn found no copy. The next step carried a row of that
    request over the blocks the copy was to fill; the executor rejected the whole step, and every other request in
    it ended with an error. The failed SwapIn must poison its request: its row is cut, the others run."""
    send, receive = trio.open_memory_channel[Envelope](16)
    outbox = Outbox(Source.DEVICE, send)
    spill = SpillActor(SpillStore(None, host_bytes=0), outbox, 8)
    executor = StubExecutor(vocab_size=512, block_size=16)
    device = ThreadDevice(executor, outbox, spill, 8)
    spec = SamplingSpec(max_tokens=4)
    step = RunStep(step_id=3, request_ids=["swapped", "fresh"], positions=[32, 0], num_tokens=[1, 2],
                   token_ids=[7, 8, 9], fed_from=[NOT_FED, NOT_FED], sample_indices=[14, 0], block_starts=[3, 0],
                   num_new_blocks=[0, 1], new_block_ids=[5])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(device.run)
        for command in (BindRequest("swapped", spec, 1, 19, []), BindRequest("fresh", spec, 2, 2, []),
                        SwapIn("swapped", [10, 6, 1], 32), step):
            device.submit_nowait(command)
        with trio.fail_after(30):
            failed = (await receive.receive()).msg
            done = (await receive.receive()).msg
        nursery.cancel_scope.cancel()
    assert isinstance(failed, SwapInFailed) and failed.request_id == "swapped"
    assert isinstance(done, StepDone), f"the step ran for the other request, not {done}"
    fresh = executor.run_step(step_of(["fresh"], [2], [1], [9], [1], [1], [0], []))  # the fresh row's table was applied
    assert done.request_ids == ["swapped", "fresh"] and done.token_ids[0] == 0, "the poisoned row is a placeholder"
    assert fresh.token_ids and executor.block_table("fresh") == [5]


def test_an_executor_refuses_a_row_its_block_table_does_not_cover() -> None:
    """Both executors check, before running a row, that its table covers its positions (the check that caught the
    soak's stale table): 32 tokens fill two blocks of 16, so position 32 needs a third."""
    executor = StubExecutor(block_size=16)
    executor.bind(BindRequest("r", SamplingSpec(max_tokens=4), 1, 32, []))
    executor.run_step(step_of(["r"], [0], [32], list(range(32)), [NO_SAMPLE], [0], [2], [4, 9]))
    with pytest.raises(ValueError, match="row 0: positions up to 32 need 3 blocks, block table has 2"):
        executor.run_step(step_of(["r"], [32], [1], [3], [0], [2], [0], []))
