"""One validation boundary: every public input is checked for type and range, or it runs and replays.

The property test draws arbitrary Python values (wrong types, huge, negative, NaN, inf, empty, unicode, lone
surrogates, None, lists, dicts) for every public parameter: each ``SamplingParams`` field, each keyword of
``Engine.generate``/``stream``/``complete``, ``cancel``'s id, the prompt and the ``params`` argument itself. Each
case is either refused with ``RequestRejected`` naming the parameter, or it runs to a finish; either way the other
requests of its batch finish normally, the engine's gauges and submit slots return to their baseline, and the
log replays ``identical``.
"""

from __future__ import annotations

import math
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from engine_helpers import assert_replays, stub_config
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tickloom import ConfigError, Engine, EngineConfig, FaultPlan, RequestRejected, SamplingParams
from tickloom.events import LogReader, RequestArrived
from tickloom.request import Request

FIELDS = [f.name for f in msgspec.structs.fields(SamplingParams)]
KWARGS = [f.name for f in msgspec.structs.fields(Request) if f.name not in ("prompt", "params")]
NORMAL_TOKENS = 5
MAX_SEQ_LEN = 64

# -- strategies ----------------------------------------------------------------------------------------------------
SPECIAL_FLOATS = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-300, 5e-324, 1e308, 1.7976931348623157e308]
SPECIAL_INTS = [0, 1, -1, True, False, 2**31 - 1, 2**31, 2**31 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
SPECIAL_STRS = ["", " ", "\ud800", "a\udfffb", "Paris", "x" * 2000, "\x00", "é", "😀", "req-0"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(SPECIAL_INTS),
    st.floats(),
    st.sampled_from(SPECIAL_FLOATS),
    st.text(st.characters(codec=None, exclude_categories=()), max_size=6),  # surrogates included
    st.sampled_from(SPECIAL_STRS),
    st.binary(max_size=3),
)
wild = st.one_of(
    scalars,
    st.lists(scalars, max_size=3),
    st.tuples(scalars),
    st.dictionaries(st.text(max_size=3), scalars, max_size=2),
    st.sets(st.integers(0, 3), max_size=2),
)
printable = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=4)
small_floats = st.floats(-3, 3)
near_valid: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(-2, 8) | st.sampled_from([2**31, 2**31 + 1]),
    "min_tokens": st.integers(-1, 20) | st.just(2**31),
    "temperature": st.floats(-1, 3) | st.sampled_from(SPECIAL_FLOATS),
    "top_k": st.integers(-1, 200) | st.just(2**31),
    "top_p": st.floats(-0.5, 1.5) | st.sampled_from(SPECIAL_FLOATS),
    "min_p": st.floats(-0.5, 1.5),
    "repetition_penalty": st.floats(-1, 3) | st.sampled_from(SPECIAL_FLOATS),
    "presence_penalty": small_floats,
    "frequency_penalty": small_floats,
    "seed": st.integers(-1, 2**64) | st.none(),
    "stop": st.lists(printable, max_size=3) | printable | st.lists(st.sampled_from(SPECIAL_STRS), max_size=2),
    "stop_token_ids": st.lists(st.integers(-1, 120), max_size=4),
    "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(),
    "logprobs": st.none() | st.integers(-1, 25) | st.booleans(),
    "top_logprobs": st.integers(-1, 25),
    "prompt_logprobs": st.none() | st.integers(-1, 25),
    "logit_bias": st.dictionaries(st.integers(-1, 120), st.floats(-150, 150) | st.sampled_from(SPECIAL_FLOATS),
                                  max_size=3),
    "allowed_token_ids": st.none() | st.lists(st.integers(-1, 120), max_size=4),
    "n": st.integers(-1, 4),
    "thinking_budget": st.none() | st.integers(-1, 10),
    "skip_special_tokens": st.booleans(),
    "deadline": st.none() | st.floats(-1, 2) | st.sampled_from([1e-300, 1e9, 1e9 + 1, 1e12]),
    "request_id": st.none() | st.text(max_size=5),
    "priority": st.integers(-(2**31) - 1, 2**31) | st.integers(),
    "cache_salt": st.text(max_size=5),
}
chat_message = st.dictionaries(st.sampled_from(["role", "content", "name"]), st.one_of(printable, scalars), max_size=3)
prompts = st.one_of(
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=70),
    st.text(max_size=6),
    st.lists(st.integers(-2, 100) | st.booleans(), max_size=70),
    st.lists(chat_message, min_size=1, max_size=2),
    st.just([{"role": "user", "content": "hi"}]),
    wild,
)


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, str, Any]:
    """(kind, name, value): one public parameter with a drawn value, every other one valid."""
    kind = draw(st.sampled_from(["field", "field", "field", "kwarg", "kwarg", "prompt", "params", "cancel"]))
    if kind in ("field", "kwarg"):
        name = draw(st.sampled_from(FIELDS if kind == "field" else KWARGS))
        plausible = draw(st.integers(0, 2)) > 0  # two in three near the valid range, so many cases run
        return kind, name, draw(near_valid.get(name, wild) if plausible else wild)  # a new field: wild values
    if kind == "prompt":
        return kind, "prompt", draw(prompts)
    if kind == "params":
        return kind, "params", draw(wild)
    value = draw(st.text(max_size=5) | wild)
    assume(not (isinstance(value, str) and value.startswith("norm-")))
    return kind, "request_id", value


