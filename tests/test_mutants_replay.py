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


# --- diff_state ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("replay") / "everything.tlog"
    record_everything(path)
    return path


@pytest.fixture(scope="module")
def state(log: Path) -> CoreSnapshot:
    """The core after tick 20 of the everything scenario: requests running, preempted and swapped, two steps in
    flight."""
    from tickloom.replay import state_at

    snap = state_at(log, 20)
    assert snap.running and snap.preempted and snap.swapping_or_swapped and len(snap.steps) == 2
    return snap


def _rid(snap: CoreSnapshot, i: int) -> str:
    return snap.seqs[i].request_id


def test_diff_state_of_equal_states_is_empty(state: CoreSnapshot) -> None:
    assert diff_state(state, state) == []


def test_diff_state_names_the_tick(state: CoreSnapshot) -> None:
    later = msgspec.structs.replace(state, tick=state.tick + 3)
    assert diff_state(state, later) == [f"tick: expected {state.tick}, got {state.tick + 3}"]


def test_diff_state_names_a_request_field(state: CoreSnapshot) -> None:
    i = state.running[0]
    seqs = list(state.seqs)
    seqs[i] = attrs.evolve(seqs[i], num_computed=seqs[i].num_computed + 5)
    changed = msgspec.structs.replace(state, seqs=seqs)
    rid = _rid(state, i)
    assert diff_state(state, changed) == [
        f"request {rid!r}.num_computed: expected {state.seqs[i].num_computed}, got {state.seqs[i].num_computed + 5}"]
    outputs = list(state.seqs[i].outputs)
    outputs[0] += 1
    seqs[i] = attrs.evolve(state.seqs[i], outputs=outputs)
    assert diff_state(state, msgspec.structs.replace(state, seqs=seqs)) == [
        f"request {rid!r}.outputs[0]: expected {state.seqs[i].outputs[0]}, got {outputs[0]}"]


def test_diff_state_names_requests_live_on_one_side_only(state: CoreSnapshot) -> None:
    # the last live sequence is gone from the replayed state (and from its queue)
    last = state.live - 1
    rid = _rid(state, last)
    queue = next(q for q in ("waiting", "running", "preempted", "swapping_or_swapped") if last in getattr(state, q))
    fewer = msgspec.structs.replace(state, live=state.live - 1,
                                    **{queue: [i for i in getattr(state, queue) if i != last]})
    name = {"swapping_or_swapped": "swapping_or_swapped"}.get(queue, queue)
    lines = diff_state(state, fewer)
    e_ids = [_rid(state, i) for i in getattr(state, queue)]
    a_ids = [_rid(state, i) for i in getattr(fewer, queue)]
    assert lines == [f"request {rid!r}: live in the log, gone in replay",
                     f"queue {name}: expected {e_ids}, got {a_ids}"]
    assert diff_state(fewer, state) == [f"request {rid!r}: live in replay, not in the log",
                                        f"queue {name}: expected {a_ids}, got {e_ids}"]


def test_diff_state_names_a_reordered_queue(state: CoreSnapshot) -> None:
    running = list(reversed(state.running))
    changed = msgspec.structs.replace(state, running=running)
    assert diff_state(state, changed) == [
        f"queue running: expected {[_rid(state, i) for i in state.running]}, got {[_rid(state, i) for i in running]}"]
    preempted = list(reversed(state.preempted))
    assert diff_state(state, msgspec.structs.replace(state, preempted=preempted)) == [
        f"queue preempted: expected {[_rid(state, i) for i in state.preempted]}, "
        f"got {[_rid(state, i) for i in preempted]}"]


