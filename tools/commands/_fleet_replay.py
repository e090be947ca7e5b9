"""``tickloom replay`` on a fleet directory or a router log (``tools/commands/replay.py`` dispatches here).

A fleet directory: the router log and every replica log are verified (``--bisect``: each is bisected). A router log:
exact replay, ``--bisect``, or ``--until T [--dump]``; ``--full`` needs a model, which a router log has none of.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import msgspec

from tickloom.events import LogError
from tickloom.fleet.router_replay import (
    ROUTER_LOG,
    FleetReport,
    bisect_router,
    is_fleet_dir,
    replica_logs,
    router_at,
    verify_fleet,
    verify_router,
)
from tickloom.replay import bisect

Emit = Callable[[argparse.Namespace, dict[str, object], str, int], int]


def run_fleet_replay(args: argparse.Namespace, emit: Emit) -> int:
    from tickloom.tools.cli import CliError

    if args.full:
        raise CliError("--full re-runs one engine's model: pass a replica's log (replica-<i>/incarnation-<n>.tlog)")
    if os.path.isdir(args.log):
        if not is_fleet_dir(args.log):
            raise CliError(f"{args.log}: a directory without a {ROUTER_LOG} is not a fleet directory", status=2)
        if args.until is not None:
            raise CliError("--until reads one log: pass the router log or a replica's log")
        if args.bisect:
            report = FleetReport(os.fspath(args.log), bisect_router(os.path.join(args.log, ROUTER_LOG)),
                                 [(i, n, bisect(path)) for i, n, path in replica_logs(args.log)])
        else:
            report = verify_fleet(args.log)
        return emit(args, report.to_json(), report.format_text(), report.exit_code)
    if args.until is not None:
        return _until(args, emit)
    router_report = bisect_router(args.log) if args.bisect else verify_router(args.log)
    return emit(args, router_report.to_json(), router_report.format_text(), router_report.exit_code)


def _until(args: argparse.Namespace, emit: Emit) -> int:
    from tickloom.tools.cli import CliError

    try:
        router = router_at(args.log, args.until)
    except LogError as exc:
        return emit(args, {"status": "unreadable", "error": str(exc)}, f"unreadable: {exc}", 2)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    snapshot = router.snapshot()
    if args.json:
        print(msgspec.json.encode({"status": "ok", "tick": router.tick_no, "state": snapshot}).decode())
        return 0
    g = router.gauges()
    print(f"router after tick {router.tick_no} (now_ns {router.now_ns}, digest {router.digest.hex()}): "
          f"{g.live} live replicas, {g.open} open requests")
    for index, r in enumerate(snapshot.replicas):
        print(f"  replica {index}: {'live' if r.live else 'down'}, incarnation {r.incarnation}, waiting {r.waiting}, "
              f"running {r.running}, routed since its report {r.routed_since_report}, free blocks {r.free_blocks}, "
              f"{len(r.cached)} block hashes remembered")
    if args.dump:
        for rid, index in snapshot.open:
            print(f"  {rid}: open on replica {index}")
    return 0


def run_fleet_whatif(args: argparse.Namespace) -> int:
    """``tickloom whatif`` on a fleet directory or its router log: ``--set`` changes the router's configuration;
    ``--step-model`` picks the replicas' step-time model and ``--validate`` re-runs a stub fleet for real."""
    import json

    from tickloom.events import LogError
    from tickloom.fleet.whatif import ROUTER_KEYS, fleet_whatif
    from tickloom.replay.header import ReplayConfigError
    from tickloom.tools.cli import CliError

    if args.modelled or args.plot:
        raise CliError("--modelled and --plot are for one engine's log; a fleet what-if is always modelled")
    fleet_dir = args.log if os.path.isdir(args.log) else os.path.dirname(os.path.abspath(args.log))
    changes: dict[str, object] = {}
    for pair in args.sets:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or key not in ROUTER_KEYS:
            raise CliError(f"--set {pair!r}: a fleet what-if sets KEY=VALUE with KEY one of {', '.join(ROUTER_KEYS)}")
        try:
            changes[key] = json.loads(raw)
        except json.JSONDecodeError:
            changes[key] = raw.strip()

    def unreadable(error: str) -> int:
        print(json.dumps({"status": "unreadable", "error": error}) if args.json else f"unreadable: {error}")
        return 2

    if not is_fleet_dir(fleet_dir):
        return unreadable(f"{fleet_dir}: not a fleet directory (no {ROUTER_LOG})")
    try:
        result = fleet_whatif(fleet_dir, changes, step_model=args.step_model)
        report = None
        if args.validate:
            from tickloom.tools.commands._whatif_validate import validate_fleet

            report = validate_fleet(fleet_dir, changes, result)
    except (LogError, ReplayConfigError) as exc:
        return unreadable(str(exc))
    except ValueError as exc:  # a bad router value, a missing profile, a fleet that cannot be re-run
        raise CliError(str(exc)) from None
    if args.json:
        out = result.to_json()
        if report is not None:
            out["validate"] = report.to_json()
        print(json.dumps(out))
    else:
        print(result.format_text())
        if report is not None:
            print()
            print(report.format_text())
    return 0
