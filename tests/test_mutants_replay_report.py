"""Behavioural tests that kill mutants of replay's reports (scripts/mutate.sh --area replay): the formatted report and
the rest of the replay rules."""

from __future__ import annotations

from pathlib import Path

import attrs
import msgspec

from tests.replay_helpers import everything_log, read_log, rewrite, rid_of, state_at_tick_20, ticks_of  # noqa: F401 (the log and state fixtures)
from tickloom.engine.core.snapshot import CoreSnapshot
from tickloom.events import (
    LogHeader,
    Preempted,
    ReleaseRequest,
    SnapshotRecord,
    StepDone,
    TickRecord,
)
from tickloom.replay import verify
from tickloom.replay.diff import (
    diff_commands,
    diff_state,
    summarise_inputs,
    value_diff,
)
from tickloom.replay.verify import ReplayReport, format_report

# --- format_report ---------------------------------------------------------------------------------------------------


def _report(status: str, **fields: object) -> ReplayReport:
    base = dict(engine_version="0.1", schema_hash="abc", format_version=1, digest_version=1)
    return ReplayReport(status, "x.tlog", **{**base, **fields})  # type: ignore[arg-type]


WRITTEN = "  log written by engine '0.1', schema abc, format 1, digest v1"


def test_format_report_of_each_status() -> None:
    assert format_report(_report("identical", ticks=10, rows=30, seconds=2.0)) == (
        "identical: 10 ticks, 30 rows, 5 ticks/s")
    assert format_report(_report("identical", ticks=10, rows=30, seconds=0.0)) == (
        "identical: 10 ticks, 30 rows, 0 ticks/s")
    assert format_report(_report("identical", ticks=1, rows=2, seconds=1.0, torn_bytes=7)) == (
        "identical: 1 ticks, 2 rows, 1 ticks/s (torn tail: 7 bytes after the last whole frame were dropped)")
    assert format_report(_report("clean", ticks=3, rows=4)) == "clean: no invariant violated in 3 ticks (4 rows)"
    assert format_report(_report("unreadable", error="x.tlog: bad")) == "unreadable: x.tlog: bad"
    violation = _report("violation", first_divergent_tick=4, error="E: e", inputs=["A()", "B()"])
    assert format_report(violation) == "\n".join(
        ["violation at tick 4: E: e", WRITTEN, "  inputs:", "    A()", "    B()"])
    assert format_report(_report("violation", first_divergent_tick=4, error="E: e")) == "\n".join(
        ["violation at tick 4: E: e", WRITTEN, "  inputs:", "    (none)"])
    assert _report("clean").format_text() == "clean: no invariant violated in 0 ticks (0 rows)"


def test_format_report_of_a_divergence_lists_every_part() -> None:
    full = _report("divergent", first_divergent_tick=6, ticks=6, error="why", inputs=["In()"],
                   command_diff=["c1", "c2"], gauges_diff=["g1"],
                   needs_tick_diff="needs_tick: expected True, got False", state_tick=7, state_diff=["s1"])
    assert format_report(full) == "\n".join([
        "divergent: first divergent tick 6 (after 6 identical ticks)", "  why", WRITTEN, "  inputs of that tick:",
        "    In()", "  commands (expected = logged, got = replayed):", "    c1", "    c2", "  gauges:", "    g1",
        "  needs_tick: expected True, got False",
        "  state after tick 7 (expected = logged snapshot, got = replayed):", "    s1"])
    bare = _report("divergent", first_divergent_tick=2, ticks=2)
    assert format_report(bare) == "\n".join([
        "divergent: first divergent tick 2 (after 2 identical ticks)", WRITTEN, "  inputs of that tick:", "    (none)"])


# --- the rest of the replay rules ----------------------------------------------------------------------------------


def test_diff_commands_aligns_long_lists_without_junk_heuristics() -> None:
    """A command missing from a long list of alike commands is one line, not a rewrite of the whole tail."""
    same = [ReleaseRequest("x")] * 150
    assert diff_commands([*same, Preempted("p", "swap"), *same], [*same, *same]) == [
        "commands[150]: missing Preempted(p)"]


