"""The server's endpoints around generation (``/v1/models``, ``/tokenize``, ``/detokenize``, ``/version``), its
``/metrics`` figures (the ``model`` label, KV usage, prefix-cache hit rate, queue depths) and CORS
(``--allowed-origins``)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.test_serve import running, stub
from tickloom import EngineConfig
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.tools.serve.info import VERSION
from tickloom.tools.serve.server import ServeOptions, serve_engine

ROOT = Path(__file__).resolve().parents[1]


async def test_models_tokenize_detokenize_version(tmp_path: Path) -> None:
    before = int(time.time())
    async with running(stub(tmp_path / "s.tlog"), model_name="my-model") as srv:
        def go(c: httpx.Client) -> list[httpx.Response]:
            return [c.get("/v1/models"),
                    c.post("/tokenize", json={"model": "my-model", "prompt": "Hi!", "return_token_strs": True}),
                    c.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}),
                    c.post("/detokenize", json={"model": "my-model", "tokens": [40, 73, 1]}),
                    c.get("/version"),
                    c.post("/tokenize", json={"prompt": "Hi", "add_special_tokens": False}),
                    c.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}],
                                              "add_generation_prompt": False}),
                    c.post("/detokenize", json={"tokens": [96]}),
                    c.post("/tokenize", json={"model": "other", "prompt": "Hi"}),
                    c.post("/tokenize", json={"prompt": "Hi", "frobnicate": True}),
                    c.post("/v1/chat/completions", json={"model": "my-model", "max_tokens": 1,
                                                         "messages": [{"role": "user", "content": "Hi"}]})]

        (models, text, chat, detok, version, no_special, no_gen, outside, other, unknown,
         answer) = await srv.http(go)
    [card] = models.json()["data"]
    assert card["id"] == "my-model" and card["root"] == "stub" and card["max_model_len"] == 256
    assert before <= card["created"] <= int(time.time()) and card["object"] == "model"
    assert text.json() == {"count": 3, "max_model_len": 256, "tokens": [40, 73, 1], "token_strs": ["H", "i", "!"]}
    # The chat count is the prompt's count in a chat completion (the template's rendering, generation prompt included).
    assert chat.json()["count"] == answer.json()["usage"]["prompt_tokens"] and chat.json()["token_strs"] is None
    assert detok.json() == {"prompt": "Hi!"}
    assert version.json() == {"version": VERSION}
    for r, param, status in ((no_special, "add_special_tokens", 400), (no_gen, "add_generation_prompt", 400),
                             (outside, "tokens", 400), (other, "model", 404), (unknown, "frobnicate", 400)):
        assert r.status_code == status and r.json()["error"]["param"] == param, (param, r.text)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    families = text_string_to_metric_families(text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


async def test_metrics_have_the_model_kv_usage_hit_rate_and_queues(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog"), model_name="my-model") as srv:
        def go(c: httpx.Client) -> tuple[str, str]:
            empty = c.get("/metrics").text
            body: dict[str, Any] = {"model": "my-model", "prompt": "x" * 40, "max_tokens": 2}
            for _ in range(2):  # the second hits the first's cached prompt blocks
                assert c.post("/v1/completions", json=body).status_code == 200
            return empty, c.get("/metrics").text

        empty, text = await srv.http(go)
    model = ("model", "my-model")
    before, after = samples(empty), samples(text)
    assert ("tickloom_prefix_cache_hit_rate", (model,)) not in before  # no prompt token yet
    assert before[("tickloom_kv_cache_usage_ratio", (model,))] == 0.0
    assert after[("tickloom_queue_requests", (model, ("queue", "running")))] == 0
    assert after[("tickloom_queue_requests", (model, ("queue", "waiting")))] == 0
    assert 0.0 <= after[("tickloom_kv_cache_usage_ratio", (model,))] <= 1.0
    prompt = after[("tickloom_prompt_tokens_total", (model,))]
    cached = after[("tickloom_cached_prompt_tokens_total", (model,))]
    assert cached > 0 and after[("tickloom_prefix_cache_hit_rate", (model,))] == cached / prompt
    unlabelled = [name for name, labels in after if not name.startswith(("python_", "process_"))
                  and model not in labels]
    assert not unlabelled, unlabelled


async def test_cors_preflight_from_an_allowed_origin_only(tmp_path: Path) -> None:
    allowed = "http://app.example"
    async with running(stub(tmp_path / "s.tlog"), allowed_origins=(allowed, "http://other.example"),
                       api_keys=("sekret",)) as srv:
        def preflight(c: httpx.Client, origin: str) -> httpx.Response:
            return c.options("/v1/chat/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})

        def go(c: httpx.Client) -> list[httpx.Response]:
            body = {"model": "stub", "prompt": "x", "max_tokens": 1}
            return [preflight(c, allowed), preflight(c, "http://evil.example"),
                    c.post("/v1/completions", json=body, headers={"Origin": allowed,
                                                                  "Authorization": "Bearer sekret"}),
                    c.post("/v1/completions", json=body, headers={"Origin": "http://evil.example",
                                                                  "Authorization": "Bearer sekret"})]

        ok, refused, simple, foreign = await srv.http(go)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == allowed
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == allowed
    assert foreign.status_code == 200 and "access-control-allow-origin" not in foreign.headers


async def test_no_allowed_origins_no_cors(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog")) as srv:
        r = await srv.http(lambda c: c.options("/v1/completions", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST"}))
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


def test_the_allowed_origins_flag(tmp_path: Path) -> None:
    """``tickloom serve --allowed-origins`` (repeatable) reaches the server."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tickloom", "serve", "--model", "stub", "--port", "0", "--no-log",
                             "--allowed-origins", "http://a.example", "--allowed-origins", "http://b.example"],
                            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert " on http://" in line, line
        url = line.split(" on ")[1].split(";")[0]
        with httpx.Client(base_url=url, timeout=30.0) as c:
            answers = {origin: c.options("/v1/completions", headers={"Origin": origin,
                                                                     "Access-Control-Request-Method": "POST"})
                       for origin in ("http://a.example", "http://b.example", "http://c.example")}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    for origin in ("http://a.example", "http://b.example"):
        assert answers[origin].status_code == 200
        assert answers[origin].headers["access-control-allow-origin"] == origin
    assert answers["http://c.example"].status_code == 400


