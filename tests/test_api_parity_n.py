"""``SamplingParams.n``: parallel samples of one prompt as ``n`` core requests ``<id>/<i>``, one stream of frames
tagged with ``index``, ``complete_n``, early exit and cancel, prefix-cache sharing, the asyncio bridge; and
``tickloom replay --full`` over runs that use every new field, on the stub and on the tiny model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from engine_helpers import assert_replays, core_finishes, stub_config

from tickloom import Engine, EngineConfig, RequestOutput, RequestRejected, SamplingParams
from tickloom import asyncio as tl_asyncio
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.events import LogReader, RequestArrived
from tickloom.tools.cli import main


def _arrivals(log: Path) -> dict[str, RequestArrived]:
    with LogReader(log) as reader:
        return {i.request_id: i for t in reader.ticks() for i in t.inputs.inputs if isinstance(i, RequestArrived)}


async def test_n_choices_are_n_seeded_requests_with_their_own_index(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log)) as engine:
        frames = [out async for out in engine.generate("hello", SamplingParams(n=3, max_tokens=10, seed=40),
                                                       request_id="many")]
        alone = [await engine.complete("hello", SamplingParams(max_tokens=10, seed=40 + i)) for i in range(3)]
        outs = await engine.complete_n("hello", SamplingParams(n=3, max_tokens=10, seed=40), request_id="again")
    assert {f.request_id for f in frames} == {"many"}
    assert sorted({f.index for f in frames}) == [0, 1, 2]
    finals = [f for f in frames if f.finished]
    assert sorted(f.index for f in finals) == [0, 1, 2] and frames[-1].finished
    for i in range(3):
        tokens = [t for f in frames if f.index == i for t in f.token_ids]
        assert tokens == alone[i].token_ids, f"choice {i} is the request seeded {40 + i}"
        assert outs[i].index == i and outs[i].token_ids == alone[i].token_ids and outs[i].request_id == "again"
        assert outs[i].text_delta == alone[i].text_delta and outs[i].finish_reason == "length"
    assert len({tuple(o.token_ids) for o in outs}) == 3, "three distinct streams"
    arrivals = _arrivals(log)
    assert [arrivals[f"many/{i}"].seed for i in range(3)] == [40, 41, 42], "logged as <id>/<i>, seeded seed + i"
    assert "many" not in arrivals
    assert_replays(log)


async def test_unseeded_choices_get_their_own_seeds_from_the_core(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    async with Engine.open(stub_config(tmp_path / "run.tlog")) as engine:
        outs = await engine.complete_n("hello", SamplingParams(n=4, max_tokens=8))
    assert len({tuple(o.token_ids) for o in outs}) == 4
    assert all(a.seed is None for a in _arrivals(tmp_path / "run.tlog").values()), "the core derives each seed"
    assert_replays(tmp_path / "run.tlog")


async def test_the_stream_ends_only_when_every_choice_has_finished(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    async with Engine.open(stub_config(tmp_path / "run.tlog")) as engine:
        # A stop string that ends choice 0 early and appears in no other choice's text.
        for seed in range(0, 400, 3):
            texts = [o.text_delta for o in await engine.complete_n(
                "hello", SamplingParams(n=3, max_tokens=12, seed=seed, ignore_eos=True))]
            stop = next((c for c in texts[0][:3] if c not in texts[1] + texts[2]), None)
            if stop is not None:
                break
        assert stop is not None
        frames = [out async for out in engine.generate("hello", SamplingParams(n=3, max_tokens=12, seed=seed,
                                                                               stop=stop))]
    first_final = next(k for k, f in enumerate(frames) if f.finished)
    assert frames[first_final].index == 0 and frames[first_final].finish_reason == "stop"
    assert any(f.index != 0 and f.token_ids for f in frames[first_final + 1:]), "the others go on after it"
    assert sum(f.finished for f in frames) == 3
    by_index = {f.index: f for f in frames if f.finished}
    assert by_index[1].finish_reason == by_index[2].finish_reason == "length"
    assert_replays(tmp_path / "run.tlog")


async def test_leaving_the_stream_early_cancels_every_choice(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log)) as engine:
        async for _ in engine.generate("hello", SamplingParams(n=3, max_tokens=200, seed=1), request_id="left"):
            break
        async with engine.stream("hello", SamplingParams(n=2, max_tokens=200, seed=1), request_id="block"):
            await trio.sleep(0.05)
        stream = engine.generate("hello", SamplingParams(n=2, max_tokens=200, seed=1), request_id="told")
        await stream.start()
        await engine.cancel("told")
        told = [out async for out in stream]
        await trio.sleep(0.5)
        assert not engine.runtime.live and engine.runtime.free_slots == engine.runtime.max_slots
    finishes = core_finishes(log)
    for rid, n in (("left", 3), ("block", 2), ("told", 2)):
        for i in range(n):
            usage = finishes[f"{rid}/{i}"].usage
            assert finishes[f"{rid}/{i}"].reason == "cancelled" and usage.completion_tokens < 200, (rid, i)
    assert sorted(f.index for f in told if f.finished) == [0, 1]
    assert all(f.finish_reason == "cancelled" for f in told if f.finished)
    assert_replays(log)


async def test_complete_refuses_n_and_points_to_complete_n(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    async with Engine.open(stub_config(tmp_path / "run.tlog")) as engine:
        with pytest.raises(RequestRejected, match=r"SamplingParams\.n=2: .*Engine\.complete_n\(\)"):
            await engine.complete("hello", SamplingParams(n=2))
        [one] = await engine.complete_n("hello", SamplingParams(max_tokens=3, seed=1), request_id="single")
        stream = engine.generate("hello", SamplingParams(n=2, max_tokens=3), request_id="busy")
        await stream.start()
        for taken in ("busy", "busy/1"):
            with pytest.raises(RequestRejected, match="already in use"):
                await engine.complete_n("hello", SamplingParams(max_tokens=3), request_id=taken)
        assert len([f async for f in stream if f.finished]) == 2
    assert one.index == 0 and one.request_id == "single" and len(one.token_ids) == 3
    assert set(_arrivals(tmp_path / "run.tlog")) == {"single", "busy/0", "busy/1"}, "n == 1 keeps the plain id"


async def test_choices_share_the_prompt_through_the_prefix_cache(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    prompt = "a long shared prompt, " * 6  # 132 tokens: eight full 16-token blocks
    async with Engine.open(stub_config(tmp_path / "run.tlog")) as engine:
        outs = await engine.complete_n(prompt, SamplingParams(n=4, max_tokens=4, seed=1))
        logged = await engine.complete_n(prompt, SamplingParams(n=4, max_tokens=4, seed=1, prompt_logprobs=0))
    cached = [o.usage.cached_prompt_tokens for o in outs if o.usage is not None]
    assert cached == [0, 128, 128, 128], "the first computes the prompt; the others reuse its full blocks"
    assert [o.usage.cached_prompt_tokens for o in logged if o.usage is not None] == [0, 0, 0, 0], \
        "prompt logprobs need every position computed"
    assert all(o.prompt_logprobs is not None and len(o.prompt_logprobs) == 132 for o in logged)
    assert_replays(tmp_path / "run.tlog")


def test_n_through_the_asyncio_bridge(tmp_path: Path) -> None:
    async def main_() -> tuple[list[RequestOutput], list[RequestOutput], list[RequestOutput], str]:
        config = EngineConfig(model="stub", stub_step_time=0.002, log_path=str(tmp_path / "run.tlog"))
        async with tl_asyncio.Engine.open(config) as engine:
            outs = await engine.complete_n("hello", SamplingParams(n=3, max_tokens=6, seed=9))
            frames = [out async for out in engine.generate("hello", SamplingParams(n=3, max_tokens=6, seed=9))]
            alone = [await engine.complete("hello", SamplingParams(max_tokens=6, seed=9 + i)) for i in range(3)]
            try:
                await engine.complete("hello", SamplingParams(n=3))
                refused = ""
            except RequestRejected as exc:
                refused = str(exc)
        return outs, frames, alone, refused

    outs, frames, alone, refused = asyncio.run(main_())
    assert [o.index for o in outs] == [0, 1, 2]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert sum(f.finished for f in frames) == 3, "the bridge reads past the first choice's final frame"
    for i in range(3):
        assert [t for f in frames if f.index == i for t in f.token_ids] == alone[i].token_ids
    assert "complete_n" in refused
    assert_replays(tmp_path / "run.tlog")


# -- replay --full over every new field ---------------------------------------------------------------------------


EVERYTHING: list[dict[str, Any]] = [
    dict(n=3, seed=2, logprobs=3),
    dict(logit_bias={40: 100.0, 41: -100.0}, seed=3, logprobs=0),
    dict(allowed_token_ids=[20, 21, 22, 23], seed=4, temperature=1.3),
    dict(prompt_logprobs=2, seed=5, min_tokens=3),
    dict(n=2, prompt_logprobs=1, logit_bias={7: 2.5}, allowed_token_ids=[7, 8, 9, 10, 11], seed=6, logprobs=1),
]


async def _run_everything(config: EngineConfig, prompt: list[int]) -> list[list[RequestOutput]]:
    results: list[list[RequestOutput]] = []
    async with Engine.open(config) as engine:
        async def one(i: int, kw: dict[str, Any]) -> None:
            results.append(await engine.complete_n(prompt, SamplingParams(max_tokens=6, **kw), request_id=f"r{i}"))

        async with trio.open_nursery() as nursery:
            for i, kw in enumerate(EVERYTHING):
                nursery.start_soon(one, i, kw)
    return results


async def test_replay_full_on_the_stub(tmp_path: Path, autojump_clock: trio.testing.MockClock,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "run.tlog"
    results = await _run_everything(stub_config(log, max_prefill_tokens=8), [3, 9, 27, 81, 50, 40, 30, 20, 10] * 3)
    assert sum(len(r) for r in results) == 8
    assert_replays(log)
    assert main(["replay", str(log), "--full"]) == 0
    assert "identical (full)" in capsys.readouterr().out


async def test_replay_full_on_the_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_tiny_model(tmp_path / "tiny", dtype="float64", seed=3)
    log = tmp_path / "run.tlog"
    config = EngineConfig(model=str(model), dtype="float64", max_seq_len=128, num_blocks=256, block_size=4,
                          max_batch_size=16, max_prefill_tokens=8, log_path=str(log))
    results = await _run_everything(config, [(5 * j + 1) % 500 + 5 for j in range(27)])
    by_id = {r[0].request_id: r for r in results}
    assert all(set(o.token_ids) <= {20, 21, 22, 23} for o in by_id["r2"])
    assert all(set(o.token_ids) <= {7, 8, 9, 10, 11} for o in by_id["r4"])
    assert all(o.prompt_logprobs is not None and len(o.prompt_logprobs) == 27 for o in by_id["r3"] + by_id["r4"])
    assert_replays(log)
    assert main(["replay", str(log), "--full"]) == 0
    out = capsys.readouterr().out
    assert "identical (full)" in out and " 0 failed steps" in out
