"""Behavioural tests that kill the mutants of the replay area (scripts/mutate.sh --area replay): exact replay's
reports and the field-level diffs. A divergence report is what a person reads to find a bug, so its lines are pinned
exactly: which command, which field, which index, expected (logged) against got (replayed)."""

from __future__ import annotations

from pathlib import Path

import attrs
import msgspec
import pytest

from tests.replay_helpers import read_log, record_everything, rewrite
from tickloom.engine.core.snapshot import CoreSnapshot
from tickloom.events import (
    CoreGauges,
    DropSpill,
    EmitTokens,
    Finish,
    Preempted,
    ReleaseRequest,
    RequestArrived,
    RunStep,
    SnapshotRecord,
    StepDone,
    TickRecord,
)
from tickloom.events.types import Usage
from tickloom.replay import diff
from tickloom.replay.diff import (
    MAX_ITEMS,
    describe,
    diff_commands,
    diff_gauges,
    diff_state,
    summarise_inputs,
    value_diff,
)


def step(step_id: int, rows: list[str], tokens: list[int] | None = None) -> RunStep:
    n = len(rows)
    return RunStep(step_id, rows, list(range(n)), [1] * n, tokens if tokens is not None else [7] * n, [-1] * n,
                   list(range(n)), [0] * n, [0] * n, [])


# --- describe and value_diff -------------------------------------------------------------------------------------


def test_describe_names_a_command_by_request_or_step() -> None:
    assert describe(step(4, ["a", "b", "c"])) == "RunStep(step 4, 3 rows)"
    assert describe(ReleaseRequest("r1")) == "ReleaseRequest(r1)"
    assert describe(Preempted("r2", "swap")) == "Preempted(r2)"
    assert describe(EmitTokens(["a"], [1], [0], [False])) == "EmitTokens"
    assert diff._key(step(0, [])) == ("RunStep", "step 0")
    assert diff._key(DropSpill("x")) == ("DropSpill", "x")
    assert diff._key(EmitTokens([], [], [], [])) == ("EmitTokens", "")


def test_value_diff_names_each_differing_leaf() -> None:
    out: list[str] = []
    value_diff("x", 1, 1, out)
    assert out == []
    value_diff("x", 1, 2, out)
    assert out == ["x: expected 1, got 2"]
    out = []
    value_diff("c", ReleaseRequest("a"), ReleaseRequest("b"), out)
    assert out == ["c.request_id: expected 'a', got 'b'"]
    out = []
    value_diff("c", ReleaseRequest("a"), Preempted("a", "swap"), out)
    assert out == ["c: expected ReleaseRequest, got Preempted"]
    out = []
    value_diff("l", [1, 2, 3], [1, 5, 3, 4], out)
    assert out == ["l: expected 3 items, got 4", "l[1]: expected 2, got 5"]
    out = []
    value_diff("t", (1, 2), [1, 3], out)
    assert out == ["t[1]: expected 2, got 3"]
    out = []
    value_diff("s", "ab", ["a", "b"], out)
    assert out == ["s: expected 'ab', got ['a', 'b']"]


def test_value_diff_lists_at_most_max_items_differences() -> None:
    n = MAX_ITEMS + 5
    out: list[str] = []
    value_diff("v", list(range(n)), [i + 1 for i in range(n)], out)
    assert out == [f"v[{i}]: expected {i}, got {i + 1}" for i in range(MAX_ITEMS)] + ["v: ... more differences"]
    out = []
    value_diff("v", list(range(MAX_ITEMS)), [i + 1 for i in range(MAX_ITEMS)], out)
    assert len(out) == MAX_ITEMS and "more" not in out[-1]
    out = []  # equal elements do not count towards the limit
    expected = [0] * (2 * MAX_ITEMS)
    actual = [0] * (2 * MAX_ITEMS - 1) + [1]
    value_diff("w", expected, actual, out)
    assert out == [f"w[{2 * MAX_ITEMS - 1}]: expected 0, got 1"]


