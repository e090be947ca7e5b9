"""``tickloom bench structured``: JSON-schema outputs against unconstrained ones, side by side in one run.

The default model, greedy, on chat prompts that ask for a JSON object of one of ``SCHEMAS``' shapes:

- **constrained**: each request with its schema (``StructuredOutputs(json=...)``), ``max_tokens`` 160; each output's
  length is recorded.
- **unconstrained**: the same prompts, each with ``max_tokens`` equal to its constrained twin's output length and
  ``ignore_eos``, so both sides produce exactly the same number of tokens.

At batch 1 (requests one after another) and at ``--batch`` (all at once, ``max_batch_size`` = the batch), each side
runs ``--repeat`` times, alternating; the fastest run counts. Output tokens per second is the tokens over the wall
time of the whole run. Also: the share of output tokens that came as extras (forced by the constraint, accepted
without a forward pass of their own; read from the run's log), the mask time per token (``Constraints.start_masks``
through ``wait`` for one row, along each output's tokens: p50 and p99), and the compile time per schema, cold (a
fresh grammar engine) and cached.

Goals: constrained ≥ 1.0x unconstrained at batch 1 (jump-forward pays for the masks), ≥ 0.9x at the batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tickloom.tools.bench.jobs import run_jobs
from tickloom.tools.progress import progress_note

HELP = "JSON-schema constrained outputs against unconstrained ones (batch 1 and 32), masks, extras, compile time"

GOAL_BATCH1 = 1.0
GOAL_BATCHED = 0.9

_STR = {"type": "string", "maxLength": 24}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", {"type": "object", "properties": {"name": _STR, "age": {"type": "integer", "minimum": 0,
                                                                           "maximum": 120}, "city": _STR},
                  "required": ["name", "age", "city"], "additionalProperties": False}),
    ("a book", {"type": "object", "properties": {"title": _STR, "author": _STR, "year": {"type": "integer"},
                                                "genres": {"type": "array", "items": _STR, "maxItems": 3}},
                "required": ["title", "author", "year", "genres"], "additionalProperties": False}),
    ("a product", {"type": "object", "properties": {"name": _STR, "price": {"type": "number", "minimum": 0},
                                                   "in_stock": {"type": "boolean"},
                                                   "category": {"enum": ["food", "tools", "toys", "books"]}},
                   "required": ["name", "price", "in_stock", "category"], "additionalProperties": False}),
    ("a weather report", {"type": "object", "properties": {
        "location": _STR, "temperature_celsius": {"type": "integer", "minimum": -60, "maximum": 60},
        "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}, "wind_kph": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 300}},
        "required": ["location", "temperature_celsius", "conditions", "wind_kph"], "additionalProperties": False}),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=32, help="the batched case's batch size (default 32)")
    parser.add_argument("--requests", type=int, default=4, help="requests in the batch-1 case (default 4)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per side, alternating; the fastest counts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def _prompts(count: int) -> list[tuple[list[dict[str, str]], dict[str, Any]]]:
    jobs = []
    for i in range(count):
        what, schema = SCHEMAS[i % len(SCHEMAS)]
        ask = f"Invent {what} (number {i + 1}) and describe it as a JSON object."
        jobs.append(([{"role": "user", "content": ask}], schema))
    return jobs


async def _case(batch: int, count: int, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from tickloom import Engine, EngineConfig, SamplingParams, StructuredOutputs
    from tickloom.events import LogReader, StepDone

    prompts = _prompts(count)
    log = log_dir / f"structured-b{batch}.tlog"
    config = EngineConfig(max_batch_size=max(batch, 1), threads=args.threads, log_path=str(log))
    constrained = [(p, SamplingParams(temperature=0.0, max_tokens=160, structured=StructuredOutputs(json=s)))
                   for p, s in prompts]
    async with Engine.open(config) as engine:
        _, warm = await run_jobs(engine, constrained[:1], False)  # warm-up: compile, first steps
        best_c = best_u = float("inf")
        lengths: list[int] = []
        runs: list[tuple[str, float]] = []
        for _ in range(args.repeat):
            seconds, outs = await run_jobs(engine, constrained, batch > 1)
            best_c = min(best_c, seconds)
            runs.append(("constrained", seconds))
            lengths = [len(o) for o in outs]
            free = [(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                    for (p, _), n in zip(prompts, lengths, strict=True)]
            seconds, _ = await run_jobs(engine, free, batch > 1)
            best_u = min(best_u, seconds)
            runs.append(("unconstrained", seconds))
        texts = outs
    with LogReader(log) as reader:
        done = [i for r in reader.ticks() for i in r.inputs.inputs if isinstance(i, StepDone)]
    extras = sum(len(row) for d in done if d.extra_token_ids for row in d.extra_token_ids)
    constrained_tokens = len(warm[0]) + sum(lengths) * args.repeat  # every constrained token the log holds
    tokens = sum(lengths)
    return {
        "batch": batch, "requests": count, "tokens": tokens,
        "constrained_tok_s": tokens / best_c, "unconstrained_tok_s": tokens / best_u, "ratio": best_u / best_c,
        "extras_share": extras / max(constrained_tokens, 1),
        "runs_s": [round(s, 3) for _, s in runs], "outputs": texts,
    }


def _masks_and_compile(outputs: list[list[int]]) -> dict[str, Any]:
    """Mask time per token along the outputs' tokens, and compile time per schema (cold and cached)."""
    from tickloom.engine.model.loaders import load_model
    from tickloom.engine.model.structured import Constraints
    from tickloom.params import StructuredOutputs

    loaded = load_model("smollm2-135m")
    cfg = loaded.config
    specs = [StructuredOutputs(json=s).to_wire() for _, s in SCHEMAS]
    cold: list[float] = []
    cached: list[float] = []
    for spec in specs:
        fresh = Constraints(loaded.tokenizer, cfg.vocab_size, tuple(cfg.eos_token_ids))
        start = time.perf_counter()
        fresh.check(spec)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        fresh.check(spec)
        cached.append(time.perf_counter() - start)
        fresh.close()
    constraints = Constraints(loaded.tokenizer, cfg.vocab_size, tuple(cfg.eos_token_ids))
    per_token: list[float] = []
    for i, tokens in enumerate(outputs):
        rid = f"m{i}"
        constraints.bind(rid, specs[i % len(specs)])
        for k in range(len(tokens)):
            start = time.perf_counter()
            constraints.start_masks([(rid, tokens[:k])]).wait()
            per_token.append(time.perf_counter() - start)
        constraints.release(rid)
    constraints.close()
    per_token.sort()
    return {
        "mask_ms_p50": 1e3 * statistics.median(per_token),
        "mask_ms_p99": 1e3 * per_token[min(len(per_token) - 1, int(0.99 * len(per_token)))],
        "compile_ms_cold_p50": 1e3 * statistics.median(cold), "compile_ms_cold_max": 1e3 * max(cold),
        "compile_ms_cached_p50": 1e3 * statistics.median(cached),
    }


