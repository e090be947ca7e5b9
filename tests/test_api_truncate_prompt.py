"""``SamplingParams.truncate_prompt_tokens`` (vLLM's): only the prompt's last k tokens are kept (-1: the last
``max_seq_len - 1``). Added by declaring the field (``events.types.SamplingFields``) and acting on it at submit: the
parameter is validated, logged with the arrival (whose prompt is the kept tokens) and replayed, ``--full`` included."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing
from engine_helpers import assert_replays, stub_config

from tickloom import Engine, EngineConfig, RequestRejected, SamplingParams
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.events import LogReader, RequestArrived
from tickloom.tools.cli import main

PROMPT = [(7 * j + 3) % 90 + 2 for j in range(40)]


def _arrivals(log: Path) -> dict[str, RequestArrived]:
    with LogReader(log) as reader:
        return {i.request_id: i for t in reader.ticks() for i in t.inputs.inputs if isinstance(i, RequestArrived)}


def test_the_bound_is_checked_when_the_params_are_made() -> None:
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
    for bad in (-2, 2**31 + 1, 1.5, True, "3"):
        with pytest.raises(RequestRejected, match=r"SamplingParams\.truncate_prompt_tokens="):
            SamplingParams(truncate_prompt_tokens=bad)  # type: ignore[arg-type]
    assert SamplingParams(truncate_prompt_tokens=5).to_spec().truncate_prompt_tokens == 5
    assert SamplingParams().to_spec().truncate_prompt_tokens is None


async def test_the_last_k_tokens_are_kept_and_logged(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log, max_seq_len=32)) as engine:
        kept = await engine.complete(PROMPT, SamplingParams(max_tokens=3, truncate_prompt_tokens=10), request_id="k")
        short = await engine.complete(PROMPT[:5], SamplingParams(max_tokens=3, truncate_prompt_tokens=10),
                                      request_id="short")
        longest = await engine.complete(PROMPT, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1),
                                        request_id="max")
        text = await engine.complete("abcdefgh" * 10, SamplingParams(max_tokens=1, truncate_prompt_tokens=4),
                                     request_id="text")
        with pytest.raises(RequestRejected, match="the prompt has 40 tokens; max_seq_len=32"):
            engine.generate(PROMPT, SamplingParams(max_tokens=3))
        with pytest.raises(RequestRejected, match="the prompt has 32 tokens; max_seq_len=32"):
            engine.generate(PROMPT, SamplingParams(max_tokens=3, truncate_prompt_tokens=32))
        with pytest.raises(RequestRejected, match=r"SamplingParams\.truncate_prompt_tokens=0 would keep no prompt"):
            engine.generate(PROMPT, SamplingParams(max_tokens=3, truncate_prompt_tokens=0))
    arrivals = _arrivals(log)
    assert arrivals["k"].prompt_token_ids == PROMPT[-10:], "left truncation: the last 10 tokens"
    assert arrivals["k"].params.truncate_prompt_tokens == 10, "the parameter is logged with the arrival"
    assert arrivals["short"].prompt_token_ids == PROMPT[:5], "a shorter prompt is kept whole"
    assert arrivals["max"].prompt_token_ids == PROMPT[-31:], "-1 keeps max_seq_len - 1 tokens"
    assert arrivals["text"].prompt_token_ids == [ord(c) - 32 for c in "efgh"], "text is tokenized, then truncated"
    assert kept.usage is not None and kept.usage.prompt_tokens == 10
    assert short.usage is not None and short.usage.prompt_tokens == 5
    assert longest.usage is not None and longest.usage.prompt_tokens == 31
    assert text.usage is not None and text.usage.prompt_tokens == 4
    assert_replays(log)


@pytest.mark.slow
async def test_a_truncated_prompt_generates_as_its_kept_tokens_and_replays_in_full(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_tiny_model(tmp_path / "tiny", dtype="float64", seed=3)
    log = tmp_path / "run.tlog"
    config = EngineConfig(model=str(model), dtype="float64", max_seq_len=64, num_blocks=128, block_size=4,
                          prefix_caching=False, log_path=str(log))
    async with Engine.open(config) as engine:
        truncated = await engine.complete(PROMPT, SamplingParams(max_tokens=8, seed=9, truncate_prompt_tokens=12))
        kept = await engine.complete(PROMPT[-12:], SamplingParams(max_tokens=8, seed=9))
        whole = await engine.complete(PROMPT, SamplingParams(max_tokens=8, seed=9))
    assert truncated.token_ids == kept.token_ids, "the model saw only the kept tokens"
    assert truncated.token_ids != whole.token_ids, "and they differ from what the whole prompt gives"
    assert_replays(log)
    assert main(["replay", str(log), "--full"]) == 0
    assert "identical (full)" in capsys.readouterr().out