# --- diff_commands -------------------------------------------------------------------------------------------------


def test_diff_commands_aligns_by_type_and_request() -> None:
    a = [ReleaseRequest("a"), step(1, ["a", "b"], [5, 6]), ReleaseRequest("b")]
    assert diff_commands(a, a) == []
    b = [ReleaseRequest("a"), step(1, ["a", "b"], [5, 9]), ReleaseRequest("b")]
    assert diff_commands(a, b) == ["commands[1].token_ids[1]: expected 6, got 9"]
    # a missing command and an added one
    assert diff_commands(a, [a[0], a[2]]) == ["commands[1]: missing RunStep(step 1, 2 rows)"]
    assert diff_commands([a[0], a[2]], a) == ["commands[+1]: added RunStep(step 1, 2 rows)"]
    # one replaced by another of the same length: compared field by field, or named when the types differ
    c = [ReleaseRequest("a"), Preempted("x", "swap"), ReleaseRequest("b")]
    assert diff_commands(a, c) == ["commands[1]: expected RunStep(step 1, 2 rows), got Preempted(x)"]
    d = [ReleaseRequest("a"), ReleaseRequest("z"), ReleaseRequest("b")]
    assert diff_commands([ReleaseRequest("a"), ReleaseRequest("y"), ReleaseRequest("b")], d) == [
        "commands[1].request_id: expected 'y', got 'z'"]
    # a replace of unequal lengths lists what is missing and what is added
    e = [ReleaseRequest("a"), Preempted("p", "requeue"), Preempted("q", "swap"), ReleaseRequest("b")]
    assert diff_commands(a, e) == ["commands[1]: missing RunStep(step 1, 2 rows)", "commands[+1]: added Preempted(p)",
                                   "commands[+2]: added Preempted(q)"]


def test_diff_commands_same_key_other_fields() -> None:
    a = [Finish("r", "stop", Usage(5, 0, 3))]
    b = [Finish("r", "length", Usage(5, 0, 4))]
    lines = diff_commands(a, b)
    assert "commands[0].reason: expected 'stop', got 'length'" in lines
    assert lines == ["commands[0].reason: expected 'stop', got 'length'",
                     "commands[0].usage.completion_tokens: expected 3, got 4"]


def test_diff_gauges() -> None:
    g = CoreGauges(1, 2, 3, 4, 5, 6)
    assert diff_gauges(g, g) == []
    assert diff_gauges(g, CoreGauges(1, 2, 3, 4, 9, 6)) == ["gauges.free_blocks: expected 5, got 9"]


# --- summarise_inputs ----------------------------------------------------------------------------------------------


def test_summarise_inputs_shows_the_fields_that_say_something() -> None:
    done = StepDone(0, [], [], step_time_ns=0)  # a step id of 0 is shown; other zeros, None and "" are not
    assert summarise_inputs([done]) == ["StepDone(step_id=0, request_ids=[], token_ids=[])"]
    timed = StepDone(2, ["a"], [0], step_time_ns=5)
    assert summarise_inputs([timed, done]) == ["StepDone(step_id=2, request_ids=['a'], token_ids=[0], step_time_ns=5)",
                                               "StepDone(step_id=0, request_ids=[], token_ids=[])"]
    ten = StepDone(3, ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"], list(range(10)))
    assert summarise_inputs([ten]) == [
        "StepDone(step_id=3, request_ids=['a', 'b', 'c', 'd', 'e', 'f', 'g', 'h', ... 10 items], "
        "token_ids=[0, 1, 2, 3, 4, 5, 6, 7, ... 10 items])"]
    eight = StepDone(1, list("abcdefgh"), [0, 1, 2, 3, 4, 5, 6, 7])
    assert summarise_inputs([eight]) == [
        "StepDone(step_id=1, request_ids=['a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'], token_ids=[0, 1, 2, 3, 4, 5, 6, 7])"]
    assert summarise_inputs([]) == []