def run(args: argparse.Namespace) -> int:
    import trio

    with tempfile.TemporaryDirectory(prefix="tickloom-bench-structured-") as tmp:
        progress_note("batch 1 ...")
        one = trio.run(_case, 1, args.requests, args, Path(tmp))
        progress_note(f"batch {args.batch} ...")
        many = trio.run(_case, args.batch, args.batch, args, Path(tmp))
    progress_note("masks and compile times ...")
    extra = _masks_and_compile(one["outputs"] + many["outputs"])
    rows = [one, many]
    for row in rows:
        row.pop("outputs")
    if args.json:
        for row in rows:
            print(json.dumps({"case": f"batch {row['batch']}", **row}))
        print(json.dumps({"case": "masks and compile", **extra}))
    else:
        print("structured outputs (default model, greedy, JSON schema vs the same token counts unconstrained)")
        print(f"{'batch':>5} {'tokens':>6} {'constrained tok/s':>18} {'unconstrained tok/s':>20} {'ratio':>6} "
              f"{'goal':>5} {'extras share':>12}")
        for row, goal in ((one, GOAL_BATCH1), (many, GOAL_BATCHED)):
            print(f"{row['batch']:>5} {row['tokens']:>6} {row['constrained_tok_s']:>18.1f} "
                  f"{row['unconstrained_tok_s']:>20.1f} {row['ratio']:>5.2f}x {goal:>4.1f}x "
                  f"{row['extras_share']:>11.0%}")
        print(f"mask time per token: p50 {extra['mask_ms_p50']:.3f} ms, p99 {extra['mask_ms_p99']:.3f} ms; "
              f"compile per schema: cold p50 {extra['compile_ms_cold_p50']:.1f} ms (max "
              f"{extra['compile_ms_cold_max']:.1f}), cached p50 {extra['compile_ms_cached_p50']:.3f} ms")
    ok = one["ratio"] >= GOAL_BATCH1 and many["ratio"] >= GOAL_BATCHED
    return 0 if ok else 1