def test_diff_state_names_the_blocks(state: CoreSnapshot) -> None:
    pool = state.pool
    # one block freed on the replayed side only, its refcount dropped
    used = next(b for b, r in enumerate(pool.ref) if r == 1)
    ref = list(pool.ref)
    ref[used] = 0
    changed = msgspec.structs.replace(state, pool=msgspec.structs.replace(pool, free=[*pool.free, used], ref=ref))
    assert diff_state(state, changed) == [
        f"blocks: free {len(pool.free)} vs {len(pool.free) + 1}, cached {len(pool.cached)} vs {len(pool.cached)}; "
        f"refcounts differ for blocks {[used]}",
        f"blocks free in one side only: {[used]}"]
    # only the cached list differs
    cached = msgspec.structs.replace(state, pool=msgspec.structs.replace(pool, cached=[*pool.cached, 999]))
    assert diff_state(state, cached) == [
        f"blocks: free {len(pool.free)} vs {len(pool.free)}, cached {len(pool.cached)} vs {len(pool.cached) + 1}; "
        "refcounts differ for blocks []"]
    # only refcounts differ, more of them than are listed
    many = [r + 1 for r in pool.ref]
    assert len(many) > MAX_ITEMS
    lines = diff_state(state, msgspec.structs.replace(state, pool=msgspec.structs.replace(pool, ref=many)))
    assert lines == [f"blocks: free {len(pool.free)} vs {len(pool.free)}, cached {len(pool.cached)} vs "
                     f"{len(pool.cached)}; refcounts differ for blocks {list(range(MAX_ITEMS))} ..."]
    exactly = [r + 1 if b < MAX_ITEMS else r for b, r in enumerate(pool.ref)]
    lines = diff_state(state, msgspec.structs.replace(state, pool=msgspec.structs.replace(pool, ref=exactly)))
    assert lines[0].endswith(f"refcounts differ for blocks {list(range(MAX_ITEMS))}")
    shorter = msgspec.structs.replace(state, pool=msgspec.structs.replace(pool, ref=pool.ref[:-1]))
    assert diff_state(state, shorter) == [
        f"blocks: free {len(pool.free)} vs {len(pool.free)}, cached {len(pool.cached)} vs {len(pool.cached)}; "
        "refcounts differ for blocks []"]


def test_diff_state_names_the_steps_in_flight(state: CoreSnapshot) -> None:
    ids = [s.step_id for s in state.steps]
    changed = msgspec.structs.replace(state, steps=state.steps[:1])
    assert diff_state(state, changed) == [f"steps in flight: expected {ids}, got {ids[:1]}"]


def test_seq_view_of_a_non_attrs_value_is_empty() -> None:
    assert diff._seq_view(object()) == {}
    assert diff._seq_view(3) == {}


# --- verify, bisect, core_at ---------------------------------------------------------------------------------------

from tickloom.engine.core.snapshot import decode_snapshot, encode_snapshot  # noqa: E402
from tickloom.events import LogCorrupt, LogHeader, LogReader, LogWriter  # noqa: E402
from tickloom.replay import bisect, core_at, verify  # noqa: E402
from tickloom.replay.verify import EXIT_CODES, ReplayReport, format_report, mark_unreadable  # noqa: E402


def _ticks(records: list[TickRecord | SnapshotRecord]) -> list[TickRecord]:
    return [r for r in records if isinstance(r, TickRecord)]


def _frame_of(path: Path, kind: str, tick: int) -> int:
    with LogReader(path) as reader:
        return next(i.offset for i in reader.frames() if i.kind == kind and i.tick == tick)


def test_an_identical_replay_counts_ticks_rows_and_snapshots(log: Path) -> None:
    header, records = read_log(log)
    ticks = _ticks(records)
    rows = sum(len(c.request_ids) for t in ticks for c in t.outputs.commands if isinstance(c, RunStep))
    report = verify(log)
    assert report.status == "identical" and report.exit_code == 0
    assert report.path == str(log)
    assert (report.ticks, report.rows) == (len(ticks), rows)
    assert report.snapshots_checked == sum(isinstance(r, SnapshotRecord) for r in records) > 0
    assert (report.engine_version, report.schema_hash, report.format_version, report.digest_version) == (
        header.engine_version, header.schema_hash, header.format_version, header.digest_version)
    assert 0 < report.seconds < 60
    assert report.byte_offset is None and report.torn_bytes == 0 and report.error is None
    as_json = report.to_json()
    assert as_json["ticks_per_s"] == report.ticks_per_s == report.ticks / report.seconds
    assert as_json["status"] == "identical" and as_json["ticks"] == len(ticks)
    assert format_report(report) == f"identical: {len(ticks)} ticks, {rows} rows, {report.ticks_per_s:.0f} ticks/s"
    unchecked = verify(log, check_snapshots=False)
    assert unchecked.status == "identical" and unchecked.snapshots_checked == 0
    clean = bisect(log)
    assert clean.status == "clean" and clean.exit_code == 0 and clean.path == str(log)
    assert (clean.ticks, clean.rows, clean.torn_bytes) == (len(ticks), rows, 0)
    assert clean.schema_hash == header.schema_hash and 0 < clean.seconds < 60
    assert format_report(clean) == f"clean: no invariant violated in {len(ticks)} ticks ({rows} rows)"