# -- one case ------------------------------------------------------------------------------------------------------
async def _normal(engine: Engine, rid: str, seed: int, results: dict[str, Any]) -> None:
    results[rid] = await engine.complete("hello", SamplingParams(max_tokens=NORMAL_TOKENS, seed=seed,
                                                                   ignore_eos=True), request_id=rid)


async def _wild_request(engine: Engine, case: tuple[str, str, Any], entry: str) -> str:
    """Submit the case; return how it ended ("rejected" or the finish reason). Anything else propagates."""
    kind, name, value = case
    try:
        if kind == "cancel":
            await engine.cancel(value)
            return "cancel"
        prompt: Any = "abc"
        params: Any = SamplingParams(max_tokens=3, seed=1)
        kwargs: dict[str, Any] = {}
        if kind == "field":
            params = SamplingParams(**{name: value})
        elif kind == "params":
            params = value
        elif kind == "prompt":
            prompt = value
        else:
            kwargs[name] = value
        frames = []
        if entry == "complete":
            frames.append(await engine.complete(prompt, params, **kwargs))
        elif entry == "stream":
            async with engine.stream(prompt, params, **kwargs) as stream:
                frames = [out async for out in stream]
        else:
            frames = [out async for out in engine.generate(prompt, params, **kwargs)]
    except RequestRejected as exc:
        assert name in str(exc), f"the rejection of {name}={value!r} does not name it: {exc}"
        return "rejected"
    last = frames[-1]
    assert last.finished and last.finish_reason is not None
    assert last.finish_reason != "error", f"{name}={value!r} was accepted, then failed: {last.error}"
    return last.finish_reason


async def _at_baseline(engine: Engine) -> dict[str, Any]:
    """Wait (virtual time) until nothing is open; return the stats then."""
    rt = engine.runtime
    for _ in range(200):
        s = engine.stats()
        if (s["waiting"] == s["running"] == s["preempted"] == s["swapped"] == 0
                and s["blocks_free"] + s["blocks_cached"] == s["blocks_total"] and not rt.live
                and rt.free_slots == rt.core_config.max_waiting and rt.retire.open_streams == 0):
            return s
        await trio.sleep(0.01)
    raise AssertionError(f"the engine did not return to its baseline: {engine.stats()}, live={rt.live}, "
                         f"free slots {rt.free_slots}/{rt.core_config.max_waiting}")


async def _run_cases(log: Path, batch: list[tuple[tuple[str, str, Any], str]], outcomes: Counter[str]) -> None:
    async with Engine.open(stub_config(log, max_seq_len=MAX_SEQ_LEN)) as engine:
        await _at_baseline(engine)
        for n, (case, entry) in enumerate(batch):
            results: dict[str, Any] = {}
            async with trio.open_nursery() as nursery:
                for k in range(2):
                    nursery.start_soon(_normal, engine, f"norm-{n}-{k}", n * 2 + k, results)
                await trio.sleep(0)
                outcome = await _wild_request(engine, case, entry)
            outcomes["rejected" if outcome == "rejected" else "accepted"] += 1
            outcomes[f"{case[0]}:{outcome}"] += 1
            for rid, out in results.items():
                assert out.finish_reason == "length" and len(out.token_ids) == NORMAL_TOKENS, (rid, out, case)
            assert len(results) == 2
            await _at_baseline(engine)


