"""``tickloom serve``: the OpenAI-compatible server, driven by the real ``openai`` SDK (sync in a worker thread,
async with ``asyncio.run`` in a worker thread) against a server in this trio run, on the real clock, on loopback.
Every server's log replays ``identical``."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.engine_helpers import assert_replays, core_finishes
from tickloom import Engine, EngineConfig, FaultPlan, SamplingParams
from tickloom.events import LogReader, RequestArrived
from tickloom.tools.serve.openai_types import error_param
from tickloom.tools.serve.server import ServeOptions, default_log_path, serve

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "Say hi"}]


@dataclass
class Server:
    url: str
    log: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(api_key="unused", base_url=f"{self.url}/v1", max_retries=0, timeout=30.0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(api_key="unused", base_url=f"{self.url}/v1", max_retries=0, timeout=30.0)

    async def call(self, fn: Callable[[openai.OpenAI], T]) -> T:
        """Run ``fn(client)`` in a worker thread (the SDK's sync client blocks)."""

        def go() -> T:
            with self.client() as client:
                return fn(client)

        return await trio.to_thread.run_sync(go)

    async def http(self, fn: Callable[[httpx.Client], T]) -> T:
        def go() -> T:
            with httpx.Client(base_url=self.url, timeout=30.0) as client:
                return fn(client)

        return await trio.to_thread.run_sync(go)


def stub(log: Path, **kw: Any) -> EngineConfig:
    base: dict[str, Any] = dict(model="stub", log_path=str(log), num_blocks=256, max_seq_len=256,
                                stub_step_time=0.005, max_batch_size=16)
    base.update(kw)
    return EngineConfig(**base)


@asynccontextmanager
async def running(config: EngineConfig, **options: Any) -> AsyncIterator[Server]:
    """A server on 127.0.0.1 (a free port) in a nursery; on exit it drains and stops, and its log must replay."""
    assert config.log_path is not None
    shutdown = trio.Event()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(functools.partial(serve, config, ServeOptions(port=0, **options),
                                                          shutdown=shutdown))
            assert binds and binds[0].startswith("http://127.0.0.1:")
            yield Server(binds[0], Path(config.log_path))
            shutdown.set()
    assert_replays(Path(config.log_path))


def chat_text(client: openai.OpenAI, **kw: Any) -> str:
    r = client.chat.completions.create(model="stub", messages=CHAT, **kw)  # type: ignore[arg-type]
    return r.choices[0].message.content or ""


# -- the endpoints -----------------------------------------------------------------------------------------------


async def test_models_health_and_metrics(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog")) as srv:
        models = await srv.call(lambda c: [m.id for m in c.models.list()])
        assert models == ["stub"]
        health = await srv.http(lambda c: c.get("/health"))
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        await srv.call(lambda c: c.completions.create(model="stub", prompt="Hello", max_tokens=6, seed=1))
        text = await srv.http(lambda c: c.get("/metrics").text)
        families = {f.name: f for f in text_string_to_metric_families(text)}
        for name in ("tickloom_queue_requests", "tickloom_kv_blocks", "tickloom_engine_tokens",
                     "tickloom_engine_preemptions", "tickloom_engine_swaps", "tickloom_time_to_first_token_seconds",
                     "tickloom_inter_token_latency_seconds", "tickloom_requests_finished", "tickloom_http_requests"):
            assert name in families, name
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
        model = ("model", "stub")
        assert samples[("tickloom_time_to_first_token_seconds_count", (model,))] == 1
        assert samples[("tickloom_requests_finished_total", (("finish_reason", "length"), model))] == 1
        assert samples[("tickloom_kv_blocks", (model, ("state", "total")))] == 256
        assert samples[("tickloom_engine_tokens_total", (model,))] >= 6
        missing = await srv.http(lambda c: c.get("/v1/nothing"))
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


async def test_completions_streamed_and_whole_agree(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog")) as srv:
        def both(c: openai.OpenAI) -> tuple[Any, list[Any]]:
            whole = c.completions.create(model="stub", prompt="Once upon", max_tokens=12, seed=7)
            chunks = list(c.completions.create(model="stub", prompt="Once upon", max_tokens=12, seed=7, stream=True,
                                               stream_options={"include_usage": True}))
            return whole, chunks

        whole, chunks = await srv.call(both)
        assert whole.object == "text_completion" and len(whole.choices) == 1
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage is not None and whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens == 9
        streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert streamed == whole.choices[0].text and len(streamed) == 12  # the stub: one character per token
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 12
        finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert finishes == ["length"]


async def test_chat_streamed_include_usage_and_whole(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog")) as srv:
        def both(c: openai.OpenAI) -> tuple[Any, list[Any], list[Any]]:
            whole = c.chat.completions.create(model="stub", messages=CHAT, max_completion_tokens=10, seed=3)
            with_usage = list(c.chat.completions.create(model="stub", messages=CHAT, max_tokens=10, seed=3,
                                                        stream=True, stream_options={"include_usage": True}))
            without = list(c.chat.completions.create(model="stub", messages=CHAT, max_tokens=10, seed=3, stream=True))
            return whole, with_usage, without

        whole, chunks, plain = await srv.call(both)
        assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
        text = whole.choices[0].message.content
        assert text and len(text) == 10 and whole.choices[0].finish_reason == "length"
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
        assert all(ch.usage is None for ch in plain) and all(ch.choices for ch in plain)
        assert "".join(ch.choices[0].delta.content or "" for ch in plain) == text


async def test_chat_content_parts_and_roles(tmp_path: Path) -> None:
    """Text content parts are joined; ``developer`` is rendered as ``system``."""
    async with running(stub(tmp_path / "s.tlog")) as srv:
        def go(c: openai.OpenAI) -> tuple[Any, Any]:
            parts = c.chat.completions.create(model="stub", max_tokens=8, seed=4, messages=[
                {"role": "developer", "content": "Be brief"},
                {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}])
            plain = c.chat.completions.create(model="stub", max_tokens=8, seed=4, messages=[
                {"role": "system", "content": "Be brief"}, {"role": "user", "content": "Say hi"}])
            return parts, plain

        parts, plain = await srv.call(go)
        assert parts.choices[0].message.content == plain.choices[0].message.content
        assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


async def test_seed_reproducibility_and_n(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog")) as srv:
        def go(c: openai.OpenAI) -> dict[str, Any]:
            return {
                "a": chat_text(c, max_tokens=16, seed=11), "b": chat_text(c, max_tokens=16, seed=11),
                "c": chat_text(c, max_tokens=16, seed=12),
                "n": c.chat.completions.create(model="stub", messages=CHAT, max_tokens=16, seed=11, n=2),
                "n_stream": list(c.chat.completions.create(model="stub", messages=CHAT, max_tokens=16, seed=11, n=2,
                                                           stream=True, stream_options={"include_usage": True})),
                "batch": c.completions.create(model="stub", prompt=["ab", "cd"], max_tokens=4, seed=5, n=2),
            }

        r = await srv.call(go)
        assert r["a"] == r["b"] != r["c"]
        choices = sorted(r["n"].choices, key=lambda ch: ch.index)
        assert [ch.message.content for ch in choices] == [r["a"], r["c"]]  # choice i is seeded seed + i
        assert r["n"].usage.completion_tokens == 32
        streamed: dict[int, str] = {0: "", 1: ""}
        for chunk in r["n_stream"]:
            for ch in chunk.choices:
                streamed[ch.index] += ch.delta.content or ""
        assert streamed == {0: r["a"], 1: r["c"]}
        assert r["n_stream"][-1].usage.completion_tokens == 32
        batch = r["batch"]
        assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
        assert batch.usage.prompt_tokens == 4 and batch.usage.completion_tokens == 16
    # One path makes the n choices: the engine's n, one request per prompt whose choices are logged <id>/<j>, seeded
    # seed + j; the server does not fan out requests of its own.
    with LogReader(tmp_path / "s.tlog") as reader:
        arrivals = [i for t in reader.ticks() for i in t.inputs.inputs if isinstance(i, RequestArrived)]
    chat_n = [a for a in arrivals if a.request_id.startswith("chatcmpl-") and "/" in a.request_id]
    assert sorted((a.request_id.rsplit("-", 1)[1], a.seed) for a in chat_n) == [("0/0", 11), ("0/0", 11), ("0/1", 12),
                                                                         ("0/1", 12)]
    batch_ids = sorted(a.request_id.rsplit("-", 1)[1] for a in arrivals if a.request_id.startswith("cmpl-"))
    assert batch_ids == ["0/0", "0/1", "1/0", "1/1"]
    assert {a.seed for a in arrivals if a.request_id.startswith("cmpl-")} == {5, 6}


async def test_stop_strings(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog")) as srv:
        def go(c: openai.OpenAI) -> tuple[str, Any, Any, Any]:
            free = c.completions.create(model="stub", prompt="x", max_tokens=20, seed=21).choices[0].text
            stop = free[8]
            one = c.completions.create(model="stub", prompt="x", max_tokens=20, seed=21, stop=stop)
            many = c.chat.completions.create(model="stub", messages=CHAT, max_tokens=20, seed=21,
                                             stop=[stop, "~~~~"], stream=True)
            return free, one, list(many), stop

        free, one, many, stop = await srv.call(go)
        cut = free[: free.index(stop)]
        assert one.choices[0].text == cut and one.choices[0].finish_reason == "stop"
        streamed = "".join(ch.choices[0].delta.content or "" for ch in many if ch.choices)
        assert stop not in streamed
        assert [ch.choices[0].finish_reason for ch in many if ch.choices[0].finish_reason] == ["stop"]


async def test_logprobs_shape_on_the_stub(tmp_path: Path) -> None:
    """The stub's oracle is a distribution too: each token has its logprob and its top alternatives, best first."""
    async with running(stub(tmp_path / "s.tlog")) as srv:
        def go(c: openai.OpenAI) -> tuple[Any, Any, Any]:
            chat = c.chat.completions.create(model="stub", messages=CHAT, max_tokens=5, seed=1, logprobs=True,
                                             top_logprobs=2)
            plain = c.chat.completions.create(model="stub", messages=CHAT, max_tokens=5, seed=1, logprobs=True)
            comp = c.completions.create(model="stub", prompt="hello", max_tokens=5, seed=1, logprobs=3)
            return chat, plain, comp

        chat, plain, comp = await srv.call(go)
        content = chat.choices[0].logprobs.content
        assert "".join(t.token for t in content) == chat.choices[0].message.content
        for t in content:
            assert isinstance(t.logprob, float) and t.logprob <= 0.0
            assert len(t.top_logprobs) == 2
            assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
            assert t.top_logprobs[0].logprob >= t.logprob  # the best alternative is at least as likely
            assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob  # the stub is greedy
        assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content), "top_logprobs defaults to 0"
        lp = comp.choices[0].logprobs
        assert len(lp.top_logprobs) == len(lp.tokens) == 5
        for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert 1 <= len(top) <= 4 and top[token] == token_lp, "up to logprobs + 1 entries, the sampled one in"


async def test_logit_bias_through_the_sdk(tmp_path: Path) -> None:
    """OpenAI's string-keyed ``logit_bias`` reaches the sampler: +100 forces a token, -100 bans it; bad keys, values
    and ids are 400s naming ``logit_bias``."""
    async with running(stub(tmp_path / "s.tlog")) as srv:
        def go(c: openai.OpenAI) -> tuple[str, str, str, list[Any]]:
            free = chat_text(c, max_tokens=8, seed=4)
            forced = chat_text(c, max_tokens=8, seed=4, logit_bias={str(ord("q") - 32): 100})
            banned = chat_text(c, max_tokens=8, seed=4, logit_bias={str(ord(ch) - 32): -100 for ch in set(free)})
            errors = []
            for bias in ({"x": 1}, {"5": 101}, {"5000": 1}):
                try:
                    c.completions.create(model="stub", prompt="x", max_tokens=2, logit_bias=bias)  # type: ignore[arg-type]
                except openai.BadRequestError as exc:
                    errors.append(exc.body)
            return free, forced, banned, errors

        free, forced, banned, errors = await srv.call(go)
        assert forced == "q" * 8
        assert len(banned) == 8 and not set(banned) & set(free)
        assert len(errors) == 3 and all(e["param"] == "logit_bias" for e in errors), errors


async def test_logprobs_on_a_real_model(tmp_path: Path) -> None:
    from tickloom.engine.model.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", dtype="float64", seed=3)
    config = EngineConfig(model=str(model), dtype="float64", max_seq_len=128, num_blocks=64,
                          log_path=str(tmp_path / "tiny.tlog"))
    async with running(config, model_name="tiny") as srv:
        def go(c: openai.OpenAI) -> tuple[Any, Any, list[Any], list[Any]]:
            chat = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, seed=2, logprobs=True,
                                             top_logprobs=3, extra_body={"ignore_eos": True})
            chat_stream = list(c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, seed=2,
                                                         logprobs=True, stream=True, extra_body={"ignore_eos": True}))
            comp = c.completions.create(model="tiny", prompt="hello", max_tokens=6, seed=2, logprobs=2,
                                        extra_body={"ignore_eos": True})
            stream = list(c.completions.create(model="tiny", prompt="hello", max_tokens=6, seed=2, logprobs=2,
                                               stream=True, extra_body={"ignore_eos": True}))
            return chat, comp, stream, chat_stream

        chat, comp, stream, chat_stream = await srv.call(go)
        content = chat.choices[0].logprobs.content
        assert len(content) == 6
        for t in content:
            tops = [a.logprob for a in t.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            assert t.logprob in tops or t.logprob <= tops[-1], "the sampled token is a top one, or less likely"
        streamed_chat = [t for ch in chat_stream if ch.choices and ch.choices[0].logprobs
                         for t in ch.choices[0].logprobs.content]
        assert [(t.token, t.logprob) for t in streamed_chat] == [(t.token, t.logprob) for t in content]
        assert all(isinstance(t.logprob, float) and t.logprob <= 0.0 and math.isfinite(t.logprob) for t in content)
        lp = comp.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 6
        assert all(isinstance(x, float) and x <= 0.0 for x in lp.token_logprobs)
        assert lp.text_offset[0] == 0
        streamed = [x for ch in stream if ch.choices and ch.choices[0].logprobs
                    for x in ch.choices[0].logprobs.token_logprobs]
        assert streamed == lp.token_logprobs  # same seed, same tokens, same logprobs
    # Engine.complete keeps the logprobs too (one per token), and they are the server's.
    config = EngineConfig(model=str(model), dtype="float64", max_seq_len=128, num_blocks=64,
                          log_path=str(tmp_path / "complete.tlog"))
    async with Engine.open(config) as engine:
        out = await engine.complete("hello", SamplingParams(max_tokens=6, seed=2, logprobs=0, ignore_eos=True))
    assert out.logprobs == lp.token_logprobs and len(out.token_ids) == 6
    assert_replays(tmp_path / "complete.tlog")


async def test_concurrent_clients_sync_and_async(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog")) as srv:
        texts: dict[int, str] = {}

        async def sync_one(i: int) -> None:
            texts[i] = await srv.call(lambda c: chat_text(c, max_tokens=24, seed=100 + i))

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(sync_one, i)

        async def async_clients() -> list[str]:
            async with srv.async_client() as client:
                async def one(i: int) -> str:
                    stream = await client.chat.completions.create(model="stub", messages=CHAT,  # type: ignore[arg-type]
                                                                  max_tokens=24, seed=100 + i, stream=True)
                    return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

                return list(await asyncio.gather(*(one(i) for i in range(8))))

        streamed = await trio.to_thread.run_sync(lambda: asyncio.run(async_clients()))
        assert streamed == [texts[i] for i in range(8)]
        assert len(set(streamed)) == 8 and all(len(t) == 24 for t in streamed)


def leave_after(c: httpx.Client, events: int) -> str:
    """A streamed chat of 200 tokens left after ``events`` events; its response id."""
    body = {"model": "stub", "messages": CHAT, "max_tokens": 200, "stream": True}
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        seen: list[dict[str, Any]] = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line[6:]))
            if len(seen) == events:
                break
    return str(seen[0]["id"])


async def test_disconnect_mid_stream_cancels_the_request(tmp_path: Path) -> None:
    config = stub(tmp_path / "s.tlog", stub_step_time=0.05)
    async with running(config) as srv:
        rid = await srv.http(functools.partial(leave_after, events=3))
        with trio.fail_after(10):
            while True:
                text = await srv.http(lambda c: c.get("/metrics").text)
                if 'tickloom_client_disconnects_total{model="stub"} 1.0' in text and 'reason="cancelled"' in text:
                    break
                await trio.sleep(0.05)
    finish = core_finishes(srv.log)[f"{rid}-0"]
    assert finish.reason == "cancelled" and finish.usage.completion_tokens < 200


async def test_timeouts_from_the_request_and_the_server(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog", stub_step_time=0.02), request_timeout=0.2) as srv:
        def go(c: openai.OpenAI) -> tuple[Any, Any, Any]:
            own = c.chat.completions.create(model="stub", messages=CHAT, max_tokens=200, extra_body={"timeout": 0.1})
            default = c.chat.completions.create(model="stub", messages=CHAT, max_tokens=200)
            roomy = c.chat.completions.create(model="stub", messages=CHAT, max_tokens=3, extra_body={"timeout": 60})
            return own, default, roomy

        own, default, roomy = await srv.call(go)
        assert own.choices[0].finish_reason == "timeout" and default.choices[0].finish_reason == "timeout"
        assert own.usage.completion_tokens < 200 and default.usage.completion_tokens < 200
        assert roomy.choices[0].finish_reason == "length"


# -- errors ------------------------------------------------------------------------------------------------------


async def test_errors_are_openai_json_naming_the_field(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog")) as srv:
        def expect(fn: Callable[[openai.OpenAI], Any], kind: type[openai.APIStatusError]) -> openai.APIStatusError:
            with pytest.raises(kind) as info:
                srv_client = srv.client()
                try:
                    fn(srv_client)
                finally:
                    srv_client.close()
            return info.value

        def go(_: openai.OpenAI) -> list[openai.APIStatusError]:
            return [
                expect(lambda c: chat_text(c, temperature=-1), openai.BadRequestError),  # the schema's bound
                expect(lambda c: chat_text(c, top_p=0.0), openai.BadRequestError),  # the engine's bound
                expect(lambda c: chat_text(c, max_tokens=2, extra_body={"min_tokens": 5}), openai.BadRequestError),
                expect(lambda c: chat_text(c, max_completion_tokens=0), openai.BadRequestError),
                expect(lambda c: c.completions.create(model="stub", prompt=[], max_tokens=2),
                       openai.BadRequestError),  # an empty prompt
                expect(lambda c: c.completions.create(model="stub", prompt="x", logprobs=21), openai.BadRequestError),
                expect(lambda c: c.chat.completions.create(model="stub", messages=[{"role": "wizard",  # type: ignore
                                                                                    "content": "x"}]),
                       openai.BadRequestError),
                expect(lambda c: chat_text(c, logit_bias={"1": 200.0}), openai.BadRequestError),  # out of [-100, 100]
                expect(lambda c: c.chat.completions.create(model="gpt-4o", messages=CHAT),  # type: ignore[arg-type]
                       openai.NotFoundError),
            ]

        errors = await srv.call(go)
        params = [e.param for e in errors]
        assert params == ["temperature", "top_p", "min_tokens", "max_completion_tokens", "prompt", "logprobs",
                          "messages[0].role", "logit_bias", "model"]
        assert all(e.type == "invalid_request_error" for e in errors[:-1])
        assert errors[-1].status_code == 404 and errors[-1].code == "model_not_found"
        for e in errors:
            assert isinstance(e.body, dict) and set(e.body) == {"message", "type", "param", "code"}

        def raw(c: httpx.Client) -> list[httpx.Response]:
            return [c.post("/v1/chat/completions", content=b"{not json"),
                    c.post("/v1/completions", json={"prompt": "x"}),
                    c.post("/v1/completions", json={"model": "stub", "prompt": ["a", 1]}),
                    c.post("/v1/completions", content=b""),
                    c.post("/v1/completions", json={"model": "stub", "prompt": ["a"] * 9, "n": 128})]

        bad_json, no_model, mixed, empty, too_many = await srv.http(raw)
        for r in (bad_json, no_model, mixed, empty, too_many):
            assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert no_model.json()["error"]["param"] == "model" and mixed.json()["error"]["param"] == "prompt"
        assert too_many.json()["error"]["param"] == "n"


async def test_overload_is_503_and_a_failed_request_is_500(tmp_path: Path) -> None:
    config = stub(tmp_path / "s.tlog", stub_step_time=0.02, max_batch_size=1, max_waiting=1, overload="reject",
                  faults=FaultPlan(fail_steps=[1]))
    async with running(config) as srv:
        with pytest.raises(openai.InternalServerError) as failed:  # step 1 carries this request's prefill
            await srv.call(lambda c: chat_text(c, max_tokens=5))
        assert failed.value.status_code == 500 and failed.value.code == "request_failed"

        async def hold(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            def go(c: httpx.Client) -> None:
                body = {"model": "stub", "prompt": "x", "max_tokens": 40, "stream": True}
                with c.stream("POST", "/v1/completions", json=body) as r:
                    lines = r.iter_lines()
                    next(lines)
                    trio.from_thread.run_sync(task_status.started)
                    for _ in lines:
                        pass

            await srv.http(go)

        async with trio.open_nursery() as nursery:
            await nursery.start(hold)
            with pytest.raises(openai.InternalServerError) as busy:
                await srv.call(lambda c: chat_text(c, max_tokens=5))
        assert busy.value.status_code == 503 and busy.value.code == "engine_overloaded"


async def test_shutdown_drains_running_streams_and_refuses_new_ones(tmp_path: Path) -> None:
    config = stub(tmp_path / "s.tlog", stub_step_time=0.02)
    shutdown = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(functools.partial(serve, config, ServeOptions(port=0), shutdown=shutdown))
            srv = Server(binds[0], tmp_path / "s.tlog")
            text: list[str] = []

            async def stream(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                def go(c: openai.OpenAI) -> None:
                    chunks = c.completions.create(model="stub", prompt="x", max_tokens=100, seed=1, stream=True)
                    trio.from_thread.run_sync(task_status.started)
                    text.extend(ch.choices[0].text for ch in chunks if ch.choices)

                await srv.call(go)

            await nursery.start(stream)
            shutdown.set()
            await trio.sleep(0.1)
            health = await srv.http(lambda c: c.get("/health"))
            refused = await srv.http(lambda c: c.post("/v1/completions", json={"model": "stub", "prompt": "y"}))
    assert health.status_code == 503 and refused.status_code == 503
    assert len("".join(text)) == 100
    assert_replays(tmp_path / "s.tlog")


# -- the command line ------------------------------------------------------------------------------------------


def test_cli_serves_then_drains_on_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "cli.tlog"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tickloom", "serve", "--model", "stub", "--port", "0", "--log",
                             str(log), "--stub-step-time", "0.01"], cwd=tmp_path, env=env, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "tickloom serve: model 'stub' on http://127.0.0.1:" in line, line
        url = line.split(" on ")[1].split(";")[0]
        with openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0, timeout=30.0) as client:
            stream = client.completions.create(model="stub", prompt="x", max_tokens=60, stream=True)
            first = next(iter(stream))
            proc.send_signal(signal.SIGTERM)
            text = first.choices[0].text + "".join(ch.choices[0].text for ch in stream if ch.choices)
        assert len(text) == 60  # the running request finished during the drain
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert_replays(log)


def test_cli_refuses_an_existing_log(tmp_path: Path) -> None:
    from tickloom.tools.cli import main

    (tmp_path / "taken.tlog").write_bytes(b"")
    assert main(["serve", "--model", "stub", "--port", "0", "--log", str(tmp_path / "taken.tlog")]) == 64


def test_default_log_paths_are_fresh(tmp_path: Path) -> None:
    first = default_log_path(str(tmp_path))
    Path(first).write_bytes(b"")
    second = default_log_path(str(tmp_path))
    assert first != second and not Path(second).exists() and second.endswith(".tlog")


def test_param_names_from_msgspec_messages() -> None:
    assert error_param("Expected `float` <= 2.0 - at `$.temperature`") == "temperature"
    assert error_param("Object missing required field `model`") == "model"
    assert error_param("Object missing required field `role` - at `$.messages[0]`") == "messages[0].role"
    assert error_param("Expected `int`, got `str` - at `$.prompt[0][1]`") == "prompt[0][1]"
