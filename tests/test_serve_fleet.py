"""``tickloom serve --replicas N``: the OpenAI-compatible server in front of a fleet of stub replicas on a local Ray
(``tools/serve/fleet_backend.py``): the same answers as the single-engine server, a client leaving cancels its
request on its replica, a replica killed mid-stream ends its streams with an error (and the fleet serves on),
shutdown drains, and every fleet directory replays ``identical``. One Ray cluster serves the module."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.engine_helpers import core_finishes
from tests.test_serve import CHAT, Server, leave_after, running, stub
from tickloom import EngineConfig
from tickloom.fleet.front import FleetConfig
from tickloom.fleet.router_replay import replica_logs, verify_fleet
from tickloom.prompts import MAX_CHARS_PER_TOKEN
from tickloom.tools.serve.fleet_backend import FleetBackend
from tickloom.tools.serve.server import ServeOptions, serve_engine

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

ENGINE = dict(model="stub", num_blocks=256, max_seq_len=256, stub_step_time=0.005, max_batch_size=16)
"""``tests.test_serve.stub``'s engine, without its log (each replica writes its own)."""


@dataclass
class FleetServer:
    srv: Server
    backend: FleetBackend
    shutdown: trio.Event


@asynccontextmanager
async def fleet_server(fleet_dir: Path, policy: str = "affinity", **engine: Any) -> AsyncIterator[FleetServer]:
    """A server over 2 replicas; on exit it drains, closes the fleet, and the fleet's logs must replay."""
    config = EngineConfig(**{**ENGINE, **engine})
    shutdown = trio.Event()
    with trio.fail_after(120):
        fleet = FleetConfig(replicas=2, fleet_dir=str(fleet_dir), policy=policy)
        async with FleetBackend.open(config, fleet) as fb, trio.open_nursery() as nursery:
            binds = await nursery.start(functools.partial(serve_engine, fb, ServeOptions(port=0), shutdown=shutdown))
            yield FleetServer(Server(binds[0], fleet_dir), fb, shutdown)
            shutdown.set()
    report = verify_fleet(fleet_dir)
    assert report.status == "identical", report.format_text()


def answers(c: openai.OpenAI) -> dict[str, Any]:
    """Seeded requests of every kind; what must not depend on what serves them."""
    whole = c.completions.create(model="stub", prompt="Once upon", max_tokens=12, seed=7, logprobs=2)
    streamed = list(c.completions.create(model="stub", prompt="Once upon", max_tokens=12, seed=7, stream=True,
                                         stream_options={"include_usage": True}))
    chat = c.chat.completions.create(model="stub", messages=CHAT, max_tokens=10, seed=3)  # type: ignore[arg-type]
    chat_streamed = list(c.chat.completions.create(model="stub", messages=CHAT, max_tokens=10, seed=3,  # type: ignore
                                                   stream=True))
    n2 = c.completions.create(model="stub", prompt=["ab", "cd"], n=2, max_tokens=8, seed=5)
    scored = c.completions.create(model="stub", prompt="Once upon", max_tokens=0, echo=True, logprobs=1,
                                  extra_body={"prompt_logprobs": 1})
    shaped = c.completions.create(model="stub", prompt="Once upon a time", max_tokens=4, seed=2,
                                  extra_body={"truncate_prompt_tokens": 3, "allowed_token_ids": [65, 66],
                                              "cache_salt": "s"})
    assert whole.usage is not None and n2.usage is not None and chat.usage is not None
    assert scored.choices[0].logprobs is not None and shaped.usage is not None
    return {
        "echo": (scored.choices[0].text, scored.choices[0].logprobs.model_dump(),
                 scored.choices[0].model_dump()["prompt_logprobs"]),
        "truncated, allowed tokens": (shaped.choices[0].text, shaped.usage.prompt_tokens),
        "completion": (whole.choices[0].text, whole.choices[0].finish_reason, whole.usage.completion_tokens),
        "logprobs": whole.choices[0].logprobs.model_dump() if whole.choices[0].logprobs else None,
        "completion streamed": "".join(ch.choices[0].text for ch in streamed if ch.choices),
        "streamed usage": streamed[-1].usage.completion_tokens if streamed[-1].usage else None,
        "chat": (chat.choices[0].message.content, chat.choices[0].finish_reason, chat.usage.prompt_tokens),
        "chat streamed": "".join(ch.choices[0].delta.content or "" for ch in chat_streamed if ch.choices),
        "n=2": [(ch.index, ch.text, ch.finish_reason) for ch in sorted(n2.choices, key=lambda ch: ch.index)],
        "n=2 usage": (n2.usage.prompt_tokens, n2.usage.completion_tokens),
    }


