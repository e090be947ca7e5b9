"""Shared helpers for tests/test_model_*.py (not a conftest: import what you need)."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tickloom.engine.model.executor import ModelExecutor
from tickloom.engine.model.tables import step_of
from tickloom.engine.model.types import StepResult
from tickloom.events import SamplingSpec
from tickloom.events.commands import BindRequest

Spec = functools.partial(SamplingSpec, temperature=0.0)
"""A ``SamplingSpec``, greedy unless told otherwise (the model tests' default)."""


@dataclass
class _Req:
    prompt: list[int]
    out: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    pos: int = 0  # next position to feed


class Driver:
    """A minimal stand-in for the scheduler: chunked prefill, decode, shuffled block allocation."""

    def __init__(self, ex: ModelExecutor, seed: int = 0) -> None:
        self.ex = ex
        self.bs = ex.block_size
        self.free = list(range(ex.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.reqs: dict[str, _Req] = {}

    def add(self, rid: str, prompt: list[int], spec: SamplingSpec, seed: int, masked: list[int] | None = None) -> None:
        self.ex.bind(BindRequest(rid, spec, seed, len(prompt), masked or []))
        self.reqs[rid] = _Req(list(prompt))

    def release(self, rid: str) -> None:
        r = self.reqs.pop(rid)
        self.free.extend(r.table)
        self.ex.release(rid)

    def step(self, rids: list[str], chunk: int = 1 << 30) -> StepResult:
        cols: dict[str, list[int]] = {k: [] for k in ("pos", "n", "tok", "samp", "bst", "nnb", "nb")}
        sampled: list[str] = []
        for rid in rids:
            r = self.reqs[rid]
            seq = r.prompt + r.out
            n = min(chunk, len(seq) - r.pos)  # prefill, recompute after preemption, or decode
            toks = seq[r.pos : r.pos + n]
            samples = r.pos + n == len(seq)
            need = -(-(r.pos + n) // self.bs) - len(r.table)
            new = [self.free.pop() for _ in range(max(0, need))]
            cols["bst"].append(len(r.table))
            r.table.extend(new)
            cols["pos"].append(r.pos)
            cols["n"].append(n)
            cols["tok"].extend(toks)
            cols["samp"].append(len(r.out) if samples else -1)
            cols["nnb"].append(len(new))
            cols["nb"].extend(new)
            r.pos += n
            if samples:
                sampled.append(rid)
        res = self.ex.run_step(step_of(
            list(rids), cols["pos"], cols["n"], cols["tok"], cols["samp"], cols["bst"], cols["nnb"], cols["nb"]
        ))
        for rid, t in zip(sampled, res.token_ids, strict=True):
            self.reqs[rid].out.append(t)
        return res

    def generate(self, rids: list[str], max_new: int, chunk: int = 1 << 30) -> dict[str, list[int]]:
        while True:
            live = [r for r in rids if len(self.reqs[r].out) < max_new]
            if not live:
                return {r: list(self.reqs[r].out) for r in rids}
            self.step(live, chunk)


def make_executor(model_dir: Path, dtype: str = "float32", num_blocks: int = 256, block_size: int = 4) -> ModelExecutor:
    from tickloom.engine.model.loaders import load_model

    torch.set_num_threads(1)
    lm = load_model(model_dir, dtype=dtype)
    return ModelExecutor(lm.model, num_blocks=num_blocks, block_size=block_size)


def prompts(n: int, length: int, vocab: int = 250, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length + 3 * i)] for i in range(n)]
