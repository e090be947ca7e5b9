"""``tickloom bench speculative``: decoding with speculation against decoding without, side by side in one run.

Two engines on the same model (default: the bundled one) differ only in ``speculative_tokens`` (``--k``, prompt
lookup). Greedy requests, on two kinds of prompt:

- **copy-heavy**: summarise, edit or extract from a given text, where the output repeats its input;
- **open-ended**: stories, explanations, lists, where it does not.

At batch 1 (requests one after another) and at each ``--batch`` (that many at once, ``max_batch_size`` the batch),
each side runs ``--repeat`` times, alternating; the fastest run counts. Tokens per second is the output tokens over
the wall time of the run. Both sides must give the same tokens (speculation never changes one; checked here too).
From the speculating engine's log: the share of proposal slots the proposer filled, the acceptance rate
(proposals accepted per proposal made) and the tokens per decode row with slots.

llama.cpp's own prompt lookup decoding (llama-cpp-python's ``LlamaPromptLookupDecoding``) runs the same prompts at
batch 1 when llama-cpp-python is installed (``tickloom[bench]``), with and without it.

With ``--draft-dtype`` (default bfloat16), the same two kinds of prompt at batch 1 with the draft proposer: the
model in that dtype, drafted for by its own weights in int4.

Goals: at batch 1, >= 1.6x on the copy-heavy prompts with prompt lookup, >= 1.3x with the int4 draft, >= 0.95x on
the open-ended ones.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from tickloom.tools.bench.jobs import run_jobs
from tickloom.tools.progress import progress_note

HELP = "speculative decoding (prompt lookup) against plain decoding: copy-heavy and open-ended prompts, batch 1-16"

GOAL_COPY = 1.6
GOAL_DRAFT = 1.3
GOAL_OPEN = 0.95

TEXTS = [
    "The city council met on Tuesday evening to vote on the new budget. After three hours of debate, the council "
    "approved a plan that adds two bus lines, repairs the old library roof and hires twelve more teachers for the "
    "primary schools. The mayor said the plan would be paid for by a small rise in the parking fees.",
    "def parse_config(path):\n    with open(path) as handle:\n        data = json.load(handle)\n    if 'name' not "
    "in data:\n        raise ValueError('config has no name')\n    return Config(name=data['name'], "
    "size=data.get('size', 10), verbose=data.get('verbose', False))\n",
    "Order 4471 was placed by Maria Lopez on 12 March 2024. It contains two blue wool sweaters at 45 euros each "
    "and one pair of leather boots at 120 euros. It ships to Calle Mayor 14, Madrid, by express delivery.",
]
COPY = [
    f"Repeat the following text exactly, word for word:\n\n{TEXTS[0]}",
    f"Rewrite this Python function with the parameter renamed from path to filename:\n\n{TEXTS[1]}",
    f"Extract the customer name, the order number, the items and the address from this text, each on its own "
    f"line:\n\n{TEXTS[2]}",
    f"Summarise this text in two sentences, keeping its words where you can:\n\n{TEXTS[0]}",
]
OPEN = [
    "Tell me a story about a lighthouse keeper.",
    "Explain why the sky is blue.",
    "Write a poem about autumn.",
    "Give me ten ideas for a birthday party.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="the model (default smollm2-135m)")
    parser.add_argument("--k", type=int, default=4, help="speculative_tokens of the speculating engine (default 4)")
    parser.add_argument("--batch", type=int, nargs="*", default=[4, 16], help="batched cases (default 4 16)")
    parser.add_argument("--max-tokens", type=int, default=96, help="output tokens per request at most (default 96)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per side, alternating; the fastest counts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--draft-dtype", default="bfloat16", choices=["float32", "bfloat16", "none"],
                        help="also run the draft proposer (the model's own weights in int4) for the model in this "
                             "dtype at batch 1; none: skip (default bfloat16)")


def _jobs(prompts: list[str], count: int, max_tokens: int) -> list[tuple[Any, Any]]:
    from tickloom import SamplingParams

    return [([{"role": "user", "content": prompts[i % len(prompts)]}],
             SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=i)) for i in range(count)]


def _acceptance(log: Path) -> tuple[int, int, int, int]:
    """(proposal slots planned, slots the proposer filled, proposals accepted, decode rows with slots) in a log."""
    from tickloom.events import PROPOSE, LogReader, RunStep, StepDone

    slots = filled = accepted = rows = 0
    with LogReader(log) as reader:
        for record in reader.ticks():
            for command in record.outputs.commands:
                if isinstance(command, RunStep) and PROPOSE in command.token_ids:
                    slots += command.token_ids.count(PROPOSE)
                    rows += sum(1 for n, start in zip(command.num_tokens, _row_starts(command), strict=True)
                                if command.token_ids[start + n - 1] == PROPOSE)
            for item in record.inputs.inputs:
                if isinstance(item, StepDone) and item.extra_token_ids:
                    accepted += sum(len(row) for row in item.extra_token_ids)
                if isinstance(item, StepDone) and item.proposed:
                    filled += sum(item.proposed)
    return slots, filled, accepted, rows


def _row_starts(command: Any) -> list[int]:
    starts, offset = [], 0
    for n in command.num_tokens:
        starts.append(offset)
        offset += n
    return starts


async def _case(kind: str, prompts: list[str], batch: int, args: argparse.Namespace, tmp: Path,
                proposer: str = "prompt_lookup", dtype: str | None = None) -> dict[str, Any]:
    from tickloom import Engine, EngineConfig

    count = len(prompts) if batch == 1 else batch
    jobs = _jobs(prompts, count, args.max_tokens)
    log = tmp / f"{kind}-b{batch}-{proposer}.tlog"
    base = dict(model=args.model, max_batch_size=max(batch, 1), threads=args.threads, dtype=dtype)
    plain_config = EngineConfig(**base)  # type: ignore[arg-type]
    spec_config = EngineConfig(**base, speculative_tokens=args.k, speculative_proposer=proposer,  # type: ignore[arg-type]
                               log_path=str(log))
    best = {"plain": float("inf"), "speculative": float("inf")}
    outputs: dict[str, list[list[int]]] = {}
    async with Engine.open(plain_config) as plain, Engine.open(spec_config) as spec:
        await run_jobs(plain, jobs[:1], False)  # warm-up
        await run_jobs(spec, jobs[:1], False)
        for _ in range(args.repeat):
            for side, engine in (("plain", plain), ("speculative", spec)):
                seconds, outs = await run_jobs(engine, jobs, batch > 1)
                best[side] = min(best[side], seconds)
                outputs[side] = outs
    tokens = sum(len(o) for o in outputs["plain"])
    slots, filled, accepted, rows = _acceptance(log)
    return {
        "prompts": kind, "batch": batch, "proposer": proposer if dtype is None else f"{proposer} ({dtype} target)",
        "requests": count, "tokens": tokens,
        "plain_tok_s": tokens / best["plain"], "speculative_tok_s": tokens / best["speculative"],
        "ratio": best["plain"] / best["speculative"], "same_tokens": outputs["plain"] == outputs["speculative"],
        "filled": filled / slots if slots else 0.0, "acceptance": accepted / filled if filled else 0.0,
        "tokens_per_row": (rows + accepted) / rows if rows else 1.0,
    }


def _llama_cpp_lookup(args: argparse.Namespace) -> dict[str, Any] | None:
    """llama.cpp's prompt lookup decoding on the copy-heavy prompts at batch 1, with and without; None without
    llama-cpp-python or a GGUF for the model."""
    from tickloom.tools.bench import llamacpp

    if not llamacpp.available() or args.model != "smollm2-135m":
        return None
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from tickloom.engine.model.registry import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    if gguf is None:
        return None
    seconds: dict[str, float] = {}
    tokens = 0
    for side, draft in (("plain", None), ("lookup", LlamaPromptLookupDecoding(num_pred_tokens=args.k))):
        llm = Llama(str(gguf), n_ctx=2048, n_threads=args.threads or 1, draft_model=draft, verbose=False)
        best = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            made = 0
            for prompt in COPY:
                out = llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
                                                 temperature=0.0)
                made += int(out["usage"]["completion_tokens"])
            best = min(best, time.perf_counter() - start)
            tokens = made
        seconds[side] = best
    return {"prompts": "copy-heavy", "batch": 1, "engine": "llama.cpp", "tokens": tokens,
            "plain_tok_s": tokens / seconds["plain"], "lookup_tok_s": tokens / seconds["lookup"],
            "ratio": seconds["plain"] / seconds["lookup"]}


def run(args: argparse.Namespace) -> int:
    import trio

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tickloom-bench-speculative-") as tmp:
        for batch in [1, *args.batch]:
            for kind, prompts in (("copy-heavy", COPY), ("open-ended", OPEN)):
                progress_note(f"{kind}, batch {batch} ...")
                rows.append(trio.run(_case, kind, prompts, batch, args, Path(tmp)))
        if args.draft_dtype != "none" and args.model != "stub":
            for kind, prompts in (("copy-heavy", COPY), ("open-ended", OPEN)):
                progress_note(f"{kind}, batch 1, int4 draft for the {args.draft_dtype} model ...")
                rows.append(trio.run(_case, kind, prompts, 1, args, Path(tmp), "draft", args.draft_dtype))
    progress_note("llama.cpp prompt lookup ...")
    llama = _llama_cpp_lookup(args)
    if args.json:
        for row in rows:
            print(json.dumps({"case": f"{row['prompts']} batch {row['batch']}", **row}))
        if llama is not None:
            print(json.dumps({"case": "llama.cpp prompt lookup", **llama}))
    else:
        print(f"speculative decoding (prompt lookup, k={args.k}) against plain decoding; {args.model}, greedy")
        print(f"{'proposer':>26} {'prompts':>10} {'batch':>5} {'tokens':>6} {'plain tok/s':>11} {'spec tok/s':>10} "
              f"{'ratio':>6} {'goal':>5} {'filled':>6} {'accepted':>8} {'tok/row':>7} {'same':>4}")
        for row in rows:
            goal = _goal(row)
            print(f"{row['proposer']:>26} {row['prompts']:>10} {row['batch']:>5} {row['tokens']:>6} "
                  f"{row['plain_tok_s']:>11.1f} "
                  f"{row['speculative_tok_s']:>10.1f} {row['ratio']:>5.2f}x "
                  f"{'' if goal is None else f'{goal:.2f}x':>5} {row['filled']:>6.0%} {row['acceptance']:>8.0%} "
                  f"{row['tokens_per_row']:>7.2f} {'yes' if row['same_tokens'] else 'NO':>4}")
        if llama is None:
            print("llama.cpp prompt lookup: not run (needs llama-cpp-python: pip install 'tickloom[bench]')")
        else:
            print(f"llama.cpp prompt lookup, copy-heavy, batch 1: plain {llama['plain_tok_s']:.1f} tok/s, lookup "
                  f"{llama['lookup_tok_s']:.1f} tok/s, {llama['ratio']:.2f}x")
    ok = all(row["same_tokens"] and row["ratio"] >= (_goal(row) or 0.0) for row in rows)
    return 0 if ok else 1


def _goal(row: dict[str, Any]) -> float | None:
    """The row's goal: batch 1 only; the draft's on copy-heavy prompts is ``GOAL_DRAFT``."""
    if row["batch"] != 1:
        return None
    if row["prompts"] == "open-ended":
        return GOAL_OPEN
    return GOAL_DRAFT if row["proposer"].startswith("draft") else GOAL_COPY
