"""``tickloom bench calibrate``: measure a model's step-time surface on this machine, once, for ``tickloom whatif``.

The model is loaded as the engine loads it (``--model``, ``--dtype``, ``--quant``, ``--device``, ``--threads``), and
its executor runs steps of chosen shapes directly, timed as the engine's device times a step (``perf_counter_ns``
around ``run_step``): decode steps of each ``--batch-sizes`` rows at each ``--contexts`` position, and prefill steps
of one row of each ``--prefill`` tokens (from position 0, and again after each context), and mixed steps (the
fewest and the most decode rows, with a prefill chunk). After a warm-up, the whole grid runs ``--repeat`` times,
each time from another shape, so that a busy spell on the machine does not fall on one shape; every run is a
sample. A sample is the step's time less the time its thread waited, runnable, for a CPU during it
(``tools/bench/host_share.py``; Linux): on a shared machine another process's work is not the model's (a profile of
the default model measured while other sessions' tests came and went, without this, had a mean absolute error of
29 ms on 60-1100 ms steps). The what-if scales a profile to the speed a log's steps ran at, so a profile of
uncontended times loses nothing.

The profile (``replay.step_model.Profile``) is stored beside the models in the cache, under the model's weight
fingerprint and its device, dtype and thread count, exactly as an engine log's header names them
(``replay.step_model.profile_path``). ``tickloom whatif`` fits its step model on it when a log's own steps do not
span the what-if's. The command prints the fitted model, its range and its mean absolute error.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

HELP = "measure the model's step times over a grid of shapes and store the profile whatif uses"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="the model (as --model of generate; not the stub)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--quant", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16], metavar="N")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1, 16, 128, 384], metavar="N",
                        help="the decode rows' positions (the context each reads)")
    parser.add_argument("--prefill", type=int, nargs="+", default=[4, 16, 64, 192], metavar="N",
                        help="the prefill chunks' lengths")
    parser.add_argument("--repeat", type=int, default=3, help="runs per shape, each a sample (default 3)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-save", action="store_true", help="measure and print, store nothing")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(args: argparse.Namespace) -> int:
    import torch

    from tickloom.engine.core.blocks import blocks_holding
    from tickloom.engine.model.executor import ModelExecutor
    from tickloom.engine.model.loaders import load_model
    from tickloom.engine.model.tables import step_of
    from tickloom.events import SamplingSpec
    from tickloom.events.commands import BindRequest
    from tickloom.replay.step_model import Profile, StepSample, StepShape, save_profile
    from tickloom.tools.bench.host_share import waited_ns
    from tickloom.tools.cli import CliError
    from tickloom.tools.progress import progress_note

    if args.model == "stub":
        raise CliError("the stub's step time is fixed (stub_step_time): there is nothing to calibrate")
    if min(args.batch_sizes + args.contexts + args.prefill + [args.repeat, args.block_size]) < 1:
        raise CliError("--batch-sizes, --contexts, --prefill, --repeat and --block-size take numbers >= 1")
    loaded = load_model(args.model, args.dtype, args.device, args.threads, args.quant)
    max_len = max(args.contexts) + max(args.prefill) + 1
    per_row = blocks_holding(max_len, args.block_size)
    rows = max(args.batch_sizes) + 1
    ex = ModelExecutor(loaded.model, rows * per_row + 1, args.block_size)
    spec = SamplingSpec(temperature=0.0)
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(rows)]
    samples: list[StepSample] = []
    step_id = 0
    waited = [0]

    def timed(ids: list[str], positions: list[int], counts: list[int]) -> None:
        nonlocal step_id
        for i, (rid, p) in enumerate(zip(ids, positions, strict=True)):
            # bound afresh with exactly the p tokens before the row, so that the row runs whole (LM head and
            # sampler included) as a first run of that position does
            ex.release(rid)
            ex.bind(BindRequest(rid, spec, i, p + counts[i], [], [7] * p))
        tokens = [7] * sum(counts)
        step = step_of(ids, positions, counts, tokens, [0] * len(ids), [0] * len(ids), [per_row] * len(ids),
                       [b for i in range(len(ids)) for b in tables[i]], step_id=step_id)
        step_id += 1
        before = waited_ns()
        start = time.perf_counter_ns()
        ex.run_step(step)
        elapsed = time.perf_counter_ns() - start
        after = waited_ns()
        wait = 0 if before is None or after is None else max(0, min(after - before, elapsed - 1))
        waited[0] += wait
        samples.append(StepSample(StepShape.of(step), elapsed - wait))

    shapes: list[tuple[str, list[str], list[int], list[int]]] = []
    for context in sorted(args.contexts):
        for batch in sorted(args.batch_sizes):
            shapes.append((f"decode: {batch} rows at position {context}", [f"c{i}" for i in range(batch)],
                           [context] * batch, [1] * batch))
    middle = sorted(args.contexts)[len(args.contexts) // 2]
    for length in sorted(args.prefill):
        for start in (0, *sorted(args.contexts)):
            shapes.append((f"prefill: {length} tokens from position {start}", ["c0"], [start], [length]))
        for batch in sorted({min(args.batch_sizes), max(args.batch_sizes)}):
            shapes.append((f"mixed: {batch} decode rows and {length} prefill tokens",
                           [f"c{i}" for i in range(batch + 1)], [middle] * batch + [0], [1] * batch + [length]))
    timed(["c0"], [0], [min(args.prefill)])  # warm-up, not kept
    samples.clear()
    waited[0] = 0
    # Every repeat runs the whole grid, each from another starting shape: a busy spell on the machine slows
    # every shape a little rather than one shape a lot.
    for r in range(args.repeat):
        start = r * len(shapes) // args.repeat
        for note, ids, positions, counts in shapes[start:] + shapes[:start]:
            progress_note(f"{note} ({r + 1}/{args.repeat})")
            timed(ids, positions, counts)
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    if loaded.model.quant != "none":  # as the engine's log header names it
        dtype = f"{dtype}+{loaded.model.quant}"
    profile = Profile(str(args.model), loaded.fingerprint, str(loaded.model.device), dtype, torch.get_num_threads(),
                      f"{_cpu_name()}, {platform.node()}", tuple(samples))
    path = None if args.no_save else save_profile(profile)
    model = profile.fit(path)
    summary: dict[str, Any] = {"model": args.model, "fingerprint": loaded.fingerprint, "device": profile.device,
                               "dtype": dtype, "threads": profile.threads, "samples": len(samples),
                               "step_model": model.to_json(), "profile": None if path is None else str(path),
                               "waited_s": waited[0] / 1e9}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"calibrated {args.model} ({profile.device}, {dtype}, {profile.threads} threads): {len(samples)} "
              f"steps ({waited[0] / 1e9:.1f} s waiting for a CPU taken out of their times)")
        print(f"  {model.describe()}")
        print(f"  stored: {path}" if path is not None else "  not stored (--no-save)")
    return 0
