"""``tickloom replay LOG``: replay a log on the real core and prove every decision reproduces, or name the first
tick that diverges.

``--full`` re-runs the model the log names in its header (the engine configuration's ``model``: a name, a path
as it was given then, or ``stub``); ``--model`` overrides it, e.g. for a log written elsewhere.

Exit status: 0 identical (or nothing found by ``--bisect``); 1 divergent, the core raised while replaying, or
``--bisect`` found a violation; 2 the log cannot be read; 64 usage errors; 65 the model cannot be loaded.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable
from typing import Any

NAME = "replay"
HELP = "replay a log on the core: identical, or the first divergent tick with a diff"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", help="the log file (an engine's or a router's), or a fleet directory")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help="also re-run the model and compare sampled tokens")
    mode.add_argument("--bisect", action="store_true", help="find the first tick where check_invariants() fails")
    mode.add_argument("--until", type=int, metavar="TICK", help="replay up to TICK (seeking from a snapshot)")
    parser.add_argument("--dump", action="store_true", help="with --until: print the core state at TICK")
    parser.add_argument("--model", help="with --full: the model (name, directory or .gguf) to re-run (default: the "
                                        "one the log's header names)")
    parser.add_argument("--device", default=None, help="with --full: torch device (default cpu)")
    parser.add_argument("--dtype", default=None, help="with --full: float32, float64, float16 or bfloat16 (default: "
                                                      "the log header's, else float32)")
    from tickloom.tools.progress import add_quiet_argument

    add_quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    from tickloom.tools.cli import CliError
    from tickloom.tools.model_options import check_dtype

    if args.dump and args.until is None:
        raise CliError("--dump needs --until TICK")
    for flag in ("model", "device", "dtype"):
        if getattr(args, flag) is not None and not args.full:
            raise CliError(f"--{flag} needs --full")
    check_dtype(args.dtype)
    if args.full:
        from tickloom.tools.model_options import check_device, check_model

        check_device(args.device)
        if args.model:
            check_model(args.model)
    if args.until is not None and args.until < 0:
        raise CliError("--until must be a tick number (0 or more)")
    problem = log_input_problem(args.log)
    if problem is not None:
        return _emit(args, {"status": "unreadable", "error": problem}, f"unreadable: {problem}", 2)
    if os.path.isdir(args.log) or _is_router_log(args.log):  # a fleet directory or a router log: tickloom.fleet
        from tickloom.tools.commands._fleet_replay import run_fleet_replay

        return run_fleet_replay(args, _emit)
    if args.until is not None:
        return _until(args)
    if args.bisect:
        from tickloom.replay import bisect

        report = bisect(args.log)
        return _emit(args, report.to_json(), report.format_text(), report.exit_code)
    from tickloom.replay import verify

    model = _full_model(args) if args.full else None  # usage errors before any work
    report = verify(args.log)
    if model is None or report.exit_code != 0:
        return _emit(args, report.to_json(), report.format_text(), report.exit_code)
    if not args.json:
        print(report.format_text())
    return _full(args, model, report.to_json())


def log_input_problem(path: str) -> str | None:
    """Why ``path`` is neither a log file this process can read nor a fleet directory (one line naming the
    problem: no such file, a directory that is not a fleet's, no permission...), or None. What is in a file is the
    reader's to judge."""
    from tickloom.events import LogError
    from tickloom.events.log import check_log_file

    if os.path.isdir(path):
        from tickloom.fleet.router_replay import ROUTER_LOG, is_fleet_dir

        if is_fleet_dir(path):
            return None
        return f"{path}: is a directory, not a log file or a fleet directory (no {ROUTER_LOG} in it)"
    try:
        check_log_file(path)
    except LogError as exc:
        return str(exc)
    return None


def _is_router_log(path: str) -> bool:
    from tickloom.fleet.router_log import is_router_log

    return is_router_log(path)


def _emit(args: argparse.Namespace, obj: dict[str, object], text: str, code: int) -> int:
    if args.json:
        print(json.dumps(obj, default=_json_default))
    else:
        print(text)
    return code


def _json_default(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(type(value).__name__)


def _logged_model(config_json: str) -> str | None:
    """The model an engine log was written with (its configuration's ``model``), or None (e.g. a recorder's
    log, which names none). The JSON was already parsed once by ``core_config_from_header``."""
    data = json.loads(config_json)
    engine = data.get("engine") if isinstance(data, dict) else None
    model = engine.get("model") if isinstance(engine, dict) else None
    return model if isinstance(model, str) and model else None


def _full_model(args: argparse.Namespace) -> str | None:
    """The model ``--full`` re-runs: ``--model``, else the header's; checked like ``generate``'s (a usage error
    if it is not there). None if the log cannot be read: the exact replay reports that."""
    from tickloom.events import LogError, LogReader
    from tickloom.tools.cli import CliError
    from tickloom.tools.model_options import check_model

    if args.model:
        return str(args.model)  # checked already
    try:
        with LogReader(args.log) as reader:
            config_json = reader.header.config_json
        model = _logged_model(config_json)
    except (LogError, ValueError, RecursionError):  # ValueError: config_json is not JSON
        return None
    if model is None:
        raise CliError("--full: the log's header names no model (it was not written by the engine); pass --model M")
    check_model(model, flag="the log's model")
    return model


def _full(args: argparse.Namespace, model: str, exact: dict[str, object]) -> int:
    from tickloom.engine.model.errors import ModelLoadError
    from tickloom.events import LogError, LogReader
    from tickloom.replay import ReplayConfigError, core_config_from_header
    from tickloom.replay.full import ModelDevice, load_device, verify_full
    from tickloom.tools.cli import EX_DATAERR, CliError

    try:
        with LogReader(args.log) as reader:
            header = reader.header
        config = core_config_from_header(header)
    except (LogError, ReplayConfigError) as exc:
        print(f"unreadable: {exc}")
        return 2
    device: Any
    if model == "stub":
        from tickloom.engine.model.stub import StubExecutor

        # The stub device never samples EOS unless scripted (``actors.device.StubDevice``): neither does its re-run.
        device = ModelDevice(StubExecutor(config.vocab_size, config.num_blocks, config.block_size,  # type: ignore[arg-type]
                                          avoid=tuple(config.eos_token_ids)))
        fingerprint = "stub"
    else:
        try:
            device, fingerprint = load_device(model, config.num_blocks, config.block_size,
                                              dtype=args.dtype or header.dtype or None, device=args.device)
        except ModelLoadError as exc:
            raise CliError(f"cannot load model {model!r}: {exc}", EX_DATAERR) from None
    note = None
    if header.model_fingerprint and header.model_fingerprint != fingerprint:
        note = f"model fingerprint {fingerprint} differs from the log's {header.model_fingerprint}"
    from tickloom.tools.progress import Progress

    with Progress("replay --full", unit="device commands re-run", quiet=args.quiet) as bar:
        report = verify_full(args.log, _Counted(device, bar), note=note)
    if args.json:
        print(json.dumps({**exact, "model": model, "full": report.to_json(), "status": report.status},
                         default=_json_default))
    else:
        print(f"model: {model}" + ("" if args.model else " (from the log's header)"))
        print(report.format_text())
    return report.exit_code


def _until(args: argparse.Namespace) -> int:
    import msgspec

    from tickloom.events import LogError
    from tickloom.replay import ReplayConfigError, core_at

    try:
        core = core_at(args.log, args.until)
    except (LogError, ReplayConfigError) as exc:
        return _emit(args, {"status": "unreadable", "error": str(exc)}, f"unreadable: {exc}", 2)
    except ValueError as exc:
        from tickloom.tools.cli import CliError

        raise CliError(str(exc)) from exc
    except Exception as exc:
        return _emit(args, {"status": "divergent", "error": str(exc)},
                     f"divergent: the core raised while replaying to tick {args.until}: {exc}", 1)
    snapshot = core.snapshot()
    if args.json:
        print(msgspec.json.encode({"status": "ok", "tick": core.state.tick, "state": snapshot}).decode())
        return 0
    state = core.state
    g = core.gauges()
    print(f"state after tick {state.tick} (now_ns {state.now_ns}, digest {state.digest.hex()})")
    print(f"  waiting {g.waiting}, running {g.running}, preempted {g.preempted}, swapped {g.swapped}, "
          f"free blocks {g.free_blocks}, cached blocks {g.cached_blocks}, steps in flight "
          f"{[s.step_id for s in state.steps]}")
    if args.dump:
        for seq in state.seqs.values():
            print(f"  {seq.request_id}: {seq.status.name.lower()}, prompt {len(seq.prompt)}, outputs "
                  f"{len(seq.outputs)}, computed {seq.num_computed}, blocks {seq.block_ids}")
        print(f"  free blocks: {list(state.pool.free)}")
        print(f"  cached blocks: {list(state.pool.cached)}")
    return 0


class _Counted:
    """A device that advances the progress bar by the commands it handles (``verify_full`` feeds it each one)."""

    def __init__(self, device: Any, bar: Any) -> None:
        self.device = device
        self.bar = bar

    def replay_proposals(self, right: dict[tuple[int, str], list[int]]) -> None:
        take = getattr(self.device, "replay_proposals", None)
        if callable(take):
            take(right)

    def handle(self, commands: Iterable[Any]) -> list[Any]:
        commands = list(commands)
        results: list[Any] = self.device.handle(commands)
        self.bar.advance(len(commands))
        return results