def test_a_tick_out_of_sequence_is_a_divergence_naming_both_ticks(log: Path, tmp_path: Path) -> None:
    def drop(header: LogHeader, recs: list) -> tuple[LogHeader, list]:
        return header, [r for r in recs if not (isinstance(r, TickRecord) and r.inputs.tick == 10)]

    bad = rewrite(log, tmp_path / "gap.tlog", drop)
    _, records = read_log(log)
    eleven = next(t for t in _ticks(records) if t.inputs.tick == 11)
    report = verify(bad)
    assert report.status == "divergent" and report.first_divergent_tick == 10 and report.ticks == 10
    assert report.error == "the log holds tick 11 (outputs of tick 11) where tick 10 was expected"
    assert report.inputs == summarise_inputs(eleven.inputs.inputs)
    assert report.state_diff == [] and report.state_tick is None


def test_a_core_that_raises_is_a_divergence_naming_the_exception(log: Path, tmp_path: Path) -> None:
    def edit(header: LogHeader, recs: list) -> tuple[LogHeader, list]:
        out = []
        for r in recs:
            if isinstance(r, TickRecord) and r.inputs.tick == 12:
                unknown_step = StepDone(99999, ["x"], [1])
                r = TickRecord(msgspec.structs.replace(r.inputs, inputs=[*r.inputs.inputs, unknown_step]), r.outputs)
            out.append(r)
        return header, out

    bad = rewrite(log, tmp_path / "raise.tlog", edit)
    report = verify(bad)
    assert report.status == "divergent" and report.first_divergent_tick == 12 and report.ticks == 12
    assert report.error is not None and report.error.startswith("the core raised at tick 12: ")
    assert report.error.split(": ")[1] in ("KeyError", "InvariantViolation", "ValueError", "IndexError")
    _, records = read_log(bad)
    assert report.inputs == summarise_inputs(next(t for t in _ticks(records) if t.inputs.tick == 12).inputs.inputs)
    assert report.state_diff == [] and report.command_diff == []
    text = format_report(report)
    assert text.splitlines()[:2] == ["divergent: first divergent tick 12 (after 12 identical ticks)",
                                     f"  {report.error}"]


def test_a_changed_needs_tick_is_a_divergence_with_the_state_at_the_next_snapshot(log: Path, tmp_path: Path) -> None:
    def edit(header: LogHeader, recs: list) -> tuple[LogHeader, list]:
        out = []
        for r in recs:
            if isinstance(r, TickRecord) and r.inputs.tick == 9:
                r = TickRecord(r.inputs, msgspec.structs.replace(r.outputs, needs_tick=not r.outputs.needs_tick))
            out.append(r)
        return header, out

    _, records = read_log(log)
    logged = next(t for t in _ticks(records) if t.inputs.tick == 9).outputs.needs_tick
    report = verify(rewrite(log, tmp_path / "needs.tlog", edit))
    assert report.status == "divergent" and report.first_divergent_tick == 9 and report.ticks == 9
    assert report.needs_tick_diff == f"needs_tick: expected {not logged}, got {logged}"
    assert report.command_diff == [] and report.gauges_diff == []
    assert report.state_tick == 15 and report.state_diff == []  # the replayed core is the logged one
    assert f"  {report.needs_tick_diff}" in format_report(report).splitlines()


