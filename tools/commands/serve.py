"""``tickloom serve``: an OpenAI-compatible HTTP server (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, ``/metrics``) over one embedded engine.

Every run writes a log (``--log PATH``, by default a fresh ``tickloom-serve-<time>-<pid>.tlog`` in the current
directory; ``--no-log`` for none) that ``tickloom replay`` checks. SIGTERM or Ctrl-C drains (running requests
finish, new ones get 503), then exits; a second signal stops at once.

``--replicas N`` (N > 1, or with ``--fleet-dir``) serves a fleet instead: N engine replicas on Ray behind the logged
router (``tickloom.fleet``, the extra ``tickloom[fleet]``), its logs in ``--fleet-dir`` (by default a fresh
``tickloom-serve-<time>-<pid>/``), which ``tickloom replay DIR`` checks. Ray is started locally for the run, or
joined with ``--address``.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tickloom import EngineConfig
    from tickloom.tools.serve.server import ServeOptions

NAME = "serve"
HELP = "serve the engine over HTTP with an OpenAI-compatible API"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tickloom.tools.model_options import add_engine_arguments
    from tickloom.tools.serve.app import DEFAULT_MAX_ANSWER_ENTRIES
    from tickloom.tools.serve.guard import API_KEY_ENV, DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
    from tickloom.tools.serve.sse import DEFAULT_MAX_PENDING_BYTES

    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the name clients pass as `model` (default: --model)")
    logs = parser.add_mutually_exclusive_group()
    logs.add_argument("--log", metavar="PATH", default=None,
                      help="write the engine's log here (default: a fresh tickloom-serve-<time>-<pid>.tlog)")
    logs.add_argument("--no-log", action="store_true", help="write no log")
    parser.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                        help="deadline of a request that gives no `timeout` (default: none)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM, wait this long for running requests (default 30; inf waits for all)")
    parser.add_argument("--no-access-log", action="store_true", help="write no line per HTTP request to stderr")
    parser.add_argument("--stats-interval", type=float, default=10.0, metavar="SECONDS",
                        help="seconds between stats lines on stderr: throughput, running, waiting, KV usage "
                             "(default 10; 0: none)")
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="no progress lines on stderr (model loading and conversion), as in generate and chat; "
                             "the access and stats lines have their own switches")
    add_engine_arguments(parser)
    edge = parser.add_argument_group("limits and access", "what one client may cost the server, and who may use it")
    edge.add_argument("--api-key", action="append", default=[], metavar="KEY",
                      help="require `Authorization: Bearer KEY` on every route but /health; repeat for several keys "
                           f"(also ${API_KEY_ENV}, comma-separated)")
    edge.add_argument("--metrics-open", action="store_true",
                      help="serve /metrics without an API key (default: it needs one when keys are set)")
    edge.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGIN",
                      help="answer browsers' CORS requests from this origin (e.g. http://localhost:3000; * for any); "
                           "repeat for several (default: none)")
    edge.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                      help=f"a larger request body gets 413 (default {DEFAULT_MAX_BODY_BYTES})")
    edge.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="SECONDS",
                      help=f"a request body must arrive within this (default {DEFAULT_BODY_TIMEOUT_S:g}); else 408")
    edge.add_argument("--max-stream-buffer-bytes", type=int, default=DEFAULT_MAX_PENDING_BYTES, metavar="BYTES",
                      help="a stream whose client leaves more events than this unread is ended with an error "
                           f"(default {DEFAULT_MAX_PENDING_BYTES})")
    edge.add_argument("--max-answer-entries", type=int, default=DEFAULT_MAX_ANSWER_ENTRIES, metavar="N",
                      help="a whole (not streamed) answer may hold at most choices x tokens x (1 + logprobs) "
                           f"entries (default {DEFAULT_MAX_ANSWER_ENTRIES}); more gets 400")
    fleet = parser.add_argument_group("fleet", "serve N engine replicas on Ray (pip install 'tickloom[fleet]')")
    fleet.add_argument("--replicas", type=int, default=1, metavar="N",
                       help="engine replicas; more than 1 serves a fleet behind the logged router (default 1: one "
                            "engine in this process)")
    fleet.add_argument("--fleet-dir", default=None, metavar="DIR",
                       help="the fleet's directory to create (router.log, replica-<i>/); giving it serves a fleet "
                            "even of 1 (default: a fresh tickloom-serve-<time>-<pid>/)")
    fleet.add_argument("--policy", default=None, choices=["affinity", "round-robin", "least-loaded"],
                       help="routing policy (default affinity)")
    fleet.add_argument("--address", default=None, help="a Ray cluster's address (default: start Ray locally)")
    fleet.add_argument("--replica-cpus", type=float, default=None, help="Ray CPUs reserved per replica (default 1)")


def run(args: argparse.Namespace) -> int:
    from tickloom import ConfigError, EngineError
    from tickloom.tools.cli import EX_DATAERR, EX_SOFTWARE, CliError
    from tickloom.tools.serve.server import ServeOptions, default_log_path
    from tickloom.tools.serve.server import run as serve_run

    if args.replicas < 1:
        raise CliError("--replicas must be at least 1")
    fleet = args.replicas > 1 or args.fleet_dir is not None
    if not fleet:
        flags = [flag for flag, value in (("--policy", args.policy), ("--address", args.address),
                                          ("--replica-cpus", args.replica_cpus)) if value is not None]
        if flags:
            raise CliError(f"{flags[0]} is for a fleet: give --replicas N (N > 1) or --fleet-dir")
    elif args.log is not None or args.no_log:
        raise CliError(f"{'--log' if args.log is not None else '--no-log'}: a fleet writes its logs in --fleet-dir")

    if not 0 <= args.port <= 65535:
        raise CliError("--port must be in [0, 65535]")
    if args.request_timeout is not None and not 0 < args.request_timeout < math.inf:
        raise CliError("--request-timeout must be a positive number of seconds")
    if not args.drain_timeout >= 0:
        raise CliError("--drain-timeout must be at least 0")
    for flag, value in (("--max-body-bytes", args.max_body_bytes),
                        ("--max-stream-buffer-bytes", args.max_stream_buffer_bytes),
                        ("--max-answer-entries", args.max_answer_entries)):
        if value < 1:
            raise CliError(f"{flag} must be at least 1")
    if not 0 < args.body_timeout < math.inf:
        raise CliError("--body-timeout must be a positive number of seconds")
    if not 0 <= args.stats_interval < math.inf:
        raise CliError("--stats-interval must be a number of seconds, at least 0")
    from tickloom.tools.model_options import engine_config

    config = engine_config(args, log_path=None if args.no_log or fleet else (args.log or default_log_path()))
    from tickloom.tools.serve.guard import api_keys

    options = ServeOptions(host=args.host, port=args.port, model_name=args.served_model_name,
                           request_timeout=args.request_timeout, drain_timeout=args.drain_timeout,
                           handle_signals=True, api_keys=api_keys(args.api_key), metrics_open=args.metrics_open,
                           max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                           max_stream_buffer_bytes=args.max_stream_buffer_bytes,
                           max_answer_entries=args.max_answer_entries,
                           allowed_origins=tuple(args.allowed_origins), access_log=not args.no_access_log,
                           stats_interval=args.stats_interval)
    from tickloom.engine.model.errors import ModelLoadError

    try:
        if fleet:
            _serve_fleet(args, config, options)
        else:
            serve_run(config, options)
    except ModelLoadError as exc:
        raise CliError(f"cannot load model {args.model!r}: {exc}", EX_DATAERR) from None
    except EngineError as exc:  # e.g. the log's disk is full: every open request was told, and the log replays
        raise CliError(f"the engine failed: {exc}", EX_SOFTWARE) from None
    except ConfigError as exc:  # e.g. --log names a path that exists: logs are never overwritten
        raise CliError(str(exc)) from None
    except OSError as exc:  # the address is taken, or not ours to bind
        raise CliError(f"cannot listen on {args.host}:{args.port}: {exc}") from None
    return 0


def _serve_fleet(args: argparse.Namespace, config: EngineConfig, options: ServeOptions) -> None:
    """Serve a fleet: Ray started locally for the run (or joined at ``--address``), stopped after it."""
    from tickloom import ConfigError
    from tickloom.fleet.front import FleetConfig, FleetError
    from tickloom.tools.cli import CliError
    from tickloom.tools.commands.fleet import ray_for_command
    from tickloom.tools.serve.server import default_log_path
    from tickloom.tools.serve.server import run as serve_run

    fields = {"policy": args.policy, "replica_cpus": args.replica_cpus}
    try:
        fleet_config = FleetConfig(replicas=args.replicas, fleet_dir=args.fleet_dir or default_log_path(suffix=""),
                                   **{name: value for name, value in fields.items() if value is not None})
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    with ray_for_command(args.address, fleet_config):
        try:
            serve_run(config, options, fleet_config)
        except FleetError as exc:  # e.g. a replica did not start
            raise CliError(str(exc)) from None