def test_arbitrary_public_inputs_are_rejected_cleanly_or_run_and_replay(tmp_path: Path) -> None:
    outcomes: Counter[str] = Counter()
    runs = 0

    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
    @given(st.lists(st.tuples(cases(), st.sampled_from(["generate", "stream", "complete"])), min_size=1,
                    max_size=6))
    def check(batch: list[tuple[tuple[str, str, Any], str]]) -> None:
        nonlocal runs
        runs += 1
        log = Path(tempfile.mkdtemp(dir=tmp_path)) / "run.tlog"  # a fresh path per engine
        trio.run(_run_cases, log, batch, outcomes, clock=trio.testing.MockClock(autojump_threshold=0))
        assert_replays(log)

    check()
    cases_drawn = outcomes["rejected"] + outcomes["accepted"]
    print(f"\n{cases_drawn} bad-input cases in {runs} engine runs: {dict(sorted(outcomes.items()))}")
    assert outcomes["rejected"] > 0 and outcomes["accepted"] > 0


# -- SamplingParams ------------------------------------------------------------------------------------------------
def test_a_str_stop_is_one_stop_string() -> None:
    assert SamplingParams(stop="Paris") == SamplingParams(stop=["Paris"])
    assert SamplingParams(stop="Paris").stop == ["Paris"]
    assert SamplingParams(stop="Paris").to_spec().stop == ["Paris"]


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("max_tokens", 2**31 + 1), ("max_tokens", True), ("max_tokens", 1.0), ("max_tokens", "3"),
    ("min_tokens", -1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.5),
    ("temperature", True), ("top_k", -1), ("top_p", 0.0), ("top_p", math.nan), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", math.inf), ("presence_penalty", 2.5),
    ("frequency_penalty", math.nan), ("seed", -1), ("seed", 2**63), ("seed", 1.5), ("stop", [""]),
    ("stop", ["ok", 3]), ("stop", ["\ud800"]), ("stop", "x" * 1025), ("stop", ["s"] * 129), ("stop", None),
    ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("stop_token_ids", [2**31]), ("stop_token_ids", 3),
    ("include_stop_str_in_output", 1), ("ignore_eos", "yes"), ("logprobs", True), ("logprobs", 21),
    ("prompt_logprobs", -1), ("logit_bias", {1: 100.5}), ("allowed_token_ids", []), ("n", 0), ("n", 129),
    ("thinking_budget", -1), ("skip_special_tokens", 0),
    ("max_tokens", "\ud800"), ("stop_token_ids", ["\udc00"]), ("seed", {"\ud800": 1}),  # msgspec would raise
])
def test_each_bad_field_is_rejected_naming_it(field: str, value: Any) -> None:
    with pytest.raises(RequestRejected, match=field):
        SamplingParams(**{field: value})


def test_cross_field_and_normalisation() -> None:
    with pytest.raises(RequestRejected, match="min_tokens=5 must not exceed max_tokens=4"):
        SamplingParams(max_tokens=4, min_tokens=5)
    p = SamplingParams(temperature=0, top_p=1, stop=("a", "b"))
    assert type(p.temperature) is float and type(p.top_p) is float and p.stop == ["a", "b"]
    ids = [1, 2]
    p = SamplingParams(stop_token_ids=ids)
    ids.append(-5)
    assert p.stop_token_ids == [1, 2], "the params hold their own copy"
    edge = SamplingParams(max_tokens=2**31, seed=2**63 - 1, top_k=2**31, temperature=1e-300, top_p=5e-324,
                          repetition_penalty=1.7e308, logprobs=20)
    assert edge.to_spec().max_tokens == 2**31


