"""``tickloom serve``: an OpenAI-compatible HTTP server (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, ``/metrics``) over one embedded engine.

Every run writes a log (``--log PATH``, by default a fresh ``tickloom-serve-<time>-<pid>.tlog`` in the current
directory; ``--no-log`` for none) that ``tickloom replay`` checks. SIGTERM or Ctrl-C drains (running requests
finish, new ones get 503), then exits; a second signal stops at once.
"""

from __future__ import annotations

import argparse
import math

NAME = "serve"
HELP = "serve the engine over HTTP with an OpenAI-compatible API"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tickloom.tools.model_options import DEFAULT_MODEL

    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a model name (see `tickloom models`), a checkpoint directory, a .gguf file, or "
                             f"'stub' (default {DEFAULT_MODEL})")
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
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", default=None, help="model dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--quant", default=None, choices=["none", "int8", "int4"],
                        help="weight-only quantization on CPU, as for `tickloom generate` (default: the model's)")
    parser.add_argument("--max-seq-len", type=int, default=2048, help="prompt + output tokens at most (default 2048)")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="sequences per step at most (default: EngineConfig's)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from the KV memory)")
    parser.add_argument("--max-waiting", type=int, default=None,
                        help="requests open at once at most, running or waiting (default: EngineConfig's)")
    parser.add_argument("--overload", choices=["wait", "reject"], default="wait",
                        help="past --max-waiting: hold new requests (wait) or answer 503 (reject); default wait")
    parser.add_argument("--stub-step-time", type=float, default=None, metavar="SECONDS",
                        help="with --model stub: seconds per model step (default: the engine's, 0.01)")


def run(args: argparse.Namespace) -> int:
    from tickloom.engine import ConfigError, EngineConfig
    from tickloom.tools.cli import EX_DATAERR, CliError
    from tickloom.tools.serve.server import ServeOptions, default_log_path
    from tickloom.tools.serve.server import run as serve_run

    if not 0 <= args.port <= 65535:
        raise CliError("--port must be in [0, 65535]")
    if args.request_timeout is not None and not 0 < args.request_timeout < math.inf:
        raise CliError("--request-timeout must be a positive number of seconds")
    if not args.drain_timeout >= 0:
        raise CliError("--drain-timeout must be at least 0")
    if args.stub_step_time is not None and args.model != "stub":
        raise CliError("--stub-step-time needs --model stub")
    from tickloom.tools.model_options import check_model_options

    check_model_options(args.model, args.device, args.dtype)
    log_path = None if args.no_log else (args.log or default_log_path())
    given = {"stub_step_time": args.stub_step_time, "max_batch_size": args.max_batch_size,
             "max_waiting": args.max_waiting}
    extra = {name: value for name, value in given.items() if value is not None}
    try:
        config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, log_path=log_path,
                              max_seq_len=args.max_seq_len, num_blocks=args.num_blocks, overload=args.overload,
                              quant=args.quant, **extra)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    options = ServeOptions(host=args.host, port=args.port, model_name=args.served_model_name,
                           request_timeout=args.request_timeout, drain_timeout=args.drain_timeout,
                           handle_signals=True)
    from tickloom.engine.model import ModelLoadError

    try:
        serve_run(config, options)
    except ModelLoadError as exc:
        raise CliError(f"cannot load model {args.model!r}: {exc}", EX_DATAERR) from None
    except ConfigError as exc:  # e.g. --log names a path that exists: logs are never overwritten
        raise CliError(str(exc)) from None
    except OSError as exc:  # the address is taken, or not ours to bind
        raise CliError(f"cannot listen on {args.host}:{args.port}: {exc}") from None
    return 0
