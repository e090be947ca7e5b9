"""Damaged and hostile logs: every reader answers 0, 1 or 2, never a traceback, in bounded memory.

A real log from the stub engine is mutated thousands of times: bit flips, truncations, inserted, repeated, deleted
and swapped frames, huge length fields, frames with valid CRCs over junk (or over subtly edited) payloads, bad
snapshots and bad headers. Each mutated log goes through the same entry point as the command line (``tools.cli``
in-process): ``replay``, ``replay --bisect``, ``replay --until``, ``inspect`` and ``log info``. The oracle:

- only the documented exit statuses, and no exception escapes;
- a flipped bit before the final frame is always caught (``replay`` and ``log info`` exit 2, naming the byte
  offset); ``replay`` exits 0 for flips only when they lie in the final frame (a torn tail) or change nothing;
- whenever ``replay`` exits 0, the mutated log's decisions are the original's (a prefix of its tick outputs, and
  only its snapshots): whatever CRC-valid edit was made, it changed nothing replay could have caught;
- the process's peak RSS grows by less than ``RSS_BUDGET_MB`` over the whole run.

``TICKLOOM_FUZZ_N`` sets the number of mutated logs (default 2000) and ``TICKLOOM_FUZZ_SEED`` the seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import random
import resource
import struct
import subprocess
import sys
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing
from engine_helpers import stub_config

from tickloom import Engine, SamplingParams
from tickloom.engine.core.snapshot import decode_snapshot, encode_snapshot
from tickloom.events import LogHeader, LogReader, SnapshotRecord, TickRecord, encode
from tickloom.events.frames import HEADER, HEADER_SIZE, MAGIC, pack_frame
from tickloom.tools.cli import main

N_MUTATIONS = int(os.environ.get("TICKLOOM_FUZZ_N", "2000"))
SEED = int(os.environ.get("TICKLOOM_FUZZ_SEED", "20240610"))
RSS_BUDGET_MB = 200
_HEAD_FIELDS = struct.Struct("<4sIQ")


@dataclasses.dataclass(frozen=True)
class Frame:
    offset: int
    magic: bytes
    tick: int
    payload: bytes

    @property
    def end(self) -> int:
        return self.offset + HEADER_SIZE + len(self.payload)


@dataclasses.dataclass(frozen=True)
class Mutant:
    kind: str
    data: bytes
    flipped_from: int | None = None
    """For bit flips (CRCs left as they are): the first damaged byte."""


def _frames(data: bytes) -> list[Frame]:
    out: list[Frame] = []
    offset = 0
    while offset + HEADER_SIZE <= len(data):
        magic, length, tick, _, _ = HEADER.unpack_from(data, offset)
        out.append(Frame(offset, bytes(magic), tick, data[offset + HEADER_SIZE : offset + HEADER_SIZE + length]))
        offset += HEADER_SIZE + length
    assert offset == len(data)
    return out


def _frame(magic: bytes, tick: int, payload: bytes, length: int | None = None) -> bytes:
    """A frame whose CRCs check, whatever ``payload`` holds (``length`` may lie about it)."""
    declared = len(payload) if length is None else length
    head_crc = zlib.crc32(_HEAD_FIELDS.pack(magic, declared, tick))
    return HEADER.pack(magic, declared, tick, head_crc, zlib.crc32(payload)) + payload


def _replace(data: bytes, frame: Frame, new: bytes) -> bytes:
    return data[: frame.offset] + new + data[frame.end :]


@dataclasses.dataclass
class Base:
    data: bytes
    frames: list[Frame]
    header: LogHeader
    outputs: list[object]
    snapshots: list[SnapshotRecord]

    @property
    def last_frame(self) -> Frame:
        return self.frames[-1]

    def of(self, magic: bytes) -> list[Frame]:
        return [f for f in self.frames if f.magic == magic]


async def _run_engine(path: Path) -> None:
    async with Engine.open(stub_config(path, snapshot_every=4)) as engine, trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(engine.complete, f"prompt number {i}", SamplingParams(max_tokens=6 + i, seed=i))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    path = tmp_path_factory.mktemp("fuzz") / "base.tlog"
    trio.run(_run_engine, path, clock=trio.testing.MockClock(autojump_threshold=0))
    assert main(["replay", str(path)]) == 0
    with LogReader(path) as reader:
        header = reader.header
        records = list(reader.records())
    data = path.read_bytes()
    outputs: list[object] = [r.outputs for r in records if isinstance(r, TickRecord)]
    snapshots = [r for r in records if isinstance(r, SnapshotRecord)]
    assert len(outputs) >= 8 and len(snapshots) >= 2, "the base log needs ticks and snapshots to damage"
    return Base(data, _frames(data), header, outputs, snapshots)


# -- mutations ---------------------------------------------------------------------------------------------------
def _flip(b: Base, rng: random.Random) -> Mutant:
    data = bytearray(b.data)
    where = sorted(rng.randrange(len(data)) for _ in range(rng.randint(1, 4)))
    for i in where:
        data[i] ^= 1 << rng.randrange(8)
    return Mutant("flip", bytes(data), where[0])


def _truncate(b: Base, rng: random.Random) -> Mutant:
    return Mutant("truncate", b.data[: rng.randrange(len(b.data))])


def _junk_payload(b: Base, rng: random.Random) -> Mutant:
    frame = rng.choice(b.frames)
    junk = rng.randbytes(rng.choice([0, 1, 5, 40, len(frame.payload)]))
    return Mutant("junk-payload", _replace(b.data, frame, _frame(frame.magic, frame.tick, junk)))


def _edit_payload(b: Base, rng: random.Random) -> Mutant:
    """Change a few payload bytes and recompute the CRC: decodes often, with subtly wrong values."""
    frame = rng.choice(b.frames)
    payload = bytearray(frame.payload)
    for _ in range(rng.randint(1, 3)):
        if payload:
            payload[rng.randrange(len(payload))] = rng.randrange(256)
    return Mutant("edit-payload", _replace(b.data, frame, _frame(frame.magic, frame.tick, bytes(payload))))


def _huge_length(b: Base, rng: random.Random) -> Mutant:
    frame = rng.choice(b.frames)
    size = rng.choice([2**32 - 1, 2**31, 64 * 2**20, 64 * 2**20 + 1, len(frame.payload) + 1,
                       len(b.data) - frame.offset])
    new = _frame(frame.magic, frame.tick, frame.payload, length=size)
    if rng.random() < 0.5:  # a truncated file whose last frame lies about its length
        return Mutant("huge-length-tail", b.data[: frame.offset] + new)
    return Mutant("huge-length", _replace(b.data, frame, new))


def _repeat(b: Base, rng: random.Random) -> Mutant:
    frame = rng.choice(b.frames[1:])
    after = rng.choice(b.frames)
    whole = b.data[frame.offset : frame.end]
    return Mutant("repeat-frame", b.data[: after.end] + whole * rng.randint(1, 3) + b.data[after.end :])


def _delete(b: Base, rng: random.Random) -> Mutant:
    frame = rng.choice(b.frames[1:])
    return Mutant("delete-frame", b.data[: frame.offset] + b.data[frame.end :])


def _swap(b: Base, rng: random.Random) -> Mutant:
    i = rng.randrange(1, len(b.frames) - 1)
    x, y = b.frames[i], b.frames[i + 1]
    return Mutant("swap-frames", b.data[: x.offset] + b.data[y.offset : y.end] + b.data[x.offset : x.end]
                  + b.data[y.end :])


def _retag(b: Base, rng: random.Random) -> Mutant:
    """Another kind, tick or format version in a frame header, with CRCs that check."""
    frame = rng.choice(b.frames)
    magic = rng.choice([*MAGIC.values(), b"TLt\x02", b"TLh\x00", frame.magic])
    tick = rng.choice([frame.tick, frame.tick + 1, max(frame.tick - 1, 0), 2**64 - 1, rng.randrange(64)])
    return Mutant("retag", _replace(b.data, frame, _frame(magic, tick, frame.payload)))


def _insert_junk_frame(b: Base, rng: random.Random) -> Mutant:
    after = rng.choice(b.frames)
    new = _frame(rng.choice(list(MAGIC.values())), rng.randrange(20), rng.randbytes(rng.randrange(64)))
    return Mutant("insert-junk-frame", b.data[: after.end] + new + b.data[after.end :])


def _deep_nesting(b: Base, rng: random.Random) -> Mutant:
    """A payload nested far deeper than any decoder's stack, inside a tick's encoded commands or alone."""
    frame = rng.choice(b.of(MAGIC["tick"]))
    depth = rng.choice([1_000, 100_000])
    if rng.random() < 0.5:
        payload = b"\x91" * depth + b"\xc0"
    else:  # the commands of a real tick record, which raw replay leaves encoded
        record = msgspec.msgpack.decode(frame.payload)
        record[2][1] = msgspec.Raw(b"\x91" * depth + b"\xc0")
        payload = msgspec.msgpack.encode(record)
    return Mutant("deep-nesting", _replace(b.data, frame, _frame(frame.magic, frame.tick, payload)))


_BAD_CORE = [
    {"num_blocks": 1 << 40}, {"num_blocks": (1 << 22) + 1}, {"num_blocks": -1}, {"num_blocks": 0},
    {"max_seq_len": 1 << 40}, {"vocab_size": 1 << 40}, {"max_batch_size": 1 << 40}, {"block_size": 1 << 40},
    {"max_waiting": 1 << 40}, {"eos_token_ids": list(range(5000))}, {"pipeline_depth": 7}, {"num_blocks": "x"},
    {"surprise": 1},
]


def _bad_header(b: Base, rng: random.Random) -> Mutant:
    config = json.loads(b.header.config_json)
    choice = rng.randrange(8)
    if choice < 3:
        config["core"] = {**config["core"], **rng.choice(_BAD_CORE)}
        header = msgspec.structs.replace(b.header, config_json=json.dumps(config))
    elif choice == 3:
        header = msgspec.structs.replace(b.header, config_json=rng.choice(
            ["", "{", "[]", '{"core": 5}', "[" * 100_000, '{"core": {"num_blocks": NaN}}', "1e400"]))
    elif choice == 4:
        header = msgspec.structs.replace(b.header, schema_hash=rng.choice(["", "0" * 24, "x" * 10_000]))
    elif choice == 5:
        header = msgspec.structs.replace(b.header, format_version=rng.choice([0, 2, 2**63]))
    elif choice == 6:
        header = msgspec.structs.replace(b.header, digest_version=rng.choice([0, 99]))
    else:  # a tick frame where the header should be
        return Mutant("bad-header", _replace(b.data, b.frames[0], b.data[b.frames[1].offset : b.frames[1].end]))
    return Mutant("bad-header", _replace(b.data, b.frames[0], pack_frame("header", 0, encode(header))))


def _bad_snapshot(b: Base, rng: random.Random) -> Mutant:
    frame = rng.choice(b.of(MAGIC["snapshot"]))
    record = msgspec.msgpack.decode(frame.payload, type=SnapshotRecord)
    state = decode_snapshot(record.state)
    choice = rng.randrange(7)
    if choice == 0:
        new = msgspec.structs.replace(record, state=rng.randbytes(rng.randrange(200)))
    elif choice == 1:  # a huge pool from a snapshot's own configuration
        raw = msgspec.msgpack.decode(encode_snapshot(state))  # (a CoreConfig cannot even be made with 1 << 40)
        raw["config"]["num_blocks"] = rng.choice([1 << 22, 1 << 40])
        new = msgspec.structs.replace(record, state=msgspec.msgpack.encode(raw))
    elif choice == 2:
        new = msgspec.structs.replace(record, state=encode_snapshot(msgspec.structs.replace(
            state, live=len(state.seqs) + rng.randint(1, 99))))
    elif choice == 3:
        new = msgspec.structs.replace(record, state=encode_snapshot(msgspec.structs.replace(
            state, waiting=[*state.waiting, len(state.seqs) + 5], running=[-1])))
    elif choice == 4:
        new = msgspec.structs.replace(record, state=encode_snapshot(msgspec.structs.replace(state, tick=7 ** 9)))
    elif choice == 5:
        new = msgspec.structs.replace(record, tick=record.tick + 1)
    else:
        new = msgspec.structs.replace(record, digest=bytes(16))
    return Mutant("bad-snapshot", _replace(b.data, frame, _frame(frame.magic, frame.tick, encode(new))))


MUTATORS: list[Callable[[Base, random.Random], Mutant]] = [
    _flip, _flip, _flip, _truncate, _junk_payload, _edit_payload, _edit_payload, _huge_length, _repeat, _delete,
    _swap, _retag, _insert_junk_frame, _deep_nesting, _bad_header, _bad_snapshot,
]


# -- running the readers -----------------------------------------------------------------------------------------
def _cli(argv: list[str]) -> tuple[int, str]:
    """Run ``tickloom ARGV`` in-process; any exception but ``SystemExit`` propagates and fails the test."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse
            status = exc.code if isinstance(exc.code, int) else 1
    return status, out.getvalue()


