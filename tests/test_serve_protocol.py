"""The server needs only its small protocol (``backend.ServedEngine``): the configuration, the tokenizer, a
``Request``'s stream, stats, drain and failure. Served through a wrapper that has nothing else (no ``runtime``), a
whole and a streamed completion with logprobs still work, and every request reached the engine as a ``Request``."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.engine_helpers import assert_replays
from tickloom import Engine, EngineConfig, EngineError, RequestStream
from tickloom.request import Request
from tickloom.tools.serve.backend import Decoder, ServedEngine
from tickloom.tools.serve.server import ServeOptions, serve_engine


class OnlyTheProtocol:
    """An ``Engine`` seen through ``ServedEngine`` alone: any other attribute is an AttributeError."""

    __slots__ = ("_engine", "requests")

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.requests: list[Request] = []

    @property
    def config(self) -> EngineConfig:
        return self._engine.config

    @property
    def tokenizer(self) -> Decoder:
        tokenizer: Decoder = self._engine.tokenizer
        return tokenizer

    @property
    def max_seq_len(self) -> int:
        return self._engine.max_seq_len

    @property
    def failure(self) -> EngineError | None:
        return self._engine.failure

    def stats(self) -> dict[str, Any]:
        return self._engine.stats()

    def generate_request(self, request: Request) -> RequestStream:
        self.requests.append(request)
        return self._engine.generate_request(request)

    async def drain(self, timeout: float = math.inf) -> bool:
        return await self._engine.drain(timeout)


async def test_the_server_serves_anything_with_the_protocol(tmp_path: Path) -> None:
    log = tmp_path / "s.tlog"
    config = EngineConfig(model="stub", log_path=str(log), num_blocks=256, max_seq_len=256, stub_step_time=0.005)
    shutdown = trio.Event()
    with trio.fail_after(120):
        async with Engine.open(config) as engine, trio.open_nursery() as nursery:
            served = OnlyTheProtocol(engine)
            protocol: ServedEngine = served
            binds = await nursery.start(functools.partial(serve_engine, protocol, ServeOptions(port=0),
                                                          shutdown=shutdown))
            body = {"model": "stub", "prompt": "Hello", "max_tokens": 5, "seed": 1, "logprobs": 1, "priority": 3}

            def ask() -> tuple[dict[str, Any], list[str]]:
                with httpx.Client(base_url=binds[0], timeout=30.0) as client:
                    whole = client.post("/v1/completions", json=body)
                    assert whole.status_code == 200, whole.text
                    streamed = client.post("/v1/completions", json={**body, "stream": True})
                    assert streamed.status_code == 200, streamed.text
                    return whole.json(), [line for line in streamed.text.splitlines() if line.startswith("data: ")]

            whole, events = await trio.to_thread.run_sync(ask)
            shutdown.set()
    [choice] = whole["choices"]
    assert len(choice["logprobs"]["tokens"]) == 5 and "".join(choice["logprobs"]["tokens"]) == choice["text"]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    assert [(r.priority, r.params.max_tokens) for r in served.requests] == [(3, 5), (3, 5)]
    assert all(r.request_id is not None and r.request_id.startswith("cmpl-") for r in served.requests)
    assert_replays(log)
