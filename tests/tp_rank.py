"""One rank of the tensor-parallel test (``tests/test_tp.py`` starts two as processes), and the workload both the
test's one-rank run and rank 0 drive: the real core in the simulator, the model behind ``replay.full.ModelDevice``.

    python tests/tp_rank.py --rank R --world W --port P --model DIR --log PATH --out TOKENS.json
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tickloom.engine.core import CoreConfig
from tickloom.engine.model.executor import ModelExecutor
from tickloom.engine.model.llama import LlamaModel
from tickloom.engine.model.loaders import load_model
from tickloom.engine.model.tp import TensorParallelExecutor, serve_rank, shard_model
from tickloom.events import EmitTokens, RequestArrived, SamplingSpec
from tickloom.replay.full import ModelDevice
from tickloom.replay.record import record_core_run

CONFIG = CoreConfig(num_blocks=96, block_size=16, vocab_size=512, eos_token_ids=(2,), max_seq_len=256,
                    max_batch_size=8, max_prefill_tokens=48)
"""Small prefill chunks: the steps mix prefill chunks and decode rows."""


def rank_model(model_dir: str | Path, *, rank: int, world: int) -> LlamaModel:
    """Rank ``rank``'s float32 shard of the checkpoint, loaded as the engine loads one (``load_model``'s ``build``)."""
    build = functools.partial(shard_model, rank=rank, world=world)
    return load_model(model_dir, "float32", "cpu", 1, "none", build=build).model


def workload() -> dict[int, list[RequestArrived]]:
    """Two greedy requests and two seeded sampled ones, arriving over a few ticks, with a shared prefix."""
    def prompt(i: int, n: int) -> list[int]:
        return [3 + (7 * j) % 200 for j in range(16)] + [10 + (i * 31 + 5 * j) % 400 for j in range(n)]

    greedy = SamplingSpec(max_tokens=12, temperature=0.0)
    sampled = SamplingSpec(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50)
    return {
        0: [RequestArrived("g0", prompt(0, 40), greedy, 11), RequestArrived("s0", prompt(1, 25), sampled, 1234)],
        2: [RequestArrived("g1", prompt(2, 9), greedy, 12)],
        3: [RequestArrived("s1", prompt(3, 60), sampled, 99)],
    }


def run_workload(executor: Any, log: str | Path) -> dict[str, list[int]]:
    """Run the workload's core with ``executor`` as its device; each request's tokens, as the log has them."""
    result = record_core_run(log, CONFIG, workload(), device=ModelDevice(executor))
    tokens: dict[str, list[int]] = {}
    for out in result.outputs:
        for command in out.commands:
            if isinstance(command, EmitTokens):
                for rid, token in zip(command.request_ids, command.token_ids, strict=True):
                    tokens.setdefault(rid, []).append(token)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--rank", "--world", "--port"):
        parser.add_argument(flag, type=int, required=True)
    for flag in ("--model", "--log", "--out"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    try:
        model = rank_model(args.model, rank=args.rank, world=args.world)
        executor = ModelExecutor(model, CONFIG.num_blocks, CONFIG.block_size)
        if args.rank == 0:
            tp = TensorParallelExecutor(executor)
            try:
                tokens = run_workload(tp, args.log)
            finally:
                tp.stop()
            Path(args.out).write_text(json.dumps({"tokens": tokens, "kv_heads": model.cfg.num_kv_heads}))
        else:
            calls = serve_rank(executor)
            Path(args.out).write_text(json.dumps({"calls": calls, "kv_heads": model.cfg.num_kv_heads}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
