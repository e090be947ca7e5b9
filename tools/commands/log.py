"""``tickloom log``: write a small demonstration log, or check and summarise a log file."""

from __future__ import annotations

import argparse
import os

from tickloom.tools.cli import plural

NAME = "log"
HELP = "log files: write a demo log, check and summarise a log"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="log_command", metavar="ACTION", required=True)
    demo = sub.add_parser(
        "demo",
        help="write a small synthetic log, read it back, then tear its tail and recover it",
        description="Write a small synthetic log (no engine needed), read it back and check it decodes equal, "
        "then append half a frame, as a crash mid-write would, and recover it.",
    )
    demo.add_argument("path", help="the log file to create (must not exist: logs are never overwritten)")
    demo.add_argument("--ticks", type=int, default=20, help="ticks to write (default 20)")
    demo.add_argument("--batch", type=int, default=4, help="requests decoding per tick (default 4)")
    demo.set_defaults(_log_run=_demo)
    info = sub.add_parser(
        "info",
        help="verify every frame of a log and summarise it",
        description="Verify every frame of a log (CRCs, size limit, decoding) and print its header and counts. "
        "Exits 2 if the log cannot be read: missing, a directory, no permission, empty, corrupt or incompatible "
        "(naming the file and byte offset). Never modifies the file.",
    )
    info.add_argument("path", help="the log file")
    info.set_defaults(_log_run=_info)


def run(args: argparse.Namespace) -> int:
    return int(args._log_run(args))


def _demo(args: argparse.Namespace) -> int:
    from tickloom.events import (
        FORMAT_VERSION,
        SCHEMA_HASH,
        LogExists,
        LogHeader,
        LogReader,
        LogWriter,
        SnapshotRecord,
        recover_log,
    )
    from tickloom.events.codec import encode_tick
    from tickloom.events.digest import DIGEST_VERSION
    from tickloom.events.frames import HEADER_SIZE
    from tickloom.tools.bench.sample_ticks import make_ticks
    from tickloom.tools.cli import CliError

    if args.ticks < 1 or args.batch < 1:
        raise CliError("--ticks and --batch must be at least 1")
    ticks = make_ticks(args.ticks, batch=args.batch, arrivals=min(1, args.batch))
    header = LogHeader(FORMAT_VERSION, SCHEMA_HASH, DIGEST_VERSION, "demo", '{"demo":true}', snapshot_every=10)
    try:
        writer = LogWriter(args.path, header)
    except LogExists as exc:
        raise CliError(str(exc)) from None
    with writer:
        for inputs, outputs, encoded in ticks:
            writer.append_tick(inputs, outputs, encoded)
            if inputs.tick % 10 == 9:
                writer.append_snapshot(SnapshotRecord(inputs.tick, outputs.digest, b"demo state"))
            writer.flush()
    size = os.path.getsize(args.path)
    print(f"wrote {args.path}: {len(ticks)} ticks of {args.batch} rows, {size} bytes, mode {_mode(args.path)}")

    with LogReader(args.path) as reader:
        read = list(reader.ticks())
        snapshot, rest = reader.seek(len(ticks) - 1)
        after = [r.inputs.tick for r in rest]
    same = [(r.inputs, r.outputs) for r in read] == [(i, o) for i, o, _ in ticks]
    print(f"read back {len(read)} ticks; equal to what was written: {same}")
    print(f"seek to tick {len(ticks) - 1}: snapshot at tick {snapshot.tick if snapshot else None}, then ticks {after}")
    if not same:
        raise CliError("the log did not read back equal", status=1)

    # A crash mid-append leaves part of a frame: recovery drops exactly that part.
    inputs, outputs, encoded = ticks[-1]
    torn = encode_tick(inputs, outputs, encoded)[: len(encoded) // 2]
    with open(args.path, "ab") as f:
        f.write(bytes(HEADER_SIZE) + torn)
    recovery = recover_log(args.path)
    print(
        f"tore the tail (+{HEADER_SIZE + len(torn)} bytes); recover_log kept {recovery.frames} frames up to tick "
        f"{recovery.last_tick} and dropped {recovery.bytes_dropped} bytes; size is {os.path.getsize(args.path)} again"
    )
    return 0


def _info(args: argparse.Namespace) -> int:
    from tickloom.events import LogError, LogReader, SnapshotRecord, TickRecord
    from tickloom.tools.cli import CliError

    ticks = snapshots = 0
    first: int | None = None
    last: int | None = None
    try:
        with LogReader(args.path) as reader:
            h = reader.header
            for record in reader.records():
                if isinstance(record, TickRecord):
                    ticks += 1
                    first = record.inputs.tick if first is None else first
                    last = record.inputs.tick
                elif isinstance(record, SnapshotRecord):
                    snapshots += 1
            tail = reader.tail
    except LogError as exc:
        raise CliError(str(exc), status=2) from exc
    print(f"{args.path}: format {h.format_version}, schema {h.schema_hash}, digest v{h.digest_version}")
    print(f"  engine {h.engine_version!r}, model {h.model_fingerprint!r}, device {h.device!r}, dtype {h.dtype!r}")
    print(f"  {plural(ticks, 'tick')} ({first}..{last}), {plural(snapshots, 'snapshot')}, {tail.end_offset} bytes")
    if tail.torn_bytes:
        print(f"  torn tail: {tail.torn_bytes} bytes after the last whole frame (recover_log drops them)")
    return 0


def _mode(path: str) -> str:
    return oct(os.stat(path).st_mode & 0o777)