def test_value_diff_of_a_struct_against_a_plain_value_shows_both() -> None:
    out: list[str] = []
    value_diff("p", ReleaseRequest("a"), 5, out)
    assert out == ["p: expected ReleaseRequest(request_id='a'), got 5"]
    out = []
    value_diff("p", None, ReleaseRequest("a"), out)
    assert out == ["p: expected None, got ReleaseRequest(request_id='a')"]


def test_summarise_inputs_skips_only_empty_fields() -> None:
    from tickloom.events import ClientGone

    nine = StepDone(1, list("abcdefghi"), list(range(9)))
    assert summarise_inputs([nine]) == [
        "StepDone(step_id=1, request_ids=['a', 'b', 'c', 'd', 'e', 'f', 'g', 'h', ... 9 items], "
        "token_ids=[0, 1, 2, 3, 4, 5, 6, 7, ... 9 items])"]
    assert summarise_inputs([ClientGone("")]) == ["ClientGone()"]
    after_a_skip = StepDone(2, ["a"], [0], step_time_ns=0, logprobs=[0.5])
    assert summarise_inputs([after_a_skip]) == ["StepDone(step_id=2, request_ids=['a'], token_ids=[0], logprobs=[0.5])"]


def test_diff_state_names_a_field_set_on_one_side_only(state: CoreSnapshot) -> None:
    i = state.running[0]
    rid = rid_of(state, i)
    assert state.seqs[i].finish_reason is None
    seqs = list(state.seqs)
    seqs[i] = attrs.evolve(seqs[i], finish_reason="stop")
    finished = msgspec.structs.replace(state, seqs=seqs)
    assert diff_state(finished, state) == [f"request {rid!r}.finish_reason: expected 'stop', got None"]
    assert diff_state(state, finished) == [f"request {rid!r}.finish_reason: expected None, got 'stop'"]


def test_open_log_reads_the_header(log: Path) -> None:
    from tickloom.replay.verify import open_log

    header, _ = read_log(log)
    with open_log(log) as reader:
        assert reader.header == header


def test_unchecked_snapshots_still_replay_every_tick(log: Path) -> None:
    _, records = read_log(log)
    report = verify(log, check_snapshots=False)
    assert (report.ticks, report.snapshots_checked) == (len(ticks_of(records)), 0)


def _flip_needs_tick(recs: list, tick: int) -> list:
    return [TickRecord(r.inputs, msgspec.structs.replace(r.outputs, needs_tick=not r.outputs.needs_tick))
            if isinstance(r, TickRecord) and r.inputs.tick == tick else r for r in recs]


def test_the_state_diff_skips_a_misplaced_snapshot_on_its_way(log: Path, tmp_path: Path) -> None:
    def edit(header: LogHeader, recs: list) -> tuple[LogHeader, list]:
        out = _flip_needs_tick(recs, 9)
        seven = next(r for r in recs if isinstance(r, SnapshotRecord) and r.tick == 7)
        at = next(i for i, r in enumerate(out) if isinstance(r, TickRecord) and r.inputs.tick == 10)
        return header, [*out[: at + 1], seven, *out[at + 1:]]

    report = verify(rewrite(log, tmp_path / "stray.tlog", edit))
    assert report.status == "divergent" and report.first_divergent_tick == 9
    assert report.state_tick == 15 and report.state_diff == []


def test_a_diverged_core_that_raises_later_has_no_state_diff(log: Path, tmp_path: Path) -> None:
    def edit(header: LogHeader, recs: list) -> tuple[LogHeader, list]:
        out = []
        for r in _flip_needs_tick(recs, 9):
            if isinstance(r, TickRecord) and r.inputs.tick == 12:
                unknown_step = StepDone(99999, ["x"], [1])
                r = TickRecord(msgspec.structs.replace(r.inputs, inputs=[*r.inputs.inputs, unknown_step]), r.outputs)
            out.append(r)
        return header, out

    report = verify(rewrite(log, tmp_path / "later.tlog", edit))
    assert report.status == "divergent" and report.first_divergent_tick == 9
    assert len(report.state_diff) == 1
    assert report.state_diff[0].startswith("(no state diff: the diverged core raised at tick 12: ")
    assert report.state_diff[0].endswith(": steps settle in order: got a result for step 99999, expected 11)")
    assert report.state_tick is None