CONTEXT = 64
"""The tiny model's context (max_position_embeddings) in the context tests, below the config's max_seq_len."""
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


def context_requests(c: httpx.Client) -> list[httpx.Response]:
    """The routes whose answers depend on the context: the model card, /tokenize, max_tokens checks, chat's default."""
    chat = [{"role": "user", "content": "hi"}]
    return [c.get("/v1/models"), c.post("/tokenize", json={"prompt": "hello"}),
            c.post("/tokenize", json={"messages": chat}),
            c.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": CONTEXT}),
            c.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": CONTEXT - 1}),
            c.post("/v1/chat/completions", json={"model": "tiny", "messages": chat, "ignore_eos": True})]


def check_context_answers(answers: list[httpx.Response], tokenizer: Any) -> None:
    models, text, chat, too_many, no_room, default = answers
    assert models.json()["data"][0]["max_model_len"] == CONTEXT
    assert text.json()["max_model_len"] == CONTEXT == chat.json()["max_model_len"]
    assert chat.json()["tokens"] == tokenizer.encode("user: hi\nassistant:", add_special_tokens=False)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
    assert f"max_seq_len={CONTEXT} tokens" in too_many.json()["error"]["message"]
    assert no_room.status_code == 400 and no_room.json()["error"]["param"] == "max_tokens"
    assert f"context is max_seq_len={CONTEXT} tokens" in no_room.json()["error"]["message"]
    # chat's default max_tokens fills what the prompt leaves of the engine's context, not of the config's
    usage = default.json()["usage"]
    assert default.json()["choices"][0]["finish_reason"] == "length" and usage["total_tokens"] == CONTEXT
    assert usage["prompt_tokens"] == len(chat.json()["tokens"])


def tiny_context_config(tmp_path: Path, **kw: Any) -> EngineConfig:
    model = write_tiny_model(tmp_path / "tiny", seed=2, max_position_embeddings=CONTEXT)
    return EngineConfig(model=str(model), max_seq_len=256, num_blocks=64, chat_template=TEMPLATE, **kw)


async def test_the_server_reports_and_checks_the_engines_context_not_the_configs(tmp_path: Path) -> None:
    """``max_seq_len=256`` on a model whose context is 64: the engine runs with 64, and so does the server."""
    config = tiny_context_config(tmp_path, log_path=str(tmp_path / "t.tlog"))
    async with running(config, model_name="tiny") as srv:
        answers = await srv.http(context_requests)
    from tickloom.engine.model.tokenizer import TokenizerWrapper

    check_context_answers(answers, TokenizerWrapper.from_dir(Path(config.model)))


@pytest.mark.slow
async def test_a_fleet_server_reports_and_checks_the_replicas_context(ray_cluster: None, tmp_path: Path) -> None:
    """The fleet backend caps ``max_seq_len`` at the model's context as each replica's engine does, and renders chats
    with ``chat_template`` as they would."""
    from tests.test_serve import Server
    from tickloom.fleet.front import FleetConfig
    from tickloom.fleet.router_replay import verify_fleet
    from tickloom.tools.serve.fleet_backend import FleetBackend

    config = tiny_context_config(tmp_path)
    fleet_dir = tmp_path / "fleet"
    fleet = FleetConfig(replicas=1, fleet_dir=str(fleet_dir))
    shutdown = trio.Event()
    with trio.fail_after(120):
        async with FleetBackend.open(config, fleet) as backend, trio.open_nursery() as nursery:
            assert backend.max_seq_len == CONTEXT and backend.config.max_seq_len == 256
            binds = await nursery.start(functools.partial(serve_engine, backend, ServeOptions(port=0,
                                                                                             model_name="tiny"),
                                                          shutdown=shutdown))
            answers = await Server(binds[0], fleet_dir).http(context_requests)
            shutdown.set()
        check_context_answers(answers, backend.tokenizer)
    report = verify_fleet(fleet_dir)
    assert report.status == "identical", report.format_text()
