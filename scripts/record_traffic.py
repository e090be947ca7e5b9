"""Record an engine log of paced traffic, the kind ``tickloom whatif`` re-simulates and ``--validate`` re-runs.

N prompts arrive GAP seconds apart (real time), each asking for MAX_TOKENS tokens (``ignore_eos``, so every request
produces as many tokens in every run), on the default model with one thread:

    .venv/bin/python scripts/record_traffic.py base.tlog --max-batch-size 4 --num-blocks 24 --requests 8 \
        --gap 0.4 --max-tokens 32
"""

from __future__ import annotations

import argparse

import trio

from tickloom import Engine, EngineConfig, SamplingParams

PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.", "List three uses of copper.",
           "What is the capital of France? Answer in one sentence.",
           "Describe a cat to someone who has never seen one.", "Give me a recipe for pancakes.",
           "Why is the sky blue?", "Summarise the plot of Hamlet in two lines."]


async def record(args: argparse.Namespace) -> None:
    config = EngineConfig(model=args.model, log_path=args.log, max_batch_size=args.max_batch_size,
                          num_blocks=args.num_blocks, block_size=16, max_seq_len=128, threads=1)

    async def one(engine: Engine, i: int) -> None:
        await trio.sleep(args.gap * i)
        params = SamplingParams(max_tokens=args.max_tokens, seed=i, ignore_eos=True)
        async for _ in engine.generate(PROMPTS[i % len(PROMPTS)] * (1 + i % 3), params, request_id=f"m{i}"):
            pass

    async with Engine.open(config) as engine, trio.open_nursery() as nursery:
        for i in range(args.requests):
            nursery.start_soon(one, engine, i)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="the log to create")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=24)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--gap", type=float, default=0.4, help="seconds between arrivals")
    parser.add_argument("--max-tokens", type=int, default=32)
    trio.run(record, parser.parse_args())


if __name__ == "__main__":
    main()
