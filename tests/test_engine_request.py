"""``Engine`` and ``AsyncEngine`` take a request as one ``Request`` as they take its keywords, and show what a server
needs (the tokenizer, the derived core configuration) without their runtime."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import trio
import trio.testing
from engine_helpers import assert_replays, stub_config

from tickloom import Engine, RequestOutput, RequestRejected, SamplingParams
from tickloom.asyncio import Engine as AsyncEngine
from tickloom.request import FrameCollector, Request

PARAMS = SamplingParams(max_tokens=6, seed=3, logprobs=1, ignore_eos=True)


async def test_a_request_struct_runs_as_its_keywords(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log)) as engine:
        by_keywords = await engine.complete("hello", PARAMS, request_id="a", priority=1, cache_salt="s", deadline=60)
        collector = FrameCollector()
        stream = engine.generate_request(Request(prompt="hello", params=PARAMS, request_id="b", priority=1,
                                                 cache_salt="s", deadline=60))
        assert stream.request_id == "b"
        async for out in stream:
            collector.add(out)
        [by_struct] = collector.outputs()
        assert by_struct.token_ids == by_keywords.token_ids and by_struct.logprobs == by_keywords.logprobs
        assert by_struct.logprobs is not None and len(by_struct.logprobs) == len(by_struct.token_ids) == 6
        with pytest.raises(RequestRejected, match="priority"):
            engine.generate_request(Request(prompt="hello", priority=2**31))
        with pytest.raises(RequestRejected, match="vocab_size"):
            engine.generate_request(Request(prompt=[1, 10_000]))
        assert engine.tokenizer is engine.runtime.tokenizer
        assert engine.core_config is engine.runtime.core_config and engine.core_config.num_blocks == 128
        assert engine.tokenizer.decode(by_struct.token_ids, False) == by_struct.text_delta
    assert_replays(log)


def test_the_asyncio_engine_takes_a_request_struct(tmp_path: Path) -> None:
    async def main() -> tuple[RequestOutput, list[RequestOutput]]:
        async with AsyncEngine.open(stub_config(tmp_path / "run.tlog", stub_step_time=0.0)) as engine:
            assert engine.core_config.block_size == engine.runtime.core_config.block_size
            assert engine.tokenizer is engine.runtime.tokenizer
            whole = await engine.complete("hello", PARAMS, request_id="a")
            frames = [out async for out in engine.generate_request(Request(prompt="hello", params=PARAMS))]
            with pytest.raises(RequestRejected, match="complete_n"):
                await engine.complete("hello", SamplingParams(n=2))
            return whole, frames

    whole, frames = asyncio.run(main())
    assert [t for f in frames for t in f.token_ids] == whole.token_ids and frames[-1].finished
    assert_replays(tmp_path / "run.tlog")