def _decisions_unchanged(b: Base, path: Path) -> bool:
    """Whether the log at ``path`` reads back to a prefix of the base log's decisions and only its snapshots."""
    with LogReader(path) as reader:
        records = list(reader.records())
    outputs = [r.outputs for r in records if isinstance(r, TickRecord)]
    snapshots = [r for r in records if isinstance(r, SnapshotRecord)]
    return outputs == b.outputs[: len(outputs)] and all(s in b.snapshots for s in snapshots)


def _check(b: Base, mutant: Mutant, path: Path, deep: bool) -> dict[str, int]:
    path.write_bytes(mutant.data)
    name = str(path)
    codes: dict[str, int] = {}
    codes["replay"], text = _cli(["replay", name])
    assert codes["replay"] in (0, 1, 2), text
    if codes["replay"] == 2:
        assert name in text and "byte offset" in text, text
    codes["info"], info_text = _cli(["log", "info", name])
    assert codes["info"] in (0, 2), info_text
    if codes["info"] == 2:
        assert name in info_text and "byte offset" in info_text, info_text
    if mutant.data == b.data:
        assert codes["replay"] == 0 and codes["info"] == 0
    if mutant.flipped_from is not None and mutant.flipped_from < b.last_frame.offset and mutant.data != b.data:
        assert codes["replay"] == 2 and codes["info"] == 2, f"a flipped bit at {mutant.flipped_from} went unseen"
    if codes["replay"] == 0:
        if mutant.flipped_from is not None:
            assert mutant.flipped_from >= b.last_frame.offset or mutant.data == b.data
        assert _decisions_unchanged(b, path), f"replay passed a log whose decisions changed ({mutant.kind})"
    if deep:
        codes["inspect"], text = _cli(["inspect", name])
        assert codes["inspect"] in (0, 2), text
        codes["bisect"], text = _cli(["replay", "--bisect", name])
        assert codes["bisect"] in (0, 1, 2), text
        codes["until"], text = _cli(["replay", "--until", str(len(b.outputs) // 2 + 1), name])
        assert codes["until"] in (0, 1, 2, 64), text  # 64: the damaged log ends before that tick
    return codes


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


CHUNKS = 4
"""The mutations are checked in this many tests (mutation n in chunk n % CHUNKS), so that a parallel run spreads
them; every chunk draws the whole sequence, so the 2,000 mutations are the same however they are split."""


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_mutated_logs_never_crash_the_readers(base: Base, tmp_path: Path, chunk: int) -> None:
    rng = random.Random(SEED)
    rss_before = _max_rss_mb()
    tally: Counter[tuple[str, int]] = Counter()
    path = tmp_path / "mutant.tlog"
    for n in range(N_MUTATIONS):
        mutant = rng.choice(MUTATORS)(base, rng)
        if n % CHUNKS != chunk:
            continue
        try:
            codes = _check(base, mutant, path, deep=n % 3 == 0)
        except BaseException:
            keep = tmp_path / f"failing-{mutant.kind}.tlog"
            keep.write_bytes(mutant.data)
            print(f"\nmutation {n} ({mutant.kind}) failed; the log is kept at {keep}")
            raise
        tally[(mutant.kind, codes["replay"])] += 1
    growth = _max_rss_mb() - rss_before
    print(f"\nfuzz: chunk {chunk} of {N_MUTATIONS} mutated logs (seed {SEED}); peak RSS {_max_rss_mb():.0f} MB, "
          f"grew {growth:.0f} MB; replay exit status by mutation: {dict(sorted(tally.items()))}")
    assert growth < RSS_BUDGET_MB
    # Every kind of damage was tried, and the damage was mostly caught.
    assert {kind for kind, _ in tally} >= {"flip", "truncate", "junk-payload", "edit-payload", "huge-length",
                                          "repeat-frame", "delete-frame", "swap-frames", "retag", "bad-header",
                                          "bad-snapshot", "deep-nesting", "insert-junk-frame"}


def _bad_logs(b: Base, tmp_path: Path) -> list[Path]:
    rng = random.Random(SEED)
    mid = b.frames[len(b.frames) // 2]
    logs = {
        "flip": bytearray(b.data),
        "huge-length": _replace(b.data, mid, _frame(mid.magic, mid.tick, mid.payload, length=2**32 - 1)),
        "junk": _replace(b.data, mid, _frame(mid.magic, mid.tick, rng.randbytes(50))),
        "header": _bad_header(b, random.Random(1)).data,
    }
    logs["flip"][mid.offset + HEADER_SIZE + 3] ^= 0x10
    paths = []
    for name, data in logs.items():
        path = tmp_path / f"{name}.tlog"
        path.write_bytes(bytes(data))
        paths.append(path)
    return paths


def test_the_real_cli_exits_2_without_a_traceback(base: Base, tmp_path: Path) -> None:
    for path in _bad_logs(base, tmp_path):
        readers = [["log", "info"], ["inspect"]] if path.stem != "header" else []  # they leave the config be
        for argv in [["replay", str(path)]] + [[*r, str(path)] for r in readers]:
            done = subprocess.run([sys.executable, "-m", "tickloom", *argv], capture_output=True, text=True,
                                  timeout=120, check=False)
            assert done.returncode == 2, (argv, done.stdout, done.stderr)
            assert "Traceback" not in done.stderr + done.stdout, done.stderr
            assert str(path) in done.stdout + done.stderr and "byte offset" in done.stdout + done.stderr


def test_a_huge_pool_is_refused_before_it_is_built(base: Base, tmp_path: Path) -> None:
    config = json.loads(base.header.config_json)
    config["core"]["num_blocks"] = 1 << 40
    header = msgspec.structs.replace(base.header, config_json=json.dumps(config))
    path = tmp_path / "huge.tlog"
    path.write_bytes(_replace(base.data, base.frames[0], pack_frame("header", 0, encode(header))))
    rss_before = _max_rss_mb()
    for argv in (["replay", str(path)], ["replay", "--bisect", str(path)], ["replay", "--until", "3", str(path)]):
        status, text = _cli(argv)
        # refused by the declared bound (engine.core.config) or, below it, by replay's own limit
        assert status == 2 and "num_blocks" in text and ("limit" in text or "<= 16777216" in text), text
    assert _max_rss_mb() - rss_before < 50


def test_a_lying_length_mid_file_is_corruption_and_recovery_keeps_the_frames(base: Base, tmp_path: Path) -> None:
    """A length running past the end of the file with whole frames after it is never a torn tail to drop."""
    from tickloom.events import LogCorrupt, recover_log

    mid = base.frames[len(base.frames) // 2]
    path = tmp_path / "lying.tlog"
    data = _replace(base.data, mid, _frame(mid.magic, mid.tick, mid.payload, length=len(base.data)))
    path.write_bytes(data)
    with pytest.raises(LogCorrupt, match=f"byte offset {mid.offset}"):
        recover_log(path)
    assert path.read_bytes() == data


def test_a_frame_header_must_agree_with_its_payload(base: Base, tmp_path: Path) -> None:
    frame = base.of(MAGIC["tick"])[3]
    path = tmp_path / "retagged.tlog"
    path.write_bytes(_replace(base.data, frame, _frame(frame.magic, frame.tick + 1, frame.payload)))
    for argv in (["log", "info", str(path)], ["replay", str(path)], ["inspect", str(path)]):
        status, text = _cli(argv)
        assert status == 2 and f"byte offset {frame.offset}" in text and "frame header tick" in text, text


def test_a_misplaced_snapshot_is_corruption(base: Base, tmp_path: Path) -> None:
    """A snapshot follows the tick it was taken after; one anywhere else is not skipped but reported."""
    snap = base.of(MAGIC["snapshot"])[0]
    later = next(f for f in base.frames if f.magic == MAGIC["tick"] and f.tick == snap.tick + 2)
    whole = base.data[snap.offset : snap.end]
    moved = base.data[: snap.offset] + base.data[snap.end : later.end] + whole + base.data[later.end :]
    path = tmp_path / "moved.tlog"
    path.write_bytes(moved)
    status, text = _cli(["replay", str(path)])
    assert status == 2 and f"a snapshot of tick {snap.tick} where the log is at tick {snap.tick + 2}" in text, text
