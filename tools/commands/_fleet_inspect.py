"""``tickloom inspect`` on a router log: the header and one line per router tick (what ``replay.trace`` does for an
engine log), and with ``--request`` what happened to one request."""

from __future__ import annotations

import argparse
import os
from collections import Counter
from collections.abc import Iterator

from tickloom.events import LogError
from tickloom.fleet.router_events import Arrival, Finished, Lost, Refuse, ReplicaDown, ReplicaUp, Route
from tickloom.fleet.router_events import RouterTickRecord as Tick
from tickloom.fleet.router_log import RouterLogReader

COLUMNS = ("tick", "time_ms", "arrive", "affinity", "load", "turn", "refused", "finished", "reports", "down", "up",
           "lost", "live", "open")
_FMT = "{:>7} {:>10} {:>6} {:>8} {:>5} {:>5} {:>7} {:>8} {:>7} {:>4} {:>3} {:>5} {:>4} {:>5}"


def header_lines(path: str | os.PathLike[str]) -> list[str]:
    with RouterLogReader(path) as reader:
        h = reader.header
        config = reader.config
    return [f"{os.fspath(path)}: router log, format {h.format_version}, schema {h.schema_hash}, snapshot every "
            f"{h.snapshot_every} ticks",
            f"  router {h.engine_version!r}: {config.replicas} replicas, policy {config.policy}, block size "
            f"{config.block_size}, affinity over {config.affinity_blocks} blocks, load slack {config.load_slack}",
            f"  config {h.config_json}"]


def iter_ticks(path: str | os.PathLike[str], first: int | None = None, last: int | None = None) -> Iterator[Tick]:
    with RouterLogReader(path) as reader:
        for record in reader.router_ticks():
            tick = record.inputs.tick
            if (first is None or tick >= first) and (last is None or tick < last):
                yield record


def header_line() -> str:
    return _FMT.format(*COLUMNS)


def format_tick(record: Tick, t0: int) -> str:
    inputs = Counter(type(i).__name__ for i in record.inputs.inputs)
    reasons = Counter(c.reason for c in record.outputs.commands if isinstance(c, Route))
    commands = record.outputs.commands
    g = record.outputs.gauges
    return _FMT.format(record.inputs.tick, f"{(record.inputs.now_ns - t0) / 1e6:.3f}", inputs["Arrival"],
                       reasons["affinity"], reasons["load"], reasons["round-robin"],
                       sum(isinstance(c, Refuse) for c in commands), inputs["Finished"], inputs["LoadReport"],
                       inputs["ReplicaDown"], inputs["ReplicaUp"],
                       sum(len(c.request_ids) for c in commands if isinstance(c, Lost)), g.live, g.open)


def involves(record: Tick, request_id: str) -> list[str]:
    """What this tick did with ``request_id``, in words (nothing: not involved)."""
    said = []
    for item in record.inputs.inputs:
        if isinstance(item, Arrival) and item.request_id == request_id:
            said.append(f"arrives ({item.prompt_tokens} prompt tokens, {len(item.block_hashes)} blocks hashed)")
        elif isinstance(item, Finished) and item.request_id == request_id:
            said.append("finished")
    for command in record.outputs.commands:
        if isinstance(command, Route) and command.request_id == request_id:
            said.append(f"routed to replica {command.replica} by {command.reason} ({command.matched_blocks} "
                        "blocks matched)")
        elif isinstance(command, Refuse) and command.request_id == request_id:
            said.append(f"refused: {command.reason}")
        elif isinstance(command, Lost) and request_id in command.request_ids:
            said.append(f"lost with replica {command.replica}")
    return said


def describe_inputs(record: Tick) -> list[str]:
    """Replica events of the tick (down, up), for the table's notes."""
    notes = []
    for item in record.inputs.inputs:
        if isinstance(item, ReplicaDown):
            notes.append(f"replica {item.replica} down: {item.reason}")
        elif isinstance(item, ReplicaUp):
            notes.append(f"replica {item.replica} up (incarnation {item.incarnation})")
    return notes


def print_table(path: str, first: int | None, last: int | None, request: str | None) -> None:
    """The lines ``tickloom inspect`` prints after the header."""
    print(header_line())
    t0: int | None = None
    for record in iter_ticks(path, first, last):
        t0 = record.inputs.now_ns if t0 is None else t0
        line = format_tick(record, t0)
        if request is not None:
            events = involves(record, request)
            if not events:
                continue
            line += "  " + "; ".join(events)
        else:
            notes = describe_inputs(record)
            if notes:
                line += "  " + "; ".join(notes)
        print(line)


def run_inspect(args: argparse.Namespace, first: int | None, last: int | None) -> int:
    """``tickloom inspect`` on a router log (``tools/commands/inspect.py`` dispatches here)."""
    from tickloom.tools.cli import CliError

    if args.trace or args.plot:
        raise CliError("--trace and --plot read an engine log; this is a router log")
    try:
        for line in header_lines(args.log):
            print(line)
        if not args.no_table:
            print_table(args.log, first, last, args.request)
    except LogError as exc:
        raise CliError(str(exc), status=2) from exc
    return 0
