"""``tickloom bench log``: what logging a tick costs, next to plain msgspec encoding and decoding of the same ticks.

The tick mix is ``tools.bench.sample_ticks``: at batch 64, a ``StepDone`` and a ``RunStep`` of 64 decode rows, an
``EmitTokens`` of 64, and a few arrivals and finishes per tick. A *row* is one sequence's entry in a step.

- append, sync never: ``LogWriter.append_tick`` (encoding included, the commands re-encoded as no core is there
  to hand them over), flushed the way the log actor flushes with fsync ``never``: one ``os.write`` whenever
  ``actors.log.FLUSH_BYTES`` are buffered (group commit); versus ``Encoder.encode`` of the same ``TickRecord``
  values. A second line, "engine path", passes the commands the core already encoded for its digest, as the
  step actor does.
- append, sync every tick: the same with ``sync`` (flush and fsync) every tick.
- read+decode: ``LogReader.ticks()`` over the whole file (CRC checks, header walk, decode); versus
  ``Decoder(TickRecord).decode`` of each record's bytes from a list in memory.

Each figure is the best of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable

HELP = "log append and read throughput against plain msgspec encoding and decoding"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ticks", type=int, default=2000, help="ticks per run (default 2000)")
    parser.add_argument("--sync-ticks", type=int, default=200, help="ticks per fsync-every-tick run (default 200)")
    parser.add_argument("--batch", type=int, default=64, help="decode rows per tick (default 64)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure; the best is kept (default 5)")
    parser.add_argument("--dir", default=None, help="directory for the log files (default: a temporary one)")


def _best(repeat: int, *fns: Callable[[], None]) -> list[float]:
    """The best time of each of ``fns`` over ``repeat`` rounds; the rounds interleave them, so a busy machine
    slows a figure and its baseline alike."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def run(args: argparse.Namespace) -> int:
    import msgspec

    from tickloom.actors.log import FLUSH_BYTES
    from tickloom.events import FORMAT_VERSION, SCHEMA_HASH, LogHeader, LogReader, LogWriter, RunStep, TickRecord
    from tickloom.events.digest import DIGEST_VERSION
    from tickloom.events.frames import HEADER_SIZE
    from tickloom.tools.bench.sample_ticks import make_ticks
    from tickloom.tools.cli import CliError

    if min(args.ticks, args.sync_ticks, args.batch, args.repeat) < 1:
        raise CliError("--ticks, --sync-ticks, --batch and --repeat must be at least 1")
    ticks = make_ticks(args.ticks, batch=args.batch)
    records = [TickRecord(i, o) for i, o, _ in ticks]
    rows = sum(len(c.request_ids) for _, o, _ in ticks for c in o.commands if isinstance(c, RunStep))
    header = LogHeader(FORMAT_VERSION, SCHEMA_HASH, DIGEST_VERSION, "bench", "{}")
    encoder = msgspec.msgpack.Encoder(order="deterministic")
    decoder = msgspec.msgpack.Decoder(TickRecord)
    encoded = [encoder.encode(r) for r in records]
    plain_bytes = sum(len(b) for b in encoded)

    def plain_encode() -> None:
        enc = encoder.encode
        for r in records:
            enc(r)

    def plain_decode() -> None:
        dec = decoder.decode
        for b in encoded:
            dec(b)

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tickloom-bench-") as tmp:
        path = os.path.join(tmp, "bench.tlog")

        def append(n: int, sync: bool, reuse: bool = False) -> Callable[[], None]:
            def go() -> None:
                if os.path.exists(path):  # our own file in our own temporary directory: logs never overwrite
                    os.unlink(path)
                with LogWriter(path, header) as w:
                    for inputs, outputs, encoded in ticks[:n]:
                        w.append_tick(inputs, outputs, encoded if reuse else None)
                        if sync:
                            w.sync()
                        elif w.pending_bytes >= FLUSH_BYTES:
                            w.flush()

            return go

        (t_sync,) = _best(args.repeat, append(min(args.sync_ticks, len(ticks)), sync=True))
        t_enc, t_app, t_engine = _best(
            args.repeat, plain_encode, append(len(ticks), sync=False), append(len(ticks), sync=False, reuse=True)
        )
        log_bytes = os.path.getsize(path)

        def read() -> None:
            with LogReader(path) as r:
                for _ in r.ticks():
                    pass

        t_dec, t_read = _best(args.repeat, plain_decode, read)
        header_frame = HEADER_SIZE + len(encoder.encode(header))

    n = len(ticks)
    frame_bytes = log_bytes - header_frame
    sync_n = min(args.sync_ticks, n)
    sync_rows = rows * sync_n / n
    results = [
        {"bench": "log", "figure": "bytes_per_tick", "log": frame_bytes / n, "plain": plain_bytes / n,
         "ratio": frame_bytes / plain_bytes},
        _rate("append", "never", n, rows, frame_bytes, t_app, t_enc),
        _rate("append_engine_path", "never", n, rows, frame_bytes, t_engine, t_enc),
        _rate("append", "tick", sync_n, sync_rows, frame_bytes * sync_n / n, t_sync, t_enc * sync_n / n),
        _rate("read_decode", None, n, rows, frame_bytes, t_read, t_dec),
    ]
    meta = {"ticks": n, "batch": args.batch, "rows": rows, "repeat": args.repeat}
    if args.json:
        for r in results:
            print(json.dumps({**r, **meta}))
    else:
        print(f"tickloom bench log: {n} ticks at batch {args.batch} ({rows} rows), best of {args.repeat}")
        b = results[0]
        print(f"  bytes/tick        log {b['log']:9.0f}   plain msgpack {b['plain']:9.0f}   ratio {b['ratio']:.3f}")
        for r in results[1:]:
            label = f"{r['figure']}" + (f" (sync {r['sync']})" if r.get("sync") else "")
            print(
                f"  {label:<38} {r['ticks_per_s']:10.0f} ticks/s {r['rows_per_s']:12.0f} rows/s "
                f"{r['mb_per_s']:8.1f} MB/s   plain {r['plain_rows_per_s']:12.0f} rows/s   "
                f"ratio {r['ratio']:.2f}x"
            )
    return 0


def _rate(
    figure: str, sync: str | None, ticks: int, rows: float, nbytes: float, seconds: float, plain_seconds: float
) -> dict[str, object]:
    out: dict[str, object] = {"bench": "log", "figure": figure}
    if sync is not None:
        out["sync"] = sync
    out.update(
        ticks_per_s=ticks / seconds,
        rows_per_s=rows / seconds,
        mb_per_s=nbytes / seconds / 1e6,
        plain_rows_per_s=rows / plain_seconds,
        ratio=plain_seconds / seconds,
    )
    return out
