"""One layout of the logprob columns (``events.commands.LogprobColumns``): the wire Structs that must spell it out
spell exactly it, and the code that moves the columns (the oracle, the executors' ``StepResult``, the core's emit)
takes it by name, so a column added to one place and not the others fails here."""

from __future__ import annotations

import dataclasses
import typing

import msgspec

from tickloom.engine.model.types import StepResult
from tickloom.events import EmitTokens, StepDone
from tickloom.events.commands import LogprobColumns, PromptLogprobs
from tickloom.events.oracle import OracleRow, OracleStep, oracle_step
from tickloom.events.types import SamplingSpec

COLUMNS = LogprobColumns._fields


def _hints(owner: type) -> dict[str, object]:
    return typing.get_type_hints(owner)


AFTER_COLUMNS = {EmitTokens: (), StepDone: ("extra_token_ids", "proposed")}
"""Fields a struct appended after the logprob columns (a wire struct only grows at its end)."""


def test_the_wire_structs_carry_the_columns_last_in_their_order_and_types() -> None:
    want = _hints(LogprobColumns)
    for struct, after in AFTER_COLUMNS.items():
        fields = msgspec.structs.fields(struct)
        assert tuple(f.name for f in fields[len(fields) - len(after):]) == after, struct.__name__
        last = fields[len(fields) - len(after) - len(COLUMNS): len(fields) - len(after)]
        assert tuple(f.name for f in last) == COLUMNS, struct.__name__
        assert {f.name: f.type for f in last} == want, struct.__name__
        assert all(f.default is None for f in last), f"{struct.__name__}: optional columns default to None"


def test_step_done_and_a_step_result_are_the_sampled_tokens_then_the_columns() -> None:
    """The stub device and the stub executor build them as tokens then ``*columns``."""
    assert tuple(f.name for f in msgspec.structs.fields(StepDone)) == (
        "step_id", "request_ids", "token_ids", "step_time_ns", *COLUMNS, "extra_token_ids", "proposed")
    assert tuple(f.name for f in dataclasses.fields(StepResult)) == (
        "token_ids", *COLUMNS, "extra_token_ids", "proposed")
    assert {name: hint for name, hint in _hints(StepResult).items() if name in COLUMNS} == _hints(LogprobColumns)


def _entry(column: object) -> object:
    """The type of one row's entry in an optional column: ``X`` of ``list[X] | None``."""
    listed = next(arg for arg in typing.get_args(column) if arg is not type(None))
    return typing.get_args(listed)[0]


def test_the_prompt_logprobs_of_one_row_are_its_entries_of_the_three_prompt_columns() -> None:
    hints = _hints(LogprobColumns)
    prompt_columns = ("prompt_logprobs", "prompt_top_token_ids", "prompt_top_logprobs")
    assert typing.get_args(PromptLogprobs) == tuple(_entry(hints[name]) for name in prompt_columns)


def test_the_oracle_fills_the_columns_by_name() -> None:
    spec = SamplingSpec(max_tokens=4, logprobs=True, top_logprobs=2, prompt_logprobs=1)
    step = oracle_step([OracleRow(7, 0, spec, [3, 4, 5]), OracleRow(8, 2, None, [])], vocab_size=50)
    assert isinstance(step, OracleStep) and len(step.token_ids) == 2
    columns = step.columns
    assert isinstance(columns, LogprobColumns)
    assert all(len(getattr(columns, name)) == 2 for name in COLUMNS)
    assert columns.prompt_logprobs is not None
    assert len(columns.prompt_logprobs[0]) == 2 and columns.prompt_logprobs[1] == [], "only output 0 carries them"
    done = StepDone(0, ["a", "b"], step.token_ids, 0, *step.columns)
    assert LogprobColumns(*(getattr(done, name) for name in COLUMNS)) == columns
