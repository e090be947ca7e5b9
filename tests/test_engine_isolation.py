"""Per-request fault isolation: no accepted parameter value of one request can fail another request's step.

Sampling runs on the sampler directly (float32, where overflow bites first, and float64) and on a tiny real model; stop
strings, deadlines, priorities and the other stream-side extremes run on the stub model under ``MockClock``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing
from engine_helpers import assert_replays, stub_config
from model_fixtures import Spec

from tickloom import Engine, EngineConfig, RequestOutput, SamplingParams
from tickloom.engine.model.sampling import Sampler, SampleRow
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.events import LogReader, SamplingSpec, StepDone, StepFailed

TINY = 5e-324
HUGE = 1.7976931348623157e308
VOCAB = 512

EXTREMES: dict[str, dict[str, Any]] = {
    "top_k_huge_temperature_tiny": dict(top_k=2**31, temperature=1e-300),
    "temperature_denormal": dict(temperature=TINY),
    "temperature_just_sampling": dict(temperature=1e-5),
    "temperature_huge": dict(temperature=HUGE),
    "repetition_huge": dict(repetition_penalty=HUGE, temperature=0.0),
    "repetition_huge_sampled": dict(repetition_penalty=HUGE),
    "repetition_tiny": dict(repetition_penalty=TINY),
    "logprobs": dict(logprobs=20),
    "min_p_one": dict(min_p=1.0, logprobs=0),
    "top_p_tiny": dict(top_p=TINY, top_k=1),
    "seed_max": dict(seed=2**63 - 1),
    "seed_zero": dict(seed=0),
    "penalties_at_bounds": dict(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-3),
    # Every token is a stop token: all masked while ``min_tokens`` lasts, then the 6th token ends it as ``stop``.
    "everything_masked": dict(stop_token_ids=list(range(VOCAB)), min_tokens=6, logprobs=20),
    "all_at_once": dict(top_k=2**31, temperature=1e-300, repetition_penalty=HUGE, min_p=1.0, top_p=TINY,
                        presence_penalty=2.0, frequency_penalty=-2.0, logprobs=20,
                        seed=2**63 - 1),
}


def _no_nan(out: RequestOutput) -> None:
    assert out.logprobs is None or not any(math.isnan(x) for x in out.logprobs), out.logprobs


async def _collect(engine: Engine, prompt: list[int], params: SamplingParams, rid: str) -> RequestOutput:
    """Like ``complete``, keeping the logprobs."""
    frames = [out async for out in engine.generate(prompt, params, request_id=rid)]
    lps = [x for f in frames for x in (f.logprobs or [])]
    last = frames[-1]
    return RequestOutput(request_id=rid, token_ids=[t for f in frames for t in f.token_ids], finished=True,
                         finish_reason=last.finish_reason, error=last.error, logprobs=lps)


# -- the sampler ---------------------------------------------------------------------------------------------------
def _spec(kw: dict[str, Any]) -> SamplingSpec:
    """The wire form of the public params ``kw`` (sampled at temperature 1 unless ``kw`` says otherwise)."""
    return SamplingParams(**{"temperature": 1.0, **kw}).to_spec()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(EXTREMES))
def test_an_extreme_row_never_changes_or_fails_the_other_rows(name: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(4, VOCAB, generator=gen, dtype=torch.float64) * 4).to(dtype)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    kw = EXTREMES[name]
    history = dict(prompt_tokens=[1, 2, 3, 40, 41], output_tokens=[5, 5, 9])
    normal = [SampleRow(Spec(temperature=t, logprobs=True, top_logprobs=3), 11 + i, 2, **history)
              for i, t in enumerate((0.0, 0.8, 1.0))]
    extreme = SampleRow(_spec(kw), kw.get("seed", 3), 2, masked_token_ids=kw.get("stop_token_ids", []),
                        **history)
    rows = [normal[0], extreme, normal[1], normal[2]]
    together = sampler.sample(logits, rows)
    alone = sampler.sample(logits[[0, 2, 3]], normal)
    assert [together.token_ids[i] for i in (0, 2, 3)] == alone.token_ids
    assert together.logprobs is not None and alone.logprobs is not None
    assert [together.logprobs[i] for i in (0, 2, 3)] == alone.logprobs
    assert 0 <= together.token_ids[1] < VOCAB
    assert not any(math.isnan(x) for x in together.logprobs)
    assert together.top_logprobs is not None
    assert not any(math.isnan(x) for row in together.top_logprobs for x in row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_vanishing_temperature_is_greedy(dtype: torch.dtype) -> None:
    logits = (torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 4).to(dtype)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    greedy = sampler.sample(logits, [SampleRow(Spec(temperature=0.0), 1, 0)]).token_ids
    for t in (TINY, 1e-300, 1e-30, 9.9e-6):
        assert sampler.sample(logits, [SampleRow(Spec(temperature=t), 1, 0)]).token_ids == greedy


def test_nan_and_inf_logits_stay_in_their_row() -> None:
    sampler = Sampler(8, torch.device("cpu"))
    logits = torch.tensor([[float("nan")] * 8, [float("inf"), 0, 0, float("inf"), 0, 0, 0, 0],
                           [float("-inf")] * 8, [0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.float32)
    rows = [SampleRow(Spec(temperature=t, logprobs=True), 1, 0) for t in (1.0, 1.0, 0.0, 0.0)]
    out = sampler.sample(logits, rows)
    assert out.token_ids[3] == 7 and out.token_ids[1] in (0, 3)
    assert out.logprobs is not None and not any(math.isnan(x) for x in out.logprobs)


def test_masked_ids_outside_the_vocabulary_mask_nothing() -> None:
    sampler = Sampler(8, torch.device("cpu"))
    logits = torch.arange(16, dtype=torch.float32).reshape(2, 8)
    rows = [SampleRow(Spec(temperature=0.0, min_tokens=3), 1, 0, masked_token_ids=[7, 99, -1]),
            SampleRow(Spec(temperature=0.0), 1, 0)]
    assert sampler.sample(logits, rows).token_ids == [6, 7]


# -- the tiny real model -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), dtype="float64", seed=5)


def _tiny_config(model: Path, log: Path) -> EngineConfig:
    # float64, so a request's tokens and logprobs are exactly the same alone and batched (float32 batching moves
    # logits by an ulp); the sampler tests above cover float32's overflow.
    return EngineConfig(model=str(model), dtype="float64", max_seq_len=64, num_blocks=128, block_size=4,
                        max_batch_size=32, log_path=str(log))


NORMAL = SamplingParams(max_tokens=6, temperature=0.7, seed=1, ignore_eos=True, logprobs=0)
PROMPTS = [[5 + i, 9, 40 + i, 7, 7, 3 + i] for i in range(4)]


async def test_a_mixed_batch_on_the_tiny_model_all_finishes(tiny_model: Path, tmp_path: Path) -> None:
    results: dict[str, RequestOutput] = {}
    async with Engine.open(_tiny_config(tiny_model, tmp_path / "alone.tlog")) as engine:
        alone = {i: await _collect(engine, p, NORMAL, f"n{i}") for i, p in enumerate(PROMPTS)}
    async with Engine.open(_tiny_config(tiny_model, tmp_path / "mixed.tlog")) as engine:
        async def run(rid: str, prompt: list[int], params: SamplingParams) -> None:
            results[rid] = await _collect(engine, prompt, params, rid)

        async with trio.open_nursery() as nursery:
            for i, p in enumerate(PROMPTS):
                nursery.start_soon(run, f"n{i}", p, NORMAL)
            for name, kw in EXTREMES.items():
                params = SamplingParams(**{"max_tokens": 6, "ignore_eos": True, **kw})
                nursery.start_soon(run, name, [3, 3, 8, 40, 3], params)
    for i in range(len(PROMPTS)):
        out = results[f"n{i}"]
        assert out.finish_reason == "length" and out.token_ids == alone[i].token_ids, f"n{i} changed"
        assert out.logprobs == alone[i].logprobs and len(out.logprobs or []) == 6
    for name in EXTREMES:
        out = results[name]
        assert out.finish_reason in ("length", "stop") and len(out.token_ids) == 6, (name, out)
        assert all(0 <= t < VOCAB for t in out.token_ids)
        _no_nan(out)
    with LogReader(tmp_path / "mixed.tlog") as reader:
        inputs = [i for t in reader.ticks() for i in t.inputs.inputs]
    assert not any(isinstance(i, StepFailed) for i in inputs), "no step failed"
    assert any(isinstance(i, StepDone) and len(i.request_ids) > len(PROMPTS) for i in inputs), "they were batched"
    assert_replays(tmp_path / "mixed.tlog")


# -- the stub model: stop strings, deadlines, priorities, ids ----------------------------------------------------
STUB_EXTREMES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "huge_stops": (dict(stop=["~" * 1023 + chr(33 + i % 90) for i in range(128)], include_stop_str_in_output=True), {}),
    "huge_stop_prefixes": (dict(stop=[chr(33 + i % 90) * 1024 for i in range(128)]), {}),
    "every_token_a_stop": (dict(stop_token_ids=list(range(96)), min_tokens=10, max_tokens=10), {}),
    "max_tokens_max": (dict(max_tokens=2**31, min_tokens=2**31, seed=2**63 - 1), {}),
    "thinking_budget_max": (dict(thinking_budget=2**31, logprobs=20), {}),
    "priority_min": (dict(seed=0), dict(priority=-(2**31))),
    "priority_max": (dict(), dict(priority=2**31 - 1)),
    "deadline_huge": (dict(), dict(deadline=1e9)),
    "deadline_tiny": (dict(), dict(deadline=5e-324)),
    "long_ids": (dict(), dict(request_id="r" * 256, cache_salt="\U0001f600" * 1024)),
}


async def test_a_mixed_batch_on_the_stub_all_finishes(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    results: dict[str, RequestOutput] = {}
    async with Engine.open(stub_config(log, max_seq_len=200, num_blocks=512, max_batch_size=32)) as engine:
        async def run(key: str, prompt: str, params: SamplingParams, kwargs: dict[str, Any]) -> None:
            results[key] = await engine.complete(prompt, params, **kwargs)

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(run, f"n{i}", "hello", SamplingParams(max_tokens=8, seed=i, ignore_eos=True), {})
            for name, (kw, kwargs) in STUB_EXTREMES.items():
                nursery.start_soon(run, name, "~" * 150, SamplingParams(**kw), kwargs)
        await trio.sleep(0.1)
        stats = engine.stats()
        assert stats["waiting"] == stats["running"] == 0 and not engine.runtime.live
        assert engine.runtime.free_slots == engine.runtime.core_config.max_waiting
    for i in range(6):
        assert results[f"n{i}"].finish_reason == "length" and len(results[f"n{i}"].token_ids) == 8
    for name in STUB_EXTREMES:
        assert results[name].finish_reason != "error", (name, results[name].error)
    assert results["deadline_tiny"].finish_reason == "timeout"
    assert results["max_tokens_max"].finish_reason == "length"
    assert results["every_token_a_stop"].finish_reason == "stop", "stop outranks length at the 10th token"
    assert len(results["every_token_a_stop"].token_ids) == 10
    assert_replays(log)
