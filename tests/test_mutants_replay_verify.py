"""Behavioural tests that kill mutants of exact replay (scripts/mutate.sh --area replay): verify, bisect and the core
at a tick."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from tests.replay_helpers import (
    everything_log,  # noqa: F401 (the log fixture)
    read_log,
    rewrite,
    ticks_of,
)

# --- verify, bisect, core_at ---------------------------------------------------------------------------------------
from tickloom.engine.core.snapshot import decode_snapshot, encode_snapshot
from tickloom.events import (
    LogCorrupt,
    LogHeader,
    LogReader,
    LogWriter,
    RunStep,
    SnapshotRecord,
    StepDone,
    TickRecord,
)
from tickloom.replay import bisect, core_at, verify
from tickloom.replay.diff import (
    summarise_inputs,
)
from tickloom.replay.verify import EXIT_CODES, ReplayReport, format_report, mark_unreadable


def _frame_of(path: Path, kind: str, tick: int) -> int:
    with LogReader(path) as reader:
        return next(i.offset for i in reader.frames() if i.kind == kind and i.tick == tick)


def test_an_identical_replay_counts_ticks_rows_and_snapshots(log: Path) -> None:
    header, records = read_log(log)
    ticks = ticks_of(records)
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


def test_a_tick_out_of_sequence_is_a_divergence_naming_bothticks_of(log: Path, tmp_path: Path) -> None:
    def drop(header: LogHeader, recs: list) -> tuple[LogHeader, list]:
        return header, [r for r in recs if not (isinstance(r, TickRecord) and r.inputs.tick == 10)]

    bad = rewrite(log, tmp_path / "gap.tlog", drop)
    _, records = read_log(log)
    eleven = next(t for t in ticks_of(records) if t.inputs.tick == 11)
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
    assert report.inputs == summarise_inputs(next(t for t in ticks_of(records) if t.inputs.tick == 12).inputs.inputs)
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
    logged = next(t for t in ticks_of(records) if t.inputs.tick == 9).outputs.needs_tick
    report = verify(rewrite(log, tmp_path / "needs.tlog", edit))
    assert report.status == "divergent" and report.first_divergent_tick == 9 and report.ticks == 9
    assert report.needs_tick_diff == f"needs_tick: expected {not logged}, got {logged}"
    assert report.command_diff == [] and report.gauges_diff == []
    assert report.state_tick == 15 and report.state_diff == []  # the replayed core is the logged one
    assert f"  {report.needs_tick_diff}" in format_report(report).splitlines()


def test_a_changed_token_shows_commands_gauges_and_state(log: Path, tmp_path: Path) -> None:
    _, records = read_log(log)
    target = next(t for t in ticks_of(records) if t.inputs.tick >= 3
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
        for r in ticks_of(records)[:5]:
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
    for t in ticks_of(records)[:11]:
        core.tick(t.inputs)
    assert encode_snapshot(core_at(log, 10).snapshot()) == encode_snapshot(core.snapshot())
    assert core_at(log, 7).state.tick == 7
    last = ticks_of(records)[-1].inputs.tick
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
    ticks = ticks_of(records)

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
