"""``tickloom bench engine``: the whole engine, end to end, against transformers ``generate`` with static batching.

One run, one workload: ``--requests`` (64) requests with mixed prompt lengths (8–96 tokens) and output lengths
(8–``--max-tokens``), random token-id prompts, greedy, ``ignore_eos`` so every length is fixed. The model is
``tiny-bench`` (random weights, written to a temporary directory with ``write_tiny_model``), float32 on CPU, with
``--threads`` torch threads on both sides.

- **tickloom**: every request submitted at once to one engine (``max_batch_size`` = ``--batch``, the log on,
  ``fsync="never"``), each stream read to the end, with ``pipeline_depth`` 1 and 2 (``--repeat`` runs each,
  alternating; the fastest run of each depth counts, and every run's figure is listed). Tokens/s is
  completion tokens over the wall time from the first submit to the last finish (after a warm-up in the same
  engine). The log's share is the step actor's CPU time in the log path (``StepStats.log_ns``: encoding and
  writing frames) over the process's CPU time (``time.process_time``) in the same interval.
- **transformers**: the same requests in arrival order, in static batches of ``--batch``, left-padded, each batch
  run to its longest output (``min_new_tokens = max_new_tokens``). Only each request's own tokens count.

Goals: tickloom ≥ 1.5x transformers; depth 2 ≥ 0.95x depth 1; the log ≤ 3% of CPU time.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tickloom.tools.progress import progress_note

HELP = "the engine end to end (pipeline depth 1 and 2) against transformers generate with static batching"

GOAL_SPEEDUP = 1.5
GOAL_DEPTH2 = 0.95
GOAL_LOG_SHARE = 0.03
MIN_PROMPT, MAX_PROMPT = 8, 96
TOKENIZER_VOCAB = 259
"""The tiny models' byte-level tokenizer: 3 specials and 256 bytes. Prompt ids are drawn below it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=64, help="requests in the workload (default 64)")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="output lengths are drawn from 8..MAX_TOKENS (default 128)")
    parser.add_argument("--batch", type=int, default=16,
                        help="the engine's max_batch_size and transformers' static batch size (default 16)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2], choices=[1, 2],
                        help="pipeline depths to run (default 1 2)")
    parser.add_argument("--model", default="tiny-bench", choices=["tiny-bench", "tiny", "stub"],
                        help="tiny-bench (default); tiny: a much smaller random model (tests); stub: the core's "
                             "oracle, no torch model (no transformers baseline)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload (default 0)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="engine runs per depth, alternating depths; the fastest counts (default 2)")


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    outputs: list[int]


def make_workload(requests: int, max_tokens: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(MIN_PROMPT, MAX_PROMPT))] for _ in range(requests)]
    outputs = [rng.randint(min(8, max_tokens), max_tokens) for _ in range(requests)]
    return Workload(prompts, outputs)


def run_engine(model: str, work: Workload, depth: int, args: argparse.Namespace, log_path: Path) -> dict[str, Any]:
    """One engine run of the whole workload; the figures of the measured interval."""
    import trio

    from tickloom import Engine, EngineConfig, SamplingParams

    config = EngineConfig(model=model, dtype=None if model == "stub" else "float32", threads=args.threads,
                          max_batch_size=args.batch, pipeline_depth=depth, log_path=str(log_path), fsync="never",
                          stub_step_time=0.0, max_seq_len=MAX_PROMPT + args.max_tokens + 16)
    out: dict[str, Any] = {}

    async def main() -> None:
        async with Engine.open(config) as engine:
            warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(engine.complete, work.prompts[i][:MIN_PROMPT], warm)
            step = engine.runtime.step.stats
            log_ns0, ticks0, steps0, pre0 = step.log_ns, step.ticks, step.steps, step.preemptions
            log_bytes0 = step.log_bytes
            tokens = [0] * len(work.prompts)
            cpu0, wall0 = time.process_time(), time.perf_counter()

            async def one(i: int) -> None:
                params = SamplingParams(max_tokens=work.outputs[i], temperature=0, ignore_eos=True)
                async for frame in engine.generate(work.prompts[i], params, request_id=f"bench-{i}"):
                    tokens[i] += len(frame.token_ids)
                    if frame.finished and frame.finish_reason != "length":
                        raise RuntimeError(f"bench-{i} finished {frame.finish_reason}: {frame.error}")

            async with trio.open_nursery() as nursery:
                for i in range(len(work.prompts)):
                    nursery.start_soon(one, i)
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            if tokens != work.outputs:
                raise RuntimeError("the engine produced other lengths than requested")
            log_s = (step.log_ns - log_ns0) / 1e9
            out.update({
                "system": "tickloom", "pipeline_depth": depth, "requests": len(tokens), "tokens": sum(tokens),
                "seconds": wall, "tokens_per_s": sum(tokens) / wall, "cpu_s": cpu, "log_cpu_s": log_s,
                "log_share": log_s / cpu if cpu > 0 else 0.0, "ticks": step.ticks - ticks0,
                "steps": step.steps - steps0, "preemptions": step.preemptions - pre0,
                "log_bytes": step.log_bytes - log_bytes0,
            })

    trio.run(main)
    return out