# -- the request arguments -----------------------------------------------------------------------------------------
async def test_request_arguments_are_checked(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log, max_seq_len=MAX_SEQ_LEN)) as engine:
        bad: list[tuple[str, dict[str, Any], Any]] = [
            ("deadline", {"deadline": math.nan}, "hi"), ("deadline", {"deadline": math.inf}, "hi"),
            ("deadline", {"deadline": 0}, "hi"), ("deadline", {"deadline": 1e10}, "hi"),
            ("deadline", {"deadline": True}, "hi"), ("deadline", {"deadline": "1"}, "hi"),
            ("request_id", {"request_id": ""}, "hi"), ("request_id", {"request_id": "x" * 257}, "hi"),
            ("request_id", {"request_id": "\ud800"}, "hi"), ("request_id", {"request_id": 3}, "hi"),
            ("priority", {"priority": True}, "hi"), ("priority", {"priority": 2**31}, "hi"),
            ("priority", {"priority": 1.0}, "hi"), ("cache_salt", {"cache_salt": None}, "hi"),
            ("cache_salt", {"cache_salt": "\udc00"}, "hi"), ("cache_salt", {"cache_salt": "s" * 1025}, "hi"),
            ("prompt", {}, "caf\ud800"), ("prompt", {}, [1, True, 2]), ("prompt", {}, [1, -1]),
            ("prompt", {}, [1, 96]), ("prompt", {}, [1, 2**70]), ("prompt", {}, [1.0]), ("prompt", {}, None),
            ("prompt", {}, b"hi"), ("prompt", {}, []), ("prompt", {}, ""), ("prompt", {}, {"role": "user"}),
            ("prompt", {}, [{"role": "user"}]), ("prompt", {}, [{"content": "hi"}]),
            ("prompt", {}, [{"role": "user", "content": None}]), ("prompt", {}, [{"role": 1, "content": "x"}]),
            ("prompt", {}, [{"role": "user", "content": "\ud800"}]), ("prompt", {}, "x" * 100),
            ("prompt", {}, [{"role": "user", "content": "hi", "name": ["\ud800"]}]),
            ("prompt", {}, [{"role": "user", "content": "hi", "\ud800": 1}]), ("prompt", {}, ["\ud800"]),
            ("priority", {"priority": "\ud800"}, "hi"), ("deadline", {"deadline": ["\ud800"]}, "hi"),
        ]
        for name, kwargs, prompt in bad:
            with pytest.raises(RequestRejected, match=name):
                engine.generate(prompt, SamplingParams(max_tokens=2), **kwargs)
        with pytest.raises(RequestRejected, match="stop_token_ids contains 96, outside vocab_size=96"):
            engine.generate("hi", SamplingParams(stop_token_ids=[96]))
        with pytest.raises(RequestRejected, match="params must be SamplingParams"):
            engine.generate("hi", {"max_tokens": 3})  # type: ignore[arg-type]
        with pytest.raises(RequestRejected, match="has no 'content'"):
            engine.generate([{"role": "user"}])
        for rid in ("", "\ud800", None, 5):
            with pytest.raises(RequestRejected, match="request_id"):
                await engine.cancel(rid)  # type: ignore[arg-type]
        mutated = SamplingParams(stop=["ok"])
        mutated.stop.append("")  # type: ignore[union-attr]
        with pytest.raises(RequestRejected, match="stop"):
            engine.generate("hi", mutated)
        # Accepted extremes run and finish.
        out = await engine.complete("hi", SamplingParams(max_tokens=2**31, seed=2**63 - 1), deadline=1e9,
                                    priority=-(2**31), request_id="x" * 256, cache_salt="s" * 1024)
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_SEQ_LEN - 2
        out = await engine.complete("hi", SamplingParams(max_tokens=3), deadline=1e-300)
        assert out.finish_reason == "timeout"
        # A caller's own id that looks like a generated one does not make a generated one collide.
        probe = engine.generate("hi", SamplingParams(max_tokens=2))  # never started: takes the next req-N
        upcoming = f"req-{int(probe.request_id.removeprefix('req-')) + 1}"
        async with engine.stream("hi", SamplingParams(max_tokens=50), request_id=upcoming) as s1:
            await s1.start()
            s2 = engine.generate("hi", SamplingParams(max_tokens=2))
            assert s2.request_id != s1.request_id
            assert (await engine.complete("hi", SamplingParams(max_tokens=2))).finish_reason == "length"
        await _at_baseline(engine)
    with LogReader(log) as reader:
        arrivals = [i for t in reader.ticks() for i in t.inputs.inputs if isinstance(i, RequestArrived)]
    assert all(a.deadline_ns is None or a.deadline_ns < 2**63 for a in arrivals)
    assert_replays(log)


