"""``tickloom bench replay``: exact-replay throughput next to the core's own, on the same ticks.

A log of ``--batch`` requests decoding ``--tokens`` tokens each is recorded with the oracle as the device. Then,
best of ``--repeat`` interleaved rounds:

- replay: ``replay.verify`` of the whole file (read, CRC checks, decode, ``core.tick``, digest compare);
- core: ``core.tick`` alone on the same, already decoded ``TickInputs`` with a fresh core.

The ratio is core time / replay time (goal >= 0.7x). The second figure runs the live engine on the ``tiny-bench``
model (random weights, written to a temporary directory) with ``--live-batch`` greedy requests of
``--live-tokens`` tokens each, logging, and compares its wall time (from the first submit to the last finish,
model load excluded) with the exact replay of that log (goal: replay >= 50x faster than live). ``--no-live``
skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tickloom.replay.record import Scenario

HELP = "exact replay throughput against the core's own tick rate on the same inputs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64, help="requests decoding together (default 64)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens each request decodes (default 512)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the best is kept (default 5)")
    parser.add_argument("--snapshot-every", type=int, default=0, help="snapshot frames every N ticks (default 0)")
    parser.add_argument("--dir", default=None, help="directory for the log file (default: a temporary one)")
    parser.add_argument("--live-batch", type=int, default=32, help="requests in the live run (default 32)")
    parser.add_argument("--live-tokens", type=int, default=32, help="tokens per live request (default 32)")
    parser.add_argument("--no-live", action="store_true", help="skip the live engine run")


def _live_run(tmp: str, batch: int, tokens: int, repeat: int) -> dict[str, object]:
    """Live wall time of the engine on tiny-bench versus the exact replay of its log."""
    import trio

    from tickloom import Engine, EngineConfig, SamplingParams
    from tickloom.engine.model.tiny import write_tiny_model
    from tickloom.replay import verify

    model = write_tiny_model(os.path.join(tmp, "tiny-bench"), "tiny-bench")
    log = os.path.join(tmp, "live.tlog")
    config = EngineConfig(model=str(model), log_path=log, max_batch_size=batch, max_seq_len=512, threads=1)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)

    async def main() -> float:
        async with Engine.open(config) as engine:
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(batch):
                    prompt = [(97 * i + 13 * j) % 31000 + 100 for j in range(16 + i % 48)]
                    nursery.start_soon(engine.complete, prompt, params)
            return time.perf_counter() - start

    live = trio.run(main)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        report = verify(log)
        best = min(best, time.perf_counter() - t0)
        if report.status != "identical":
            raise RuntimeError(f"the live log did not replay identically: {report.format_text()}")
    return {"live_s": live, "replay_s": best, "ratio": live / best, "goal": 50.0, "ticks": report.ticks,
            "note": f"live {live:.2f} s, replay {best * 1000:.1f} ms: replay {live / best:.0f}x faster (goal >= 50x)"}


def run(args: argparse.Namespace) -> int:
    from tickloom.engine.core import SchedulerCore
    from tickloom.events import LogReader
    from tickloom.replay import verify
    from tickloom.tools.cli import CliError

    if min(args.batch, args.tokens, args.repeat) < 1 or args.snapshot_every < 0:
        raise CliError("--batch, --tokens and --repeat must be at least 1; --snapshot-every at least 0")
    scenario = steady_scenario(args.batch, args.tokens)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tickloom-bench-") as tmp:
        path = os.path.join(tmp, "tickloom.replay.tlog")
        recorded = scenario.record(path, snapshot_every=args.snapshot_every, keep=False)
        with LogReader(path) as reader:
            inputs = [r.inputs for r in reader.ticks()]
        size = os.path.getsize(path)
        best_replay = best_core = float("inf")
        report = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            report = verify(path)
            best_replay = min(best_replay, time.perf_counter() - t0)
            core = SchedulerCore(scenario.config)
            tick = core.tick
            t0 = time.perf_counter()
            for item in inputs:
                tick(item)
            best_core = min(best_core, time.perf_counter() - t0)
        assert report is not None
        if report.status != "identical":
            raise CliError(f"the recorded log did not replay identically: {report.format_text()}", status=1)
    ticks, rows = recorded.ticks, recorded.rows
    assert rows == report.rows and ticks == report.ticks, (rows, report.rows)
    results: list[dict[str, object]] = [
        {"bench": "replay", "figure": "exact_replay", "batch": args.batch, "ticks": ticks, "rows": rows,
         "log_bytes": size, "ticks_per_s": ticks / best_replay, "rows_per_s": rows / best_replay,
         "core_ticks_per_s": ticks / best_core, "core_rows_per_s": rows / best_core,
         "ratio": best_core / best_replay, "goal": 0.7, "repeat": args.repeat},
    ]
    live: dict[str, object] = {"bench": "replay", "figure": "replay_vs_live", "model": "tiny-bench",
                               "batch": args.live_batch, "tokens": args.live_tokens}
    if args.no_live:
        live.update(ratio=None, note="n/a (--no-live)")
    else:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="tickloom-bench-") as tmp:
            live.update(_live_run(tmp, args.live_batch, args.live_tokens, args.repeat))
    results.append(live)
    if args.json:
        for r in results:
            print(json.dumps(r))
        return 0
    r = results[0]
    print(f"tickloom bench replay: {ticks} ticks at batch {args.batch} ({rows} rows, {size} bytes), "
          f"best of {args.repeat}")
    print(f"  exact replay   {r['ticks_per_s']:10.0f} ticks/s {r['rows_per_s']:12.0f} rows/s")
    print(f"  core.tick only {r['core_ticks_per_s']:10.0f} ticks/s {r['core_rows_per_s']:12.0f} rows/s")
    print(f"  ratio (replay rows/s / core rows/s) {r['ratio']:.2f}x (goal >= 0.7x)")
    print(f"  live engine vs replay, tiny-bench at batch {args.live_batch}: {live['note']}")
    return 0


def steady_scenario(batch: int, decode_tokens: int, prompt_len: int = 32) -> Scenario:
    """``batch`` requests arriving at once and decoding ``decode_tokens`` tokens each: a steady decode batch."""
    from tickloom.engine.core import CoreConfig
    from tickloom.engine.core.blocks import blocks_holding
    from tickloom.events import Input
    from tickloom.replay.record import Scenario, arrival

    per_seq = blocks_holding(prompt_len + decode_tokens + 2, 16)
    config = CoreConfig(
        num_blocks=batch * per_seq + 64, block_size=16, max_batch_size=batch, max_seq_len=16 * per_seq,
        max_prefill_tokens=max(512, prompt_len * batch), max_batch_tokens=max(4096, prompt_len * batch + batch),
        vocab_size=32000, pipeline_depth=1, max_waiting=max(4096, batch),
    )
    script: dict[int, list[Input]] = {0: [arrival(f"s{i:04d}", prompt_len, decode_tokens) for i in range(batch)]}
    return Scenario(config=config, script=script)
