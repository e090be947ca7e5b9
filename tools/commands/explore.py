"""``tickloom explore``: the race explorer. Runs many seeded schedules, checks every run, shrinks a violation.

    tickloom explore --actors [--seeds N] [--strategy random|pct|delay] [--faults] [--out DIR]
    tickloom explore --replay TOKEN
    tickloom explore [LOG] [--seeds N] [--strategy random|pct|delay] [--faults] [--out DIR]   # the core level

Two levels. ``--actors`` runs the real trio actors and ``Engine`` on the stub device under a mock clock, with
trio's scheduler seeded (``tools.explore_actors``). Without it, the core level explores the core on its own
through the simulator, optionally from a log's workload (``replay.explore``, ``replay.shrink``); it plugs in at
``run_core_level``.

On a violation: the shrunk script, its log (with ``--out DIR``), a replay token for ``--replay``, and a pytest
regression test to paste. Exit status: 0 no violation; 1 a violation; 2 an unreadable LOG;
64 usage errors. The last line sums up the
seeds run, seeds per second and violations.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # deliberately broken actors, for testing the explorer


def run_core_level(args: argparse.Namespace) -> int:
    """The core level's entry point (the simulator-driven explorer, ``replay.shrink.run_cli``)."""
    from tickloom.replay.shrink import UnreadableLog, UsageError, run_cli
    from tickloom.tools.cli import CliError

    try:
        return run_cli(log=args.log, seeds=range(args.seed_start, args.seed_start + args.seeds),
                       strategy=args.strategy, faults=args.faults, variant=args.variant, out=args.out,
                       shrink=not args.no_shrink, verbose=args.verbose, replay=args.replay)
    except UsageError as exc:
        raise CliError(str(exc)) from None
    except UnreadableLog as exc:
        raise CliError(str(exc), status=2) from None


def run(args: argparse.Namespace) -> int:
    from tickloom.tools.cli import CliError

    if args.seeds < 1:
        raise CliError("--seeds must be at least 1")
    if args.seed_start < 0:
        raise CliError("--seed-start must not be negative")
    if args.replay is not None:
        return _replay(args)
    if not args.actors:
        return run_core_level(args)
    if args.log is not None:
        raise CliError("--actors runs generated workloads; LOG is for the core level")
    from tickloom.tools.explore_variants import VARIANTS

    if args.variant is not None and args.variant not in VARIANTS:
        raise CliError(f"unknown variant {args.variant!r}")
    return _explore(args)


def _explore(args: argparse.Namespace) -> int:
    from tickloom.tools.explore_actors import RunResult, describe, explore

    def progress(seed: int, result: RunResult) -> None:
        status = "ok" if result.violation is None else str(result.violation)
        print(f"seed {seed}: {result.ticks} ticks, {result.virtual_s:.2f} s virtual: {status}", flush=True)

    exploration = explore(range(args.seed_start, args.seed_start + args.seeds), args.strategy, args.faults,
                          args.variant, shrink=not args.no_shrink, out=args.out,
                          progress=progress if args.verbose else None)
    if exploration.found is not None:
        print(describe(exploration.found))
    print(exploration.summary())
    return 1 if exploration.found is not None else 0


def _replay(args: argparse.Namespace) -> int:
    from tickloom.replay.shrink import TOKEN_PREFIX
    from tickloom.tools.cli import CliError
    from tickloom.tools.explore_actors import LEVEL, decode_token, replay_scenario
    from tickloom.tools.explore_variants import VARIANTS, enabled

    if args.replay.startswith(TOKEN_PREFIX):
        return run_core_level(args)
    try:
        token = decode_token(args.replay)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if token.level != LEVEL:
        return run_core_level(args)
    if token.variant is not None and token.variant not in VARIANTS:
        raise CliError(f"the token names an unknown variant {token.variant!r}")
    import time

    started = time.perf_counter()
    with enabled(token.variant):
        try:
            violation = replay_scenario(token.seed, token.strategy, token.faults, token.keep)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    elapsed = time.perf_counter() - started
    kept = "all" if token.keep is None else str(len(token.keep))
    print(f"replayed seed {token.seed} ({token.level}, strategy {token.strategy}, faults "
          f"{'on' if token.faults else 'off'}{', variant ' + token.variant if token.variant else ''}; "
          f"{kept} actions): {violation if violation is not None else 'no violation'}")
    print(f"explored 1 seeds ({LEVEL}) in {elapsed:.1f} s: {1 / max(elapsed, 1e-9):.1f} seeds/s, "
          f"{int(violation is not None)} violations", file=sys.stdout)
    return 1 if violation is not None else 0
