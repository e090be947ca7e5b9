"""``tickloom bench fleet``: tokens/s of 1 and of 3 replicas of the tiny model on Ray, side by side in one run, and
the router's own cost per request.

Each fleet (``tiny-bench`` random weights by default, float32, one torch thread per replica; ``--model stub`` for
the core's oracle) gets the same requests: ``--requests`` (48) completions of ``--max-tokens`` (32) tokens,
``ignore_eos``, prompts of 8 families sharing a 64-token prefix, all submitted at once after a warm-up. Tokens/s is
completion tokens over the wall time from the first submit to the last finish, on the front end's clock; TTFT is
measured by the client. Both fleet directories must replay ``identical`` afterwards.

The router's cost is measured apart from Ray (a microbenchmark of the pure ``Router``): per request, one tick with
its arrival (prompt hashing included), a load report and a finish, with 3 and with 16 replicas; and the same through
``LoggedRouter`` with its log written (frame encoding and ``write(2)`` included).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tickloom.tools.cli import plural
from tickloom.tools.progress import progress_note

HELP = "tokens/s of 1 vs 3 replicas of the tiny model on Ray, and the router's cost per request"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-bench", choices=["tiny-bench", "stub"],
                        help="tiny-bench (default: random weights, written to a temporary directory) or stub")
    parser.add_argument("--requests", type=int, default=48, help="requests per fleet (default 48)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--replicas", default="1,3", help="the fleet sizes to compare (default 1,3)")
    parser.add_argument("--router-requests", type=int, default=20000,
                        help="requests through the pure router (default 20000)")


def _prompts(n: int) -> list[list[int]]:
    return [[3 + (i % 8)] * 64 + [10 + (i * 7 + j) % 200 for j in range(8)] for i in range(n)]


async def _fleet_run(model: str, replicas: int, fleet_dir: Path, requests: int, max_tokens: int) -> dict[str, Any]:
    from tickloom import EngineConfig, SamplingParams
    from tickloom.fleet.front import Fleet, FleetConfig

    engine = (EngineConfig(model="stub", stub_step_time=0.005) if model == "stub"
              else EngineConfig(model=model, threads=1, dtype="float32", quant="none", num_blocks=1024))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    async with Fleet.open(engine, FleetConfig(replicas=replicas, fleet_dir=str(fleet_dir))) as fleet:
        await asyncio.gather(*(fleet.complete([1 + i] * 20, SamplingParams(max_tokens=4)) for i in range(replicas)))
        ttfts: list[float] = []
        tokens = 0
        start = time.perf_counter()

        async def one(prompt: list[int]) -> None:
            nonlocal tokens
            submitted = time.perf_counter()
            first = True
            async for out in fleet.generate(prompt, params):
                if first and out.token_ids:
                    ttfts.append(time.perf_counter() - submitted)
                    first = False
                tokens += len(out.token_ids)

        await asyncio.gather(*(one(p) for p in _prompts(requests)))
        seconds = time.perf_counter() - start
    return {"replicas": replicas, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ttft_p50_ms": 1e3 * statistics.median(ttfts), "ttft_p90_ms": 1e3 * sorted(ttfts)[int(0.9 * len(ttfts))]}


def router_cost(replicas: int, requests: int, log_dir: Path | None) -> float:
    """Microseconds per request through the router (and its log, when ``log_dir`` is given)."""
    from tickloom.fleet.logged_router import LoggedRouter
    from tickloom.fleet.router_events import LoadReport, RouterConfig

    prompts = [[3 + (i % 64)] * 256 + [10 + i % 200] * 8 for i in range(256)]
    clock = iter(range(0, 1 << 62, 1000))
    path = None if log_dir is None else log_dir / f"router-{replicas}.log"
    router = LoggedRouter(RouterConfig(replicas=replicas), path, lambda: next(clock))
    start = time.perf_counter()
    for i in range(requests):
        rid = f"r{i}"
        router.report(LoadReport(i % replicas, i % 7, i % 5, 1000))
        router.route(router.arrival(rid, prompts[i % len(prompts)]))
        router.finished(rid)
    seconds = time.perf_counter() - start
    router.close()
    return 1e6 * seconds / requests


def run(args: argparse.Namespace) -> int:
    import json

    import ray

    from tickloom.fleet.router_replay import verify_fleet

    sizes = [int(n) for n in args.replicas.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny-bench":
            from tickloom.engine.model.tiny import write_tiny_model

            model = str(write_tiny_model(Path(tmp) / "tiny-bench", "tiny-bench", seed=0))
        started = not ray.is_initialized()
        if started:
            ray.init(num_cpus=max(os.cpu_count() or 1, max(sizes)), include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        try:
            for n in sizes:
                progress_note(f"{plural(n, 'replica')}")
                row = asyncio.run(_fleet_run(model, n, Path(tmp) / f"fleet-{n}", args.requests, args.max_tokens))
                row["replay"] = verify_fleet(Path(tmp) / f"fleet-{n}").status
                rows.append({"bench": "fleet", "model": args.model, **row})
        finally:
            if started:
                ray.shutdown()
        router_rows = [{"bench": "router", "replicas": r, "logged": logged,
                        "us_per_request": router_cost(r, args.router_requests, Path(tmp) if logged else None)}
                       for r in (3, 16) for logged in (False, True)]
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / base
    if args.json:
        for row in rows + router_rows:
            print(json.dumps(row))
        return 0
    print(f"fleet of {args.model}, {args.requests} requests x {args.max_tokens} tokens, {os.cpu_count()} CPUs here")
    print(f"{'replicas':>8} {'tokens/s':>10} {'speedup':>8} {'TTFT p50':>10} {'TTFT p90':>10} {'replay':>10}")
    for row in rows:
        print(f"{row['replicas']:>8} {row['tokens_per_s']:>10.1f} {row['speedup']:>7.2f}x "
              f"{row['ttft_p50_ms']:>8.1f}ms {row['ttft_p90_ms']:>8.1f}ms {row['replay']:>10}")
    print("router, per request (an arrival with 16 blocks hashed, a load report, a finish):")
    for row in router_rows:
        what = "with its log written" if row["logged"] else "pure"
        print(f"  {row['replicas']:>2} replicas, {what}: {row['us_per_request']:.1f} µs")
    return 0 if all(r["replay"] == "identical" for r in rows) else 1