def test_a_changed_token_shows_commands_gauges_and_state(log: Path, tmp_path: Path) -> None:
    _, records = read_log(log)
    target = next(t for t in _ticks(records) if t.inputs.tick >= 3
                  and any(isinstance(i, StepDone) and i.token_ids for i in t.inputs.inputs))
    tick = target.inputs.tick

    def edit(header: LogHeader, recs: list) -> tuple[LogHeader, list]:
        out = []
        for r in recs:
            if isinstance(r, TickRecord) and r.inputs.tick == tick:
                items = [msgspec.structs.replace(i, token_ids=[(t + 1) % 90 + 3 for t in i.token_ids])
                         if isinstance(i, StepDone) else i for i in r.inputs.inputs]
                r = TickRecord(msgspec.structs.replace(r.inputs, inputs=items), r.outputs)
            out.append(r)
        return header, out

    report = verify(rewrite(log, tmp_path / "token.tlog", edit))
    assert report.status == "divergent" and report.first_divergent_tick == tick and report.ticks == tick
    assert report.command_diff and report.needs_tick_diff is None
    next_snapshot = min(r.tick for r in records if isinstance(r, SnapshotRecord) and r.tick >= tick)
    assert report.state_tick == next_snapshot and report.state_diff
    text = format_report(report).splitlines()
    assert "  commands (expected = logged, got = replayed):" in text
    assert [f"    {line}" for line in report.command_diff] == text[text.index(
        "  commands (expected = logged, got = replayed):") + 1:][: len(report.command_diff)]
    header = f"  state after tick {next_snapshot} (expected = logged snapshot, got = replayed):"
    assert text[text.index(header) + 1:] == [f"    {line}" for line in report.state_diff]


def _rewrite_tick(log: Path, out: Path, tick: int, edit_outputs: object) -> Path:
    def edit(header: LogHeader, recs: list) -> tuple[LogHeader, list]:
        return header, [TickRecord(r.inputs, edit_outputs(r.outputs)) if isinstance(r, TickRecord)  # type: ignore[operator]
                        and r.inputs.tick == tick else r for r in recs]
    return rewrite(log, out, edit)


def test_logged_commands_or_gauges_unlike_the_digest_are_corruption(log: Path, tmp_path: Path) -> None:
    bad = _rewrite_tick(log, tmp_path / "gauges.tlog", 6, lambda o: msgspec.structs.replace(
        o, gauges=msgspec.structs.replace(o.gauges, waiting=o.gauges.waiting + 1)))
    offset = _frame_of(bad, "tick", 6)
    report = verify(bad)
    assert report.status == "unreadable" and report.exit_code == 2 and report.byte_offset == offset
    assert report.error == str(LogCorrupt(str(bad), offset, 6,
                                          "the logged commands or gauges do not match the logged digest"))
    assert format_report(report) == f"unreadable: {report.error}"
    bad2 = _rewrite_tick(log, tmp_path / "commands.tlog", 6, lambda o: msgspec.structs.replace(
        o, commands=o.commands[:-1]))
    report = verify(bad2)
    assert report.status == "unreadable" and report.byte_offset == _frame_of(bad2, "tick", 6)
    assert report.error is not None and report.error.endswith(
        "the logged commands or gauges do not match the logged digest")


def test_undecodable_logged_commands_at_a_divergence_are_corruption(log: Path, tmp_path: Path) -> None:
    header, records = read_log(log)
    bad = tmp_path / "raw.tlog"
    with LogWriter(bad, header) as writer:
        for r in _ticks(records)[:5]:
            if r.inputs.tick == 4:
                writer.append_tick(r.inputs, msgspec.structs.replace(r.outputs, digest=bytes(16)),
                                    msgspec.msgpack.encode([1, 2]))
            else:
                writer.append_tick(r.inputs, r.outputs)
    offset = _frame_of(bad, "tick", 4)
    report = verify(bad)
    assert report.status == "unreadable" and report.byte_offset == offset
    assert report.error is not None and report.error.startswith(
        f"{bad}: corrupt frame at byte offset {offset} (tick 4): the logged commands do not decode: ")


def _edit_snapshot(log: Path, out: Path, tick: int, change: object) -> Path:
    def edit(header: LogHeader, recs: list) -> tuple[LogHeader, list]:
        return header, [change(r) if isinstance(r, SnapshotRecord) and r.tick == tick else r  # type: ignore[operator]
                        for r in recs]
    return rewrite(log, out, edit)


