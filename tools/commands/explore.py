"""``tickloom explore``: the race explorer. Runs many seeded schedules, checks every run, shrinks a violation.

    tickloom explore [LOG] [--seeds N] [--strategy random|pct|delay] [--faults] [--out DIR]   # the core level
    tickloom explore --actors [--seeds N] [--strategy random|pct|delay] [--faults] [--out DIR]
    tickloom explore --replay TOKEN

Two levels of one explorer (``tools.explore``). Without ``--actors``, the core level explores the core on its own
through the simulator, optionally from a log's workload; ``--actors`` runs the real trio actors and ``Engine`` on
the stub device under a mock clock, with trio's scheduler seeded (it needs the trio that ``tickloom[explore]`` pins).
This module only parses the arguments and prints.

On a violation: the shrunk script, its log (with ``--out DIR``), a replay token for ``--replay``, and a pytest
regression test to paste. Exit status: 0 no violation; 1 a violation; 2 an unreadable LOG; 64 usage errors (the
actor level without the trio it needs, too). The last line sums up the seeds run, seeds per second and violations.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tickloom.tools.progress import Progress, add_quiet_argument

if TYPE_CHECKING:
    from tickloom.tools.explore.driver import Level, Run

NAME = "explore"
HELP = "race explorer: seeded schedules of the actors (--actors) or the core, checked and shrunk"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", nargs="?", metavar="LOG", help="core level: explore around this log's workload")
    parser.add_argument("--seeds", type=int, default=200, metavar="N", help="seeds to run (default 200)")
    parser.add_argument("--seed-start", type=int, default=0, metavar="S", help="first seed (default 0)")
    parser.add_argument("--strategy", choices=("random", "pct", "delay"), default="random",
                        help="scheduling strategy (default random)")
    parser.add_argument("--faults", action="store_true",
                        help="inject faults: failed steps, spill writes and swap-in reads, slow I/O; with --actors "
                             "also actor crashes")
    parser.add_argument("--actors", action="store_true", help="the actor level: real trio actors, stub device")
    parser.add_argument("--out", type=Path, metavar="DIR", help="keep a failing run's log in DIR")
    parser.add_argument("--replay", metavar="TOKEN", help="re-run one violation from its replay token")
    parser.add_argument("--no-shrink", action="store_true", help="report a violation without shrinking it")
    parser.add_argument("--verbose", action="store_true", help="print one line per seed")
    add_quiet_argument(parser)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # deliberately broken code, for testing the explorer


def _level(name: str) -> Level[Any]:
    from tickloom.tools.cli import CliError
    from tickloom.tools.explore.levels import level_named

    try:
        return level_named(name)
    except ImportError as exc:  # the actor level, without the trio it needs: a missing extra, as elsewhere
        raise CliError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from tickloom.events import LogError
    from tickloom.tools.cli import CliError
    from tickloom.tools.explore.driver import describe, explore
    from tickloom.tools.explore.variants import check_variant

    if args.seeds < 1:
        raise CliError("--seeds must be at least 1")
    if args.seed_start < 0:
        raise CliError("--seed-start must not be negative")
    if args.replay is not None:
        return _replay(args.replay)
    if args.actors and args.log is not None:
        raise CliError("--actors runs generated workloads; LOG is for the core level")
    level = _level("actors" if args.actors else "core")
    try:
        check_variant(level.name, args.variant)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.log is not None:
        try:
            level.subject(0, args.faults, args.log)
        except (LogError, OSError, ValueError) as exc:  # a log that cannot be read exits 2, as every log reader does
            raise CliError(f"cannot explore {args.log}: {exc}", status=2) from None

    def progress(seed: int, run: Run) -> None:
        if args.verbose:
            virtual = f", {run.virtual_s:.2f} s virtual" if run.virtual_s is not None else ""
            print(f"seed {seed}: {run.ticks} ticks{virtual}: {run.violation or 'ok'}", flush=True)
        bar.advance(description=f"explore ({level.name}): seed {seed}")

    with Progress(f"explore ({level.name})", args.seeds, quiet=args.quiet or args.verbose) as bar:
        exploration = explore(level, range(args.seed_start, args.seed_start + args.seeds), args.strategy,
                              args.faults, args.variant, source=args.log, shrink=not args.no_shrink, out=args.out,
                              progress=progress)
    if exploration.found is not None:
        print(describe(exploration.found))
    print(exploration.summary())
    return 1 if exploration.found is not None else 0


def _replay(text: str) -> int:
    from tickloom.tools.cli import CliError
    from tickloom.tools.explore.driver import decode_token, replay
    from tickloom.tools.explore.variants import enabled

    try:
        token = decode_token(text)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    level = _level(token.level)
    started = time.perf_counter()
    with enabled(token.variant):
        try:
            subject, run = replay(level, token)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    elapsed = time.perf_counter() - started
    moved = f", {len(token.edits)} moved events" if level.moves_events else ""
    print(f"replayed seed {token.seed} ({level.name}, strategy {token.strategy}, faults "
          f"{'on' if token.faults else 'off'}{', variant ' + token.variant if token.variant else ''}; "
          f"{len(subject.actions)} actions{moved}): {run.violation or 'no violation'}")
    print(f"explored 1 seed ({level.name}) in {elapsed:.1f} s: {1 / max(elapsed, 1e-9):.1f} seeds/s, "
          f"{'1 violation' if run.violation is not None else '0 violations'}")
    return 1 if run.violation is not None else 0