async def test_a_submit_cancelled_before_the_arrival_is_sent_leaks_nothing(
        tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log)) as engine:
        rt = engine.runtime
        real_send = rt.client.send
        monkeypatch.setattr(rt.client, "send", lambda _msg: trio.sleep_forever())  # an inbox that stays full
        with trio.move_on_after(1.0) as scope:
            async with engine.stream("hi", SamplingParams(max_tokens=3), request_id="stuck"):
                pytest.fail("the submit cannot finish")
        assert scope.cancelled_caught
        assert not rt.live and rt.free_slots == rt.core_config.max_waiting and rt.retire.open_streams == 0
        monkeypatch.setattr(rt.client, "send", real_send)
        out = await engine.complete("hi", SamplingParams(max_tokens=3), request_id="stuck")
        assert out.finish_reason == "length", "the id is free again, and no stale ClientGone cancels it"
        await _at_baseline(engine)
    assert_replays(log)


async def test_a_chat_template_error_is_a_rejection(tmp_path: Path, autojump_clock: trio.testing.MockClock,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    async with Engine.open(stub_config(tmp_path / "run.tlog")) as engine:
        for error in (ValueError("the template raised"), KeyError("role"), TypeError("not a str")):
            def broken(messages: Any, add_generation_prompt: bool = True, error: Exception = error) -> str:
                raise error

            monkeypatch.setattr(engine.tokenizer, "render_chat", broken)
            with pytest.raises(RequestRejected, match="prompt's chat messages cannot be rendered"):
                engine.generate([{"role": "user", "content": "hi"}])
        assert engine.stats()["waiting"] == 0  # nothing was submitted


# -- EngineConfig --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [
    ("model", ""), ("model", 3), ("dtype", "float8"), ("device", ""), ("threads", 0), ("num_blocks", 0),
    ("num_blocks", True), ("num_blocks", 2**40), ("kv_memory_bytes", -1), ("block_size", 0),
    ("max_batch_size", 0), ("max_seq_len", 1), ("max_prefill_tokens", 0), ("max_batch_tokens", 1.5),
    ("admit_watermark", -1), ("pipeline_depth", 3), ("preempt_immunity_tokens", -1), ("prefix_caching", 1),
    ("max_waiting", -1), ("overload", "drop"), ("spill_dir", ""), ("host_spill_bytes", -1),
    ("log_path", "\ud800"), ("fsync", "0ms"), ("fsync", "always"), ("fsync", "never\n"), ("fsync", "١ms"),
    ("snapshot_every", -1), ("think_start_token", -1), ("stub_vocab_size", 95), ("stub_step_time", math.nan),
    ("stub_step_time", -1.0), ("faults", 3), ("faults", {"crash_after": math.inf}),
])
def test_each_bad_config_field_is_a_config_error_naming_it(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: value})


def test_config_cross_checks_and_fault_plans() -> None:
    with pytest.raises(ConfigError, match="think_start_token"):
        EngineConfig(think_start_token=3)
    with pytest.raises(ConfigError, match="crash_actor"):
        FaultPlan(crash_actor="nobody")
    with pytest.raises(ConfigError, match="fail_steps"):
        FaultPlan(fail_steps=[-1])
    with pytest.raises(ConfigError, match="report_delay"):
        FaultPlan(report_delay=math.nan)
    config = EngineConfig(model="stub", stub_step_time=0, faults={"fail_steps": (3,)})  # type: ignore[arg-type]
    assert config.faults == FaultPlan(fail_steps=[3]) and type(config.stub_step_time) is float


CONFIG_FIELDS = [f.name for f in msgspec.structs.fields(EngineConfig)]


@settings(max_examples=300, deadline=None, database=None)
@given(st.sampled_from(CONFIG_FIELDS), wild | st.integers(-2, 5000) | st.floats(-1, 10) | st.text(max_size=6))
def test_arbitrary_config_values_are_a_config_error_naming_the_field_or_encode(field: str, value: Any) -> None:
    try:
        config = EngineConfig(**{field: value})
    except ConfigError as exc:
        assert field in str(exc), str(exc)
        return
    msgspec.json.encode(config)  # the log header holds it
    assert EngineConfig(**msgspec.structs.asdict(config)) == config