def test_a_snapshot_out_of_place_is_corruption(log: Path, tmp_path: Path) -> None:
    def edit(header: LogHeader, recs: list) -> tuple[LogHeader, list]:
        out = [r for r in recs if not (isinstance(r, SnapshotRecord) and r.tick == 7)]
        snap = next(r for r in recs if isinstance(r, SnapshotRecord) and r.tick == 7)
        at = next(i for i, r in enumerate(out) if isinstance(r, TickRecord) and r.inputs.tick == 8)
        return header, [*out[: at + 1], snap, *out[at + 1:]]

    bad = rewrite(log, tmp_path / "late.tlog", edit)
    report = verify(bad)
    offset = _frame_of(bad, "snapshot", 7)
    assert report.status == "unreadable" and report.byte_offset == offset
    assert report.error == str(LogCorrupt(str(bad), offset, 7, "a snapshot of tick 7 where the log is at tick 8"))


def test_a_snapshot_that_differs_is_a_divergence(log: Path, tmp_path: Path) -> None:
    bad = _edit_snapshot(log, tmp_path / "digest.tlog", 15, lambda r: msgspec.structs.replace(r, digest=bytes(16)))
    report = verify(bad)
    assert report.status == "divergent" and report.first_divergent_tick == 15 and report.state_tick == 15
    assert report.error == "the replayed core state after tick 15 differs from the logged snapshot"
    assert report.snapshots_checked == 2 and report.state_diff == []
    assert verify(bad, check_snapshots=False).status == "identical"

    def renumber(r: SnapshotRecord) -> SnapshotRecord:
        snap = decode_snapshot(r.state)
        return msgspec.structs.replace(r, state=encode_snapshot(msgspec.structs.replace(snap, next_step_id=999)))

    report = verify(_edit_snapshot(log, tmp_path / "state.tlog", 15, renumber))
    assert report.status == "divergent" and report.state_tick == 15
    assert report.snapshots_checked == 2 and report.ticks == 16


@pytest.mark.parametrize(("name", "change", "reason"), [
    ("garbage", lambda s: b"\xc1", "the snapshot state does not decode: "),
    ("live", lambda s: encode_snapshot(msgspec.structs.replace(s, live=len(s.seqs) + 1)),
     "the snapshot state names sequences it does not hold"),
    ("queue", lambda s: encode_snapshot(msgspec.structs.replace(s, running=[*s.running, len(s.seqs)])),
     "the snapshot state names sequences it does not hold"),
    ("negative", lambda s: encode_snapshot(msgspec.structs.replace(s, waiting=[-1])),
     "the snapshot state names sequences it does not hold"),
])
def test_a_damaged_snapshot_state_is_corruption_where_it_is_read(
    log: Path, tmp_path: Path, name: str, change: object, reason: str
) -> None:
    def edit(r: SnapshotRecord) -> SnapshotRecord:
        return msgspec.structs.replace(r, state=change(decode_snapshot(r.state)))  # type: ignore[operator]

    bad = _edit_snapshot(log, tmp_path / f"{name}.tlog", 7, edit)
    offset = _frame_of(bad, "snapshot", 7)
    report = verify(bad)
    assert report.status == "unreadable" and report.byte_offset == offset
    assert report.error is not None and report.error.startswith(
        f"{bad}: corrupt frame at byte offset {offset} (tick 7): {reason}")
    with pytest.raises(LogCorrupt) as info:
        core_at(bad, 10)
    assert (info.value.path, info.value.offset, info.value.tick) == (str(bad), offset, 7)
    assert info.value.reason.startswith(reason)


