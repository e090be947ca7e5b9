"""``tickloom inspect LOG``: the header and a dense per-tick trace; optionally a Perfetto trace and a plot
(``--plot`` needs the optional extra ``tickloom[plot]``, matplotlib)."""

from __future__ import annotations

import argparse
import os

NAME = "inspect"
HELP = "print a log's header and per-tick trace; write a Perfetto trace or a plot"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", help="the log file")
    parser.add_argument("--ticks", metavar="A:B", help="only ticks A <= tick < B (either side may be empty)")
    parser.add_argument("--request", metavar="ID", help="only ticks that involve request ID, with what happened")
    parser.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace (Trace Event Format)")
    parser.add_argument("--plot", metavar="OUT.png", help="plot batch size, free blocks and queue lengths")
    parser.add_argument("--no-table", action="store_true", help="print the header only")


def _parse_ticks(text: str | None) -> tuple[int | None, int | None]:
    from tickloom.tools.cli import CliError

    if text is None:
        return None, None
    first, sep, last = text.partition(":")
    try:
        if not sep:
            return int(first), int(first) + 1
        return (int(first) if first else None), (int(last) if last else None)
    except ValueError as exc:
        raise CliError(f"--ticks {text!r}: expected A:B with integer ticks") from exc


def require_matplotlib(flag: str) -> None:
    """A usage error (one line, exit 64) if matplotlib, the optional extra ``tickloom[plot]``, is missing."""
    from tickloom.tools.cli import CliError

    try:
        import matplotlib  # noqa: F401 - only checking that it is there
    except ImportError:
        raise CliError(f"install tickloom[plot] for {flag} (matplotlib is not installed)") from None


def run(args: argparse.Namespace) -> int:
    from tickloom.events import LogError, LogReader
    from tickloom.replay.trace import format_row, header_line, involves, iter_ticks, tick_row, write_plot, write_trace
    from tickloom.tools.cli import CliError

    first, last = _parse_ticks(args.ticks)
    for flag, out in (("--trace", args.trace), ("--plot", args.plot)):
        if out is not None and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            raise CliError(f"{flag} {out}: no such directory")
    if args.plot:
        require_matplotlib("--plot")
    from tickloom.events.log import check_log_file

    try:
        check_log_file(args.log)  # missing, a directory, no permission: one line, exit 2
    except LogError as exc:
        raise CliError(str(exc), status=2) from None
    from tickloom.fleet.router_log import is_router_log

    if is_router_log(args.log):  # a fleet's router log: its own table (tickloom.tools.commands._fleet_inspect)
        from tickloom.tools.commands._fleet_inspect import run_inspect

        return run_inspect(args, first, last)
    try:
        with LogReader(args.log) as reader:
            h = reader.header
        print(f"{args.log}: format {h.format_version}, schema {h.schema_hash}, digest v{h.digest_version}, "
              f"snapshot every {h.snapshot_every} ticks")
        print(f"  engine {h.engine_version!r}, model {h.model_fingerprint or '-'}, tokenizer "
              f"{h.tokenizer_fingerprint or '-'}")
        print(f"  torch {h.torch_version or '-'}, device {h.device or '-'}, dtype {h.dtype or '-'}, "
              f"threads {h.threads}")
        print(f"  config {h.config_json}")
        if not args.no_table:
            print(header_line())
            t0: int | None = None
            for record in iter_ticks(args.log, first, last):
                t0 = record.inputs.now_ns if t0 is None else t0
                line = format_row(tick_row(record), t0)
                if args.request is not None:
                    events = involves(record, args.request)
                    if not events:
                        continue
                    line += "  " + "; ".join(events)
                print(line)
        if args.trace:
            n = write_trace(args.log, args.trace)
            print(f"wrote {args.trace}: {n} trace events")
        if args.plot:
            write_plot(args.log, args.plot)
            print(f"wrote {args.plot}")
    except LogError as exc:
        raise CliError(str(exc), status=2) from exc
    return 0
