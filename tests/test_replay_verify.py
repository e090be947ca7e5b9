"""Exact replay: a recorded run replays identically; tampered logs diverge at the right tick; damage is exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from tests.replay_helpers import Records, read_log, record_everything, rewrite
from tickloom.engine.core import CoreConfig, SchedulerCore
from tickloom.engine.core.snapshot import decode_snapshot, encode_snapshot
from tickloom.events import (
    NOT_FED,
    EmitTokens,
    Finish,
    LogHeader,
    Preempted,
    RequestArrived,
    RunStep,
    SnapshotRecord,
    StepDone,
    SwapIn,
    TickInputs,
    TickRecord,
)
from tickloom.events.frames import HEADER_SIZE
from tickloom.replay import bisect, core_at, core_config_from_header, state_at, verify
from tickloom.replay.record import header_for
from tickloom.tools.cli import main


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("replay") / "everything.tlog"
    record_everything(path)
    return path


def ticks_of(records: Records) -> list[TickRecord]:
    return [r for r in records if isinstance(r, TickRecord)]


def test_the_recorded_run_covers_every_feature(log: Path) -> None:
    _, records = read_log(log)
    seen: Counter[str] = Counter()
    for record in ticks_of(records):
        for item in record.inputs.inputs:
            seen[type(item).__name__] += 1
        for command in record.outputs.commands:
            if isinstance(command, Preempted):
                seen[f"preempt-{command.mode}"] += 1
            elif isinstance(command, Finish):
                seen[f"finish-{command.reason}"] += 1
            elif isinstance(command, RunStep):
                seen["fed rows"] += sum(f != NOT_FED for f in command.fed_from)
            elif isinstance(command, SwapIn):
                seen["SwapIn"] += 1
    for needed in ("preempt-swap", "preempt-requeue", "SwapIn", "fed rows", "finish-timeout", "finish-cancelled",
                   "finish-stop", "finish-error", "finish-length", "StepFailed", "StopMatched", "DeadlineReached",
                   "RequestCancelled", "SpillDone"):
        assert seen[needed] > 0, needed
    assert any(isinstance(r, SnapshotRecord) for r in records)


def test_identical_replay(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = verify(log)
    assert report.status == "identical", report.format_text()
    assert report.snapshots_checked > 0
    assert main(["replay", str(log)]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"identical: {report.ticks} ticks, {report.rows} rows, ")
    assert out.endswith("ticks/s")
    assert main(["replay", str(log), "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["status"] == "identical" and obj["first_divergent_tick"] is None and obj["ticks"] == report.ticks


def _first_emitted_token_tick(records: Records) -> tuple[int, int, int]:
    """(tick, input index, row) of a StepDone token that is streamed in that same tick."""
    for record in ticks_of(records):
        emitted = {
            (rid, tok)
            for c in record.outputs.commands if isinstance(c, EmitTokens)
            for rid, tok in zip(c.request_ids, c.token_ids, strict=True)
        }
        for i, item in enumerate(record.inputs.inputs):
            if isinstance(item, StepDone):
                for row, (rid, tok) in enumerate(zip(item.request_ids, item.token_ids, strict=True)):
                    if (rid, tok) in emitted and record.inputs.tick > 5:
                        return record.inputs.tick, i, row
    raise AssertionError("no streamed token")


def _replace_tick(records: Records, tick: int, inputs: TickInputs) -> Records:
    return [
        TickRecord(inputs, r.outputs) if isinstance(r, TickRecord) and r.inputs.tick == tick else r for r in records
    ]


def test_changed_sampled_token(log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, records = read_log(log)
    tick, index, row = _first_emitted_token_tick(records)

    def edit(header: LogHeader, recs: Records) -> tuple[LogHeader, Records]:
        record = next(r for r in ticks_of(recs) if r.inputs.tick == tick)
        done = record.inputs.inputs[index]
        assert isinstance(done, StepDone)
        tokens = list(done.token_ids)
        tokens[row] = (tokens[row] + 1) % 512 or 3
        items = list(record.inputs.inputs)
        items[index] = msgspec.structs.replace(done, token_ids=tokens)
        return header, _replace_tick(recs, tick, msgspec.structs.replace(record.inputs, inputs=items))

    bad = rewrite(log, tmp_path / "token.tlog", edit)
    report = verify(bad)
    assert report.status == "divergent" and report.first_divergent_tick == tick
    assert any(".token_ids[" in line and "expected" in line for line in report.command_diff), report.command_diff
    assert main(["replay", str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"first divergent tick {tick}" in out and "tickloom-record" in out
    assert main(["replay", str(bad), "--json"]) == 1
    obj = json.loads(capsys.readouterr().out)
    assert obj["status"] == "divergent" and obj["first_divergent_tick"] == tick


def test_dropped_arrival(log: Path, tmp_path: Path) -> None:
    _, records = read_log(log)
    record = next(r for r in ticks_of(records) if any(isinstance(i, RequestArrived) for i in r.inputs.inputs)
                  and r.inputs.tick >= 3)
    tick = record.inputs.tick
    items = list(record.inputs.inputs)
    del items[next(k for k, i in enumerate(items) if isinstance(i, RequestArrived))]
    bad = rewrite(log, tmp_path / "drop.tlog",
                  lambda h, recs: (h, _replace_tick(recs, tick, msgspec.structs.replace(record.inputs, inputs=items))))
    report = verify(bad)
    assert report.status == "divergent" and report.first_divergent_tick == tick
    assert report.gauges_diff or report.command_diff
    assert main(["replay", str(bad)]) == 1


def test_two_ticks_swapped(log: Path, tmp_path: Path) -> None:
    def edit(header: LogHeader, recs: Records) -> tuple[LogHeader, Records]:
        out = [r for r in recs if isinstance(r, TickRecord)]
        out[20], out[21] = out[21], out[20]
        return header, list(out)

    bad = rewrite(log, tmp_path / "swap.tlog", edit)
    report = verify(bad)
    assert report.status == "divergent" and report.first_divergent_tick == 20, report.format_text()
    assert main(["replay", str(bad)]) == 1


def test_two_ticks_inputs_swapped_keeping_numbers(log: Path, tmp_path: Path) -> None:
    def edit(header: LogHeader, recs: Records) -> tuple[LogHeader, Records]:
        ticks = ticks_of(recs)
        a, b = ticks[30].inputs, ticks[31].inputs
        swapped = {30: msgspec.structs.replace(a, inputs=b.inputs), 31: msgspec.structs.replace(b, inputs=a.inputs)}
        return header, [TickRecord(swapped[r.inputs.tick], r.outputs) if isinstance(r, TickRecord)
                        and r.inputs.tick in swapped else r for r in recs]

    report = verify(rewrite(log, tmp_path / "swap2.tlog", edit))
    assert report.status == "divergent" and report.first_divergent_tick == 30, report.format_text()


def test_changed_config_value(log: Path, tmp_path: Path) -> None:
    header, records = read_log(log)
    changed = msgspec.structs.replace(core_config_from_header(header), max_batch_size=6)
    # The expected first divergent tick: where the same inputs first give other outputs under the new config.
    core = SchedulerCore(changed)
    expected = None
    for record in ticks_of(records):
        try:
            out = core.tick(record.inputs)
        except Exception:
            expected = record.inputs.tick
            break
        if out.digest != record.outputs.digest:
            expected = record.inputs.tick
            break
    assert expected is not None
    new_header = msgspec.structs.replace(header, config_json=header_for(changed).config_json)
    bad = rewrite(log, tmp_path / "config.tlog", lambda h, recs: (new_header, recs))
    report = verify(bad)
    assert report.status == "divergent" and report.first_divergent_tick == expected
    assert main(["replay", str(bad)]) == 1


def test_corrupt_byte_before_the_final_frame(log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = bytearray(log.read_bytes())
    offset = len(data) // 2
    data[offset] ^= 0xFF
    bad = tmp_path / "corrupt.tlog"
    bad.write_bytes(bytes(data))
    report = verify(bad)
    assert report.status == "unreadable" and report.byte_offset is not None and report.byte_offset <= offset
    assert main(["replay", str(bad)]) == 2
    out = capsys.readouterr().out
    assert str(bad) in out and "byte offset" in out
    assert main(["replay", str(bad), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["status"] == "unreadable"


def test_torn_tail_replays_to_the_last_whole_frame(log: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    data = log.read_bytes()
    torn = tmp_path / "torn.tlog"
    torn.write_bytes(data + data[HEADER_SIZE + 10: HEADER_SIZE + 80])
    report = verify(torn)
    assert report.status == "identical" and report.torn_bytes == 70
    assert main(["replay", str(torn)]) == 0
    out = capsys.readouterr().out
    assert "identical" in out and "70 bytes" in out and "dropped" in out


def test_digest_version_mismatch_is_reported(log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = rewrite(log, tmp_path / "digest.tlog",
                  lambda h, recs: (msgspec.structs.replace(h, digest_version=h.digest_version + 1), recs))
    assert main(["replay", str(bad)]) == 2
    assert "digest version" in capsys.readouterr().out


def test_snapshot_state_is_checked(log: Path, tmp_path: Path) -> None:
    def edit(header: LogHeader, recs: Records) -> tuple[LogHeader, Records]:
        out: Records = []
        for r in recs:
            if isinstance(r, SnapshotRecord) and r.tick == 15:
                snap = decode_snapshot(r.state)
                r = msgspec.structs.replace(r, state=encode_snapshot(msgspec.structs.replace(snap, next_step_id=999)))
            out.append(r)
        return header, out

    report = verify(rewrite(log, tmp_path / "snap.tlog", edit))
    assert report.status == "divergent" and report.first_divergent_tick == 15


def test_usage_errors_and_missing_file(log: Path, tmp_path: Path) -> None:
    assert main(["replay", str(log), "--dump"]) == 64
    assert main(["replay", str(log), "--model", "x"]) == 64
    assert main(["replay", str(log), "--full"]) == 64
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(log), "--bisect", "--until", "3"])
    assert exc.value.code == 64
    assert main(["replay", str(tmp_path / "nope.tlog")]) == 2


def test_config_from_header_accepts_both_forms(log: Path) -> None:
    header, _ = read_log(log)
    config = core_config_from_header(header)
    bare = msgspec.structs.replace(header, config_json=config.to_json())
    assert core_config_from_header(bare) == config
    assert isinstance(config, CoreConfig)


def test_seek_state_matches_a_replay_from_the_start(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    header, records = read_log(log)
    for tick in (0, 7, 15, 30, 44):
        core = SchedulerCore(core_config_from_header(header))
        for record in ticks_of(records)[: tick + 1]:
            core.tick(record.inputs)
        assert encode_snapshot(state_at(log, tick)) == encode_snapshot(core.snapshot())
        assert core_at(log, tick).state.tick == tick
    assert main(["replay", str(log), "--until", "30", "--dump"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("state after tick 30") and "r01:" in out
    assert main(["replay", str(log), "--until", "10000"]) == 64


def test_bisect(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(log), "--bisect"]) == 0
    assert capsys.readouterr().out.startswith("clean:")

    def fails_at_12(core: SchedulerCore) -> None:
        core.check_invariants()
        if core.state.tick >= 12:
            raise AssertionError("scripted violation")

    report = bisect(log, fails_at_12)
    assert report.status == "violation" and report.first_divergent_tick == 12 and report.exit_code == 1
    assert "scripted violation" in (report.error or "")


def test_replay_imports_neither_trio_nor_torch() -> None:
    code = (
        "import sys, replay, replay.record, replay.trace, replay.full\n"
        "print(sorted(m for m in ('trio', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]"