def test_core_at_restores_from_the_nearest_snapshot_and_checks_it(log: Path, tmp_path: Path) -> None:
    from tickloom.engine.core import SchedulerCore
    from tickloom.replay.header import core_config_from_header

    header, records = read_log(log)
    core = SchedulerCore(core_config_from_header(header))
    for t in _ticks(records)[:11]:
        core.tick(t.inputs)
    assert encode_snapshot(core_at(log, 10).snapshot()) == encode_snapshot(core.snapshot())
    assert core_at(log, 7).state.tick == 7
    last = _ticks(records)[-1].inputs.tick
    with pytest.raises(ValueError) as info:
        core_at(log, 10_000)
    assert str(info.value) == f"{log}: the log ends at tick {last}, before tick 10000"

    def other_config(r: SnapshotRecord) -> SnapshotRecord:
        snap = decode_snapshot(r.state)
        config = msgspec.structs.replace(snap.config, max_batch_size=snap.config.max_batch_size + 1)
        return msgspec.structs.replace(r, state=encode_snapshot(msgspec.structs.replace(snap, config=config)))

    def other_tick(r: SnapshotRecord) -> SnapshotRecord:
        snap = decode_snapshot(r.state)
        return msgspec.structs.replace(r, state=encode_snapshot(msgspec.structs.replace(snap, tick=3)))

    def broken(r: SnapshotRecord) -> SnapshotRecord:
        snap = decode_snapshot(r.state)
        steps = [msgspec.structs.replace(snap.steps[0], seqs=[len(snap.seqs) + 5]), *snap.steps[1:]]
        return msgspec.structs.replace(r, state=encode_snapshot(msgspec.structs.replace(snap, steps=steps)))

    for name, change, reason in [("config", other_config, "the snapshot's configuration is not the header's"),
                                 ("tick", other_tick, "the snapshot state is of tick 3"),
                                 ("broken", broken, "the snapshot does not restore: ")]:
        bad = _edit_snapshot(log, tmp_path / f"{name}.tlog", 7, change)
        offset = _frame_of(bad, "snapshot", 7)
        with pytest.raises(LogCorrupt) as error:
            core_at(bad, 10)
        assert (error.value.path, error.value.offset, error.value.tick) == (str(bad), offset, 7), name
        assert error.value.reason.startswith(reason), error.value.reason
        if name == "broken":
            assert error.value.reason == "the snapshot does not restore: IndexError: list index out of range"


def test_bisect_reports_the_first_violation(log: Path, tmp_path: Path) -> None:
    _, records = read_log(log)
    ticks = _ticks(records)

    def check(core: object) -> None:
        if core.state.tick == 5:  # type: ignore[attr-defined]
            raise ValueError("boom")

    report = bisect(log, check)
    assert report.status == "violation" and report.exit_code == 1
    assert (report.first_divergent_tick, report.ticks, report.error) == (5, 5, "ValueError: boom")
    assert report.inputs == summarise_inputs(ticks[5].inputs.inputs)
    rows = sum(len(c.request_ids) for t in ticks[:5] for c in t.outputs.commands if isinstance(c, RunStep))
    assert report.rows == rows
    text = format_report(report).splitlines()
    assert text[0] == "violation at tick 5: ValueError: boom"
    assert text[2] == "  inputs:"
    assert text[3:] == [f"    {line}" for line in report.inputs] or text[3:] == ["    (none)"]

    torn = tmp_path / "torn.tlog"
    torn.write_bytes(log.read_bytes() + b"TLt")
    assert bisect(torn).torn_bytes == 3
    data = bytearray(log.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt = tmp_path / "corrupt.tlog"
    corrupt.write_bytes(bytes(data))
    report = bisect(corrupt)
    assert report.status == "unreadable" and report.byte_offset is not None
    assert report.error is not None and report.error.startswith(f"{corrupt}: corrupt frame at byte offset ")


def test_a_header_config_the_core_refuses_is_an_unreadable_header(log: Path, tmp_path: Path) -> None:
    header, _ = read_log(log)
    bad = rewrite(log, tmp_path / "cfg.tlog",
                  lambda h, recs: (msgspec.structs.replace(h, config_json='{"block_size": 0}'), recs))
    for report in (verify(bad), bisect(bad)):
        assert report.status == "unreadable" and report.byte_offset == 0
        assert report.error is not None and report.error.startswith(
            f"{bad}: the header (frame at byte offset 0): the configuration is not a valid core config: ")
        assert report.schema_hash == header.schema_hash
        assert 0 <= report.seconds < 60


def test_mark_unreadable_keeps_an_offset_only_where_there_is_one() -> None:
    report = mark_unreadable(ReplayReport("identical", "p"), LogCorrupt("p", 40, 2, "bad"))
    assert (report.status, report.error, report.byte_offset) == ("unreadable", "p: corrupt frame at byte offset 40 "
                                                                 "(tick 2): bad", 40)
    report = mark_unreadable(ReplayReport("identical", "p"), OSError("gone"))
    assert (report.status, report.error, report.byte_offset) == ("unreadable", "gone", None)
    assert EXIT_CODES == {"identical": 0, "clean": 0, "divergent": 1, "violation": 1, "unreadable": 2}


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
    rid = _rid(state, i)
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
    assert (report.ticks, report.snapshots_checked) == (len(_ticks(records)), 0)


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