def run_hf(model_dir: Path, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """transformers ``generate``: static batches of ``--batch`` in arrival order, left-padded, greedy."""
    import torch
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ref.train(False)
    pad = 0

    def batch_generate(prompts: list[list[int]], new_tokens: int) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            ref.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=pad)

    batch_generate([work.prompts[0][:MIN_PROMPT]] * 2, 4)  # warm-up
    computed = 0
    wall0 = time.perf_counter()
    for start in range(0, len(work.prompts), args.batch):
        prompts = work.prompts[start: start + args.batch]
        longest = max(work.outputs[start: start + args.batch])
        batch_generate(prompts, longest)
        computed += longest * len(prompts)
    wall = time.perf_counter() - wall0
    tokens = sum(work.outputs)
    return {"system": "transformers", "batch": args.batch, "requests": len(work.prompts), "tokens": tokens,
            "computed_tokens": computed, "seconds": wall, "tokens_per_s": tokens / wall}


def run(args: argparse.Namespace) -> int:
    from tickloom.tools.cli import CliError

    if min(args.requests, args.max_tokens, args.batch, args.threads, args.repeat) < 1:
        raise CliError("--requests, --max-tokens, --batch, --threads and --repeat must be at least 1")
    if args.max_tokens < 8:
        raise CliError("--max-tokens must be at least 8")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tickloom-bench-") as tmp:
        if args.model == "stub":
            model, model_dir, vocab = "stub", None, 95
        else:
            import torch

            from tickloom.engine.model.tiny import TinySpec, write_tiny_model

            torch.set_num_threads(args.threads)
            spec = "tiny-bench" if args.model == "tiny-bench" else TinySpec()
            model_dir = write_tiny_model(Path(tmp) / args.model, spec, seed=0)
            model, vocab = str(model_dir), TOKENIZER_VOCAB
        work = make_workload(args.requests, args.max_tokens, vocab, args.seed)
        runs: dict[int, list[dict[str, Any]]] = {depth: [] for depth in args.depths}
        for rep in range(args.repeat):  # depths alternate, so drift on a shared machine hits both alike
            for depth in args.depths:  # a new log per run: logs are never overwritten
                progress_note(f"tickloom, pipeline depth {depth}, run {rep + 1} of {args.repeat}")
                runs[depth].append(run_engine(model, work, depth, args, Path(tmp) / f"depth{depth}-{rep}.tlog"))
        for measured in runs.values():
            row = max(measured, key=lambda r: r["tokens_per_s"])
            row["runs_tokens_per_s"] = [r["tokens_per_s"] for r in measured]
            rows.append(row)
            _emit(args, row)
        if model_dir is not None and not args.no_hf:
            row = run_hf(model_dir, work, args)
            rows.append(row)
            _emit(args, row)
    _emit(args, summarise(rows, args))
    return 0


def summarise(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    by_depth = {r["pipeline_depth"]: r for r in rows if r["system"] == "tickloom"}
    hf = next((r for r in rows if r["system"] == "transformers"), None)
    best = max(by_depth.values(), key=lambda r: r["tokens_per_s"])
    summary: dict[str, Any] = {
        "system": "summary", "model": args.model, "requests": args.requests, "max_tokens": args.max_tokens,
        "batch": args.batch, "threads": args.threads,
        "log_share_max": max(r["log_share"] for r in by_depth.values()),
    }
    summary["log_goal_met"] = summary["log_share_max"] <= GOAL_LOG_SHARE
    if hf is not None:
        summary["speedup_vs_transformers"] = best["tokens_per_s"] / hf["tokens_per_s"]
        summary["speedup_goal_met"] = summary["speedup_vs_transformers"] >= GOAL_SPEEDUP
    if 1 in by_depth and 2 in by_depth:
        summary["depth2_vs_depth1"] = by_depth[2]["tokens_per_s"] / by_depth[1]["tokens_per_s"]
        summary["depth2_goal_met"] = summary["depth2_vs_depth1"] >= GOAL_DEPTH2
    return summary


def _emit(args: argparse.Namespace, row: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(row), flush=True)
        return
    if row["system"] == "tickloom":
        runs = ", ".join(f"{x:.1f}" for x in row["runs_tokens_per_s"])
        print(f"tickloom depth {row['pipeline_depth']}: {row['tokens']} tokens in {row['seconds']:.2f} s = "
              f"{row['tokens_per_s']:.1f} tokens/s (runs: {runs}); {row['ticks']} ticks, {row['steps']} steps, "
              f"{row['preemptions']} preemptions; log {row['log_cpu_s'] * 1e3:.1f} ms CPU of {row['cpu_s']:.2f} s "
              f"= {row['log_share']:.2%}", flush=True)
    elif row["system"] == "transformers":
        print(f"transformers static batches of {row['batch']}: {row['tokens']} tokens "
              f"({row['computed_tokens']} computed) in {row['seconds']:.2f} s = {row['tokens_per_s']:.1f} tokens/s",
              flush=True)
    else:
        parts = []
        if "speedup_vs_transformers" in row:
            parts.append(f"vs transformers x{row['speedup_vs_transformers']:.2f} (goal ≥ {GOAL_SPEEDUP}) "
                         f"{'ok' if row['speedup_goal_met'] else 'MISSED'}")
        if "depth2_vs_depth1" in row:
            parts.append(f"depth 2 / depth 1 x{row['depth2_vs_depth1']:.2f} (goal ≥ {GOAL_DEPTH2}) "
                         f"{'ok' if row['depth2_goal_met'] else 'MISSED'}")
        parts.append(f"log share {row['log_share_max']:.2%} (goal ≤ {GOAL_LOG_SHARE:.0%}) "
                     f"{'ok' if row['log_goal_met'] else 'MISSED'}")
        print("summary: " + "; ".join(parts), flush=True)