async def test_a_fleet_answers_as_one_engine_and_a_client_leaving_cancels_on_its_replica(
        ray_cluster: None, tmp_path: Path) -> None:
    async with running(stub(tmp_path / "one.tlog")) as one:
        expected = await one.call(answers)
    assert expected["completion"][0] == expected["completion streamed"] and len(expected["n=2"]) == 4
    text, logprobs, prompt_logprobs = expected["echo"]
    assert text == "Once upon" and len(logprobs["tokens"]) == len(prompt_logprobs) == len("Once upon")
    shaped, prompt_tokens = expected["truncated, allowed tokens"]
    assert prompt_tokens == 3 and set(shaped) <= {"a", "b"}

    async with fleet_server(tmp_path / "fleet") as fs:
        srv = fs.srv
        assert await srv.call(answers) == expected
        assert await srv.call(lambda c: [m.id for m in c.models.list()]) == ["stub"]
        health = await srv.http(lambda c: c.get("/health"))
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        metrics = await srv.http(lambda c: c.get("/metrics").text)
        assert 'tickloom_kv_blocks{model="stub",state="total"} 512.0' in metrics  # 2 replicas x 256 blocks
        assert 'tickloom_fleet_replicas_live{model="stub"} 2.0' in metrics
        assert 'tickloom_requests_finished_total{finish_reason="length",model="stub"}' in metrics

        rid = f"{await srv.http(functools.partial(leave_after, events=3))}-0"
        with trio.fail_after(10):  # the front end closes the request: the router no longer has it open
            while await fs.backend.on_loop(lambda f: rid in f._router().router.open):
                await trio.sleep(0.02)
        with trio.fail_after(10):
            left = 'tickloom_client_disconnects_total{model="stub"} 1.0'
            while left not in await srv.http(lambda c: c.get("/metrics").text):
                await trio.sleep(0.05)
        too_long = "x" * (MAX_CHARS_PER_TOKEN * 256 + 1)  # refused by the backend's tokenizing, before any replica
        bad = await srv.http(lambda c: c.post("/v1/completions", json={"model": "stub", "prompt": too_long}))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"

    # the replica that served it logged it cancelled, long before its 200 tokens
    finishes = [f for _, _, log in replica_logs(tmp_path / "fleet") if (f := core_finishes(log).get(rid))]
    assert len(finishes) == 1
    assert finishes[0].reason == "cancelled" and finishes[0].usage.completion_tokens < 200


def stream_events(url: str, started: trio.Event, max_tokens: int) -> list[Any]:
    """A streamed completion's events (``[DONE]`` as the string), setting ``started`` at the first one."""
    events: list[Any] = []
    body = {"model": "stub", "prompt": "x", "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "seed": 1}
    with httpx.Client(base_url=url, timeout=30.0) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                if not events:
                    trio.from_thread.run_sync(started.set)
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return events


async def test_a_replica_killed_mid_stream_ends_its_streams_with_an_error_then_shutdown_drains(
        ray_cluster: None, tmp_path: Path) -> None:
    async with fleet_server(tmp_path / "fleet", policy="round-robin", stub_step_time=0.01) as fs:
        srv = fs.srv
        results: dict[int, list[Any]] = {}

        async def one(i: int, started: trio.Event) -> None:
            results[i] = await trio.to_thread.run_sync(stream_events, srv.url, started, 150)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                starts = [trio.Event() for _ in range(4)]
                for i, started in enumerate(starts):
                    nursery.start_soon(one, i, started)
                for started in starts:
                    await started.wait()
                await fs.backend.on_loop(lambda f: f.kill_replica(1))

        # every stream ended (none hangs): those on replica 1 with an error event naming it, the others whole
        failed = [events for events in results.values() if "error" in events[-2]]
        whole = [events for events in results.values() if "error" not in events[-2]]
        assert len(failed) == 2 and len(whole) == 2, results  # round-robin: 2 streams on each replica
        for events in failed:
            error = events[-2]["error"]
            assert events[-1] == "[DONE]" and error["code"] == "replica_unavailable", error
            assert "replica 1 died" in error["message"] and "not retried" in error["message"], error
        for events in whole:
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
            assert len("".join(e["choices"][0]["text"] for e in events[:-1])) == 150

        # later requests still succeed (on replica 0, or on replica 1 once Ray has restarted it)
        later = await srv.call(lambda c: [c.completions.create(model="stub", prompt="y", max_tokens=4, seed=i)
                                          for i in range(4)])
        assert [r.choices[0].finish_reason for r in later] == ["length"] * 4

        # shutdown drains: a running stream finishes, new requests and /health get 503
        draining: list[Any] = []

        async def long_one(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            started = trio.Event()

            async def go() -> None:
                draining.extend(await trio.to_thread.run_sync(stream_events, srv.url, started, 100))

            async with trio.open_nursery() as inner:
                inner.start_soon(go)
                await started.wait()
                task_status.started()

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                await nursery.start(long_one)
                fs.shutdown.set()
                await trio.sleep(0.1)
                health = await srv.http(lambda c: c.get("/health"))
                refused = await srv.http(lambda c: c.post("/v1/completions", json={"model": "stub", "prompt": "z"}))
        assert health.status_code == 503 and refused.status_code == 503
        assert draining[-1] == "[DONE]" and len("".join(e["choices"][0]["text"] for e in draining[:-1])) == 100
    assert [(i, n) for i, n, _ in replica_logs(tmp_path / "fleet")][:2] == [(0, 0), (1, 0)]


def test_the_cli_checks_fleet_flags_and_names_the_extra_when_ray_is_missing(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from tickloom.tools.cli import main

    assert main(["serve", "--model", "stub", "--policy", "round-robin"]) == 64
    assert main(["serve", "--model", "stub", "--replicas", "2", "--log", str(tmp_path / "x.tlog")]) == 64
    assert main(["serve", "--model", "stub", "--replicas", "0"]) == 64
    err = capsys.readouterr().err
    assert "--policy is for a fleet" in err and "--log: a fleet writes its logs in --fleet-dir" in err
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["serve", "--model", "stub", "--replicas", "2", "--fleet-dir", str(tmp_path / "f")]) == 64
    assert "pip install 'tickloom[fleet]'" in capsys.readouterr().err
