"""The device's poisoning of a failed step's requests: rows cut out of later steps, placeholders put back."""

from __future__ import annotations

from tickloom.actors.device import executor_inputs, with_placeholders, without_requests
from tickloom.engine.model.types import StepResult
from tickloom.events import NO_SAMPLE, NOT_FED, RunStep

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
    assert executor_inputs(cut) == [-1, 7, 8, 9], "a fed row takes the token sampled before it"


def test_placeholders_fill_the_dead_rows_in_row_order() -> None:
    step = RunStep(7, ["a", "dead", "b"], [1, 1, 1], [1, 1, 1], [1, 1, 1], [NOT_FED] * 3, [0, 0, 0], [0, 0, 0],
                   [0, 0, 0], [])
    live = StepResult([11, 33], [-0.5, -0.25], [[11], [33]], [[-0.5], [-0.25]])
    wide = with_placeholders(step, {"dead"}, live)
    assert wide.token_ids == [11, 0, 33]
    assert wide.logprobs == [-0.5, 0.0, -0.25] and wide.top_token_ids == [[11], [], [33]]
    assert with_placeholders(step, {"a", "dead", "b"}, None).token_ids == [0, 0, 0], "all dead: no executor call"
