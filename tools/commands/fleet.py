"""``tickloom fleet --replicas N --dir DIR PROMPT...``: run prompts on a fleet of engine replicas on Ray.

A local Ray instance is started for the run (``--address`` joins a running cluster instead). The router log and
each replica's logs go to ``DIR``; ``tickloom replay DIR`` verifies them all. Each output line is the prompt's
label, the replica that served it and its text. ``--repeat K`` sends every prompt K times (shared prefixes: watch
the affinity router keep them together). Exit status 1 if any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tickloom.fleet.front import FleetConfig

from tickloom.tools.cli import plural
from tickloom.tools.model_options import add_model_arguments, engine_config, sampling

NAME = "fleet"
HELP = "run prompts on N engine replicas on Ray behind the logged router; logs in --dir"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompts to complete, each one request")
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    parser.add_argument("--dir", required=True, help="the fleet directory to create (router.log, replica-<i>/)")
    parser.add_argument("--policy", default="affinity", choices=["affinity", "round-robin", "least-loaded"],
                        help="routing policy (default affinity: the replica holding the prompt's prefix, then load)")
    parser.add_argument("--repeat", type=int, default=1, metavar="K", help="send each prompt K times (default 1)")
    parser.add_argument("--concurrency", type=int, default=64, metavar="C", help="requests in flight at most")
    parser.add_argument("--address", default=None, help="a Ray cluster's address (default: start Ray locally)")
    parser.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs reserved per replica")
    parser.add_argument("--json", action="store_true", help="one JSON line per request, then a summary line")
    add_model_arguments(parser, chat_flag=False, log=False)  # a fleet writes its logs in --dir


def run(args: argparse.Namespace) -> int:
    from tickloom.tools.cli import CliError

    if args.replicas < 1 or args.repeat < 1 or args.concurrency < 1:
        raise CliError("--replicas, --repeat and --concurrency must be at least 1")
    config = engine_config(args)
    params = sampling(args)
    from tickloom import ConfigError
    from tickloom.fleet.front import FleetConfig

    try:
        fleet_config = FleetConfig(replicas=args.replicas, fleet_dir=args.dir, policy=args.policy,
                                   replica_cpus=args.replica_cpus)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    with ray_for_command(args.address, fleet_config):
        return asyncio.run(_serve(args, config, fleet_config, params))


@contextlib.contextmanager
def ray_for_command(address: str | None, fleet_config: FleetConfig) -> Iterator[None]:
    """Ray for one command's fleet: used as it is if already initialised; else joined at ``address``, or started
    locally, and shut down afterwards. ``CliError`` naming the extra to install if Ray is missing."""
    from tickloom.tools.cli import CliError

    try:
        import ray
    except ImportError:
        raise CliError("a fleet needs Ray, which is not installed: pip install 'tickloom[fleet]'") from None
    if ray.is_initialized():
        yield
        return
    # Ray's CPUs are scheduling tokens: locally, enough for every replica whatever the machine's cores
    cpus = max(os.cpu_count() or 1, math.ceil(fleet_config.replicas * fleet_config.replica_cpus))
    ray.init(address=address, num_cpus=None if address else cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


async def _serve(args: argparse.Namespace, config: object, fleet_config: object, params: object) -> int:
    from tickloom.fleet.front import Fleet, FleetError, FleetStream

    jobs = [(i, prompt) for prompt in args.prompts for i in range(args.repeat)]
    failures = 0
    tokens = 0
    start = time.perf_counter()
    async with Fleet.open(config, fleet_config) as fleet:  # type: ignore[arg-type]
        gate = asyncio.Semaphore(args.concurrency)

        async def one(n: int, prompt: str) -> None:
            nonlocal failures, tokens
            async with gate:
                stream: FleetStream = fleet.generate(prompt, params)  # type: ignore[arg-type]
                text, reason, error = [], None, None
                try:
                    async for out in stream:
                        text.append(out.text_delta)
                        tokens += len(out.token_ids)
                        reason = out.finish_reason if out.finished else reason
                except FleetError as exc:
                    failures += 1
                    error = str(exc)
                if args.json:
                    print(json.dumps({"request_id": stream.request_id, "replica": stream.replica, "text": "".join(text),
                                      "finish_reason": reason, "error": error}), flush=True)
                else:
                    ending = f"[error: {error}]" if error else f"[{reason}]"
                    print(f"[{n + 1}] {stream.request_id} on replica {stream.replica}: "
                          f"{''.join(text)!r} {ending}", flush=True)

        await asyncio.gather(*(one(n, prompt) for n, (_, prompt) in enumerate(jobs)))
        stats = fleet.stats()
    seconds = time.perf_counter() - start
    summary = {"requests": len(jobs), "failed": failures, "tokens": tokens, "seconds": seconds,
               "tokens_per_s": tokens / seconds if seconds else 0.0, "replicas": args.replicas,
               "deaths": stats["deaths"], "dir": args.dir}
    if args.json:
        print(json.dumps({"summary": summary}))
    else:
        print(f"{plural(len(jobs), 'request')} ({failures} failed), {plural(tokens, 'token')} in {seconds:.2f} s "
              f"({summary['tokens_per_s']:.0f} tokens/s) on {plural(args.replicas, 'replica')}; logs in {args.dir} "
              f"(tickloom replay {args.dir})")
    return 1 if failures else 0
