"""The server's edge against hostile or careless clients (``tools/serve/guard.py``, ``sse.py``, ``ending.py``):
bounded bodies, API keys, metrics by route, clients that never read, and every way a server stops with requests
open ending each of them with a last event that says why. Every server's log replays ``identical``."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.engine_helpers import assert_replays, core_finishes
from tests.test_serve import CHAT, Server, running, stub
from tickloom import Engine, EngineError
from tickloom.events.log import LogWriter
from tickloom.tools.serve.guard import API_KEY_ENV, UNMATCHED, api_keys, key_matches, route_label
from tickloom.tools.serve.server import ServeOptions, serve, serve_engine

# -- raw HTTP ----------------------------------------------------------------------------------------------------


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def read_response(stream: trio.SocketStream, limit: float = 20) -> bytes:
    """Everything the server sends until it closes the connection (or ``limit`` seconds pass)."""
    data = b""
    with trio.move_on_after(limit):
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not chunk:
                break
            data += chunk
            if b"\r\n\r\n" in data and b"content-length" in data.lower():
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                if len(body) >= length:
                    break
    return data


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def post_head(path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{extra}\r\n").encode()


# -- bodies ------------------------------------------------------------------------------------------------------


async def test_a_body_over_the_limit_is_413_before_it_is_read(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog"), max_body_bytes=4096) as srv:
        stream = await trio.open_tcp_stream(*host_port(srv.url))
        await stream.send_all(post_head("/v1/completions", f"content-length: {600 << 20}\r\n") + b"x" * 1000)
        response = await read_response(stream)
        assert status_of(response) == 413
        body = json.loads(response.partition(b"\r\n\r\n")[2])
        assert body["error"]["code"] == "request_too_large" and "4096 bytes" in body["error"]["message"]
        assert "--max-body-bytes" in body["error"]["message"]
        await stream.aclose()
        # A body of exactly the limit is read (and, being no JSON request, refused as such: a 400, not a 413).
        exact = await srv.http(lambda c: c.post("/v1/completions", content=b" " * 4096,
                                                headers={"content-type": "application/json"}))
        assert exact.status_code == 400
        ok = await srv.http(lambda c: c.post("/v1/completions", json={"model": "stub", "prompt": "a",
                                                                       "max_tokens": 2}))
        assert ok.status_code == 200


async def test_a_chunked_body_is_counted_as_it_arrives(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog"), max_body_bytes=4096) as srv:
        stream = await trio.open_tcp_stream(*host_port(srv.url))
        await stream.send_all(post_head("/v1/completions", "transfer-encoding: chunked\r\n"))
        for _ in range(3):  # 3 x 2000 bytes: the third chunk passes the limit
            await stream.send_all(b"7d0\r\n" + b"x" * 2000 + b"\r\n")
        response = await read_response(stream)
        assert status_of(response) == 413
        await stream.aclose()


async def test_a_slow_body_is_closed_by_the_timeout(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog"), body_timeout=0.5) as srv:
        stream = await trio.open_tcp_stream(*host_port(srv.url))
        await stream.send_all(post_head("/v1/completions", "content-length: 100\r\n"))

        async def trickle() -> None:
            for _ in range(100):
                await stream.send_all(b" ")
                await trio.sleep(0.2)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            response = await read_response(stream)
            nursery.cancel_scope.cancel()
        assert status_of(response) == 408
        assert b"--body-timeout" in response


async def test_a_client_leaving_mid_body_is_no_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with running(stub(tmp_path / "s.tlog")) as srv:
        stream = await trio.open_tcp_stream(*host_port(srv.url))
        await stream.send_all(post_head("/v1/completions", "content-length: 1000\r\n") + b"{\"model\": ")
        await trio.sleep(0.1)
        await stream.aclose()
        await trio.sleep(0.2)
        ok = await srv.http(lambda c: c.post("/v1/completions", json={"model": "stub", "prompt": "a",
                                                                       "max_tokens": 2}))
        assert ok.status_code == 200
        metrics = await srv.http(lambda c: c.get("/metrics").text)
    assert 'tickloom_client_disconnects_total{model="stub"} 1.0' in metrics
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


async def test_a_whole_answer_too_large_to_hold_is_refused(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog"), max_answer_entries=1000) as srv:
        too_big = {"model": "stub", "prompt": "a", "max_tokens": 100, "n": 2, "logprobs": 5}  # 2 x 100 x 7
        refused = await srv.http(lambda c: c.post("/v1/completions", json=too_big))
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "answer_too_large" and "--max-answer-entries" in error["message"]
        assert "1400" not in error["message"] and "2 choices x 100 tokens x 7 entries" in error["message"]
        fits = {"model": "stub", "prompt": "a", "max_tokens": 100, "n": 2, "logprobs": 3}  # 2 x 100 x 5
        assert (await srv.http(lambda c: c.post("/v1/completions", json=fits))).status_code == 200
        plain = {"model": "stub", "prompt": "a", "max_tokens": 250, "n": 4}  # 4 x 250 x 1
        assert (await srv.http(lambda c: c.post("/v1/completions", json=plain))).status_code == 200
        streamed = {**too_big, "stream": True}  # a stream holds only what its client has not read
        assert (await srv.http(lambda c: c.post("/v1/completions", json=streamed))).status_code == 200


# -- API keys ------------------------------------------------------------------------------------------------------


def test_keys_come_from_flags_and_the_environment() -> None:
    assert api_keys(["a", " b ", ""], {API_KEY_ENV: "c, a,,d"}) == ("a", "b", "c", "d")
    assert api_keys([], {}) == ()


def test_a_key_matches_only_itself() -> None:
    import hashlib

    digests = [hashlib.sha256(k.encode()).digest() for k in ("first-key", "second-key")]
    assert key_matches("first-key", digests) and key_matches("second-key", digests)
    assert not key_matches("first-ke", digests) and not key_matches("", digests)
    assert not key_matches("first-key ", digests) and not key_matches("third-key", [])


async def test_without_a_key_every_route_but_health_is_401(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog"), api_keys=("k1", "k2")) as srv:
        def probe(c: httpx.Client) -> dict[str, list[int]]:
            codes: dict[str, list[int]] = {}
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "k1"},
                            {"authorization": "Basic k1"}):
                for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                                     ("POST", "/v1/chat/completions"), ("GET", "/nope"), ("GET", "/health")):
                    codes.setdefault(path, []).append(c.request(method, path, headers=headers).status_code)
            return codes

        codes = await srv.http(probe)
        assert codes.pop("/health") == [200] * 4
        assert all(c == [401] * 4 for c in codes.values()), codes
        unauthorized = await srv.http(lambda c: c.get("/v1/models"))
        assert unauthorized.json()["error"]["code"] == "invalid_api_key"
        assert unauthorized.headers["www-authenticate"] == "Bearer"

        def with_sdk(key: str) -> str:
            with openai.OpenAI(api_key=key, base_url=f"{srv.url}/v1", max_retries=0, timeout=30) as client:
                r = client.chat.completions.create(model="stub", messages=CHAT, max_tokens=4,  # type: ignore[arg-type]
                                                   seed=1)
                return r.choices[0].message.content or ""

        first = await trio.to_thread.run_sync(with_sdk, "k1")
        assert first and first == await trio.to_thread.run_sync(with_sdk, "k2")
        with pytest.raises(openai.AuthenticationError):
            await trio.to_thread.run_sync(with_sdk, "k3")


async def test_metrics_can_be_left_open(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog"), api_keys=("k",), metrics_open=True) as srv:
        assert (await srv.http(lambda c: c.get("/metrics"))).status_code == 200
        assert (await srv.http(lambda c: c.get("/v1/models"))).status_code == 401


# -- metrics --------------------------------------------------------------------------------------------------------


def test_a_path_is_labelled_by_its_route() -> None:
    routes = frozenset({"/v1/models"})
    assert route_label("/v1/models", routes) == "/v1/models"
    assert route_label("/v1/models/x", routes) == UNMATCHED and route_label("/nope-1", routes) == UNMATCHED


async def test_invented_paths_do_not_grow_metrics(tmp_path: Path) -> None:
    async with running(stub(tmp_path / "s.tlog")) as srv:
        def scan(c: httpx.Client) -> tuple[str, str]:
            c.get("/nope-0")
            before = c.get("/metrics").text
            for i in range(1, 300):
                c.get(f"/nope-{i}")
            return before, c.get("/metrics").text

        before, after = await srv.http(scan)
    assert abs(len(after) - len(before)) < 1024
    families = {f.name: f for f in text_string_to_metric_families(after)}
    endpoints = {s.labels["endpoint"] for s in families["tickloom_http_requests"].samples}
    assert endpoints == {UNMATCHED, "/metrics"}
    unmatched = [s for s in families["tickloom_http_requests"].samples
                 if s.labels["endpoint"] == UNMATCHED and s.name.endswith("_total")]
    assert [s.value for s in unmatched] == [300.0] and unmatched[0].labels["status"] == "404"


# -- clients that do not read --------------------------------------------------------------------------------------


async def test_a_stream_its_client_never_reads_is_ended_at_the_buffer_limit(tmp_path: Path) -> None:
    config = stub(tmp_path / "s.tlog", stub_step_time=0.001, max_seq_len=4096, num_blocks=2048)
    async with running(config, max_stream_buffer_bytes=32 << 10) as srv:
        import socket

        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        await sock.connect(host_port(srv.url))
        stream = trio.SocketStream(sock)
        body = json.dumps({"model": "stub", "prompt": "a", "max_tokens": 3000, "n": 8, "logprobs": 20,
                           "stream": True, "seed": 1}).encode()
        await stream.send_all(post_head("/v1/completions", f"content-length: {len(body)}\r\n") + body)
        with trio.fail_after(60):  # the server ends the request long before its 8 x 3000 tokens
            while True:
                metrics = await srv.http(lambda c: c.get("/metrics").text)
                if 'tickloom_slow_client_streams_total{model="stub"} 1.0' in metrics:
                    break
                await trio.sleep(0.1)
        # Reading now, the client finds the stream's end: the error naming the limit, then [DONE] (unless the
        # server gave up waiting for it first and dropped the connection).
        tail = (await read_response(stream, limit=10))[-4096:]
        await stream.aclose()
        canary = await srv.http(lambda c: c.post("/v1/completions", json={"model": "stub", "prompt": "b",
                                                                           "max_tokens": 5}))
        assert canary.status_code == 200 and canary.json()["usage"]["completion_tokens"] == 5
    if tail.rstrip().endswith(b"[DONE]"):
        assert b"stream_buffer_full" in tail and b"--max-stream-buffer-bytes" in tail
    finishes = [f for rid, f in core_finishes(srv.log).items() if rid.startswith("cmpl-") and "/" in rid]
    assert len(finishes) == 8 and all(f.reason == "cancelled" for f in finishes)
    assert all(f.usage.completion_tokens < 3000 for f in finishes)


# -- ending open requests ----------------------------------------------------------------------------------------


def read_stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> list[str]:
    """Every ``data:`` payload of a streamed request, in order."""
    lines: list[str] = []
    with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body,
                                                               headers=headers or {}) as r:
        assert r.status_code == 200
        lines.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))
    return lines


async def test_a_drain_that_times_out_ends_each_stream_with_why(tmp_path: Path) -> None:
    config = stub(tmp_path / "s.tlog", stub_step_time=0.02)
    shutdown = trio.Event()
    results: list[list[str]] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(functools.partial(serve, config, ServeOptions(port=0, drain_timeout=0.3),
                                                          shutdown=shutdown))
            body = {"model": "stub", "prompt": "x", "max_tokens": 255, "stream": True}

            async def one() -> None:
                results.append(await trio.to_thread.run_sync(read_stream, binds[0], body))

            for _ in range(2):
                nursery.start_soon(one)
            await trio.sleep(0.5)
            shutdown.set()
    assert len(results) == 2
    for lines in results:
        assert lines[-1] == "[DONE]"
        error = json.loads(lines[-2])["error"]
        assert error["code"] == "server_shutting_down" and "drain timed out after 0.3 s" in error["message"]
    assert {f.reason for f in core_finishes(tmp_path / "s.tlog").values()} == {"cancelled"}
    assert_replays(tmp_path / "s.tlog")


async def test_a_whole_answer_cut_by_the_drain_is_a_503_that_says_why(tmp_path: Path) -> None:
    config = stub(tmp_path / "s.tlog", stub_step_time=0.02)
    shutdown = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(functools.partial(serve, config, ServeOptions(port=0, drain_timeout=0.2),
                                                          shutdown=shutdown))
            srv = Server(binds[0], tmp_path / "s.tlog")
            answer: list[httpx.Response] = []

            async def one() -> None:
                answer.append(await srv.http(lambda c: c.post("/v1/completions", json={
                    "model": "stub", "prompt": "x", "max_tokens": 255})))

            nursery.start_soon(one)
            await trio.sleep(0.5)
            shutdown.set()
    assert answer[0].status_code == 503
    assert "drain timed out" in answer[0].json()["error"]["message"]
    assert_replays(tmp_path / "s.tlog")


async def test_a_failed_log_ends_every_stream_with_the_error(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The log's disk fills: open streams get the engine's error and [DONE], /health and new requests a 503 that
    names it, and the engine's error leaves the server."""
    config = stub(tmp_path / "s.tlog", stub_step_time=0.02)
    full = trio.Event()
    real_flush = LogWriter.flush

    def flush(self: LogWriter) -> None:
        if full.is_set():
            raise OSError(28, "No space left on device")
        real_flush(self)

    monkeypatch.setattr(LogWriter, "flush", flush)
    streams: list[list[str]] = []
    seen: dict[str, Any] = {}
    with pytest.raises(EngineError, match="No space left"), trio.fail_after(60):
        async with Engine.open(config) as engine, trio.open_nursery() as nursery:
            binds = await nursery.start(functools.partial(serve_engine, engine, ServeOptions(port=0)))
            srv = Server(binds[0], tmp_path / "s.tlog")
            body = {"model": "stub", "prompt": "x", "max_tokens": 255, "stream": True}

            async def one() -> None:
                streams.append(await trio.to_thread.run_sync(read_stream, srv.url, body))

            async def after_failure() -> None:
                with trio.CancelScope(shield=True):
                    def look(c: httpx.Client) -> None:
                        while (health := c.get("/health")).status_code == 200:
                            pass
                        seen["health"] = health
                        seen["new"] = c.post("/v1/completions", json={"model": "stub", "prompt": "y"})

                    await srv.http(look)

            for _ in range(2):
                nursery.start_soon(one)
            nursery.start_soon(after_failure)
            await trio.sleep(0.5)
            full.set()
            await trio.sleep_forever()
    assert len(streams) == 2
    for lines in streams:
        assert lines[-1] == "[DONE]"
        assert "No space left on device" in json.loads(lines[-2])["error"]["message"]
    assert seen["health"].status_code == 503 and seen["health"].json()["status"] == "failed"
    assert "No space left" in seen["health"].json()["reason"]
    assert seen["new"].status_code == 503 and seen["new"].json()["error"]["code"] == "engine_failed"


def test_a_streamed_choice_keeps_only_its_finish_and_usage() -> None:
    from tickloom import RequestOutput, RequestUsage
    from tickloom.tools.serve.translate import Choice

    usage = RequestUsage(prompt_tokens=3, completion_tokens=2, cached_prompt_tokens=1, reasoning_tokens=0)
    frames = [RequestOutput(request_id="r", token_ids=[5], text_delta="a", logprobs=[-0.5]),
              RequestOutput(request_id="r", token_ids=[6], text_delta="b", logprobs=[-0.25], finished=True,
                            finish_reason="length", usage=usage)]
    streamed, whole = Choice(0), Choice(0)
    for out in frames:
        streamed.add(out, keep=False)
        whole.add(out)
    assert streamed.token_ids == [] and streamed.text == [] and streamed.logprobs == [] and streamed.tops == []
    assert whole.token_ids == [5, 6] and "".join(whole.text) == "ab" and whole.logprobs == [-0.5, -0.25]
    for c in (streamed, whole):
        assert (c.finish_reason, c.prompt_tokens, c.completion_tokens, c.cached_tokens) == ("length", 3, 2, 1)


async def test_a_client_that_hangs_up_after_done_is_no_disconnect(tmp_path: Path) -> None:
    """The SDKs close the connection on ``[DONE]``, before the body's terminating chunk: that is not a client
    leaving early, and it cancels nothing."""
    async with running(stub(tmp_path / "s.tlog")) as srv:
        def two(c: openai.OpenAI) -> list[str]:
            return ["".join(ch.choices[0].text for ch in c.completions.create(
                model="stub", prompt="x", max_tokens=20, seed=1, stream=True) if ch.choices) for _ in range(2)]

        texts = await srv.call(two)
        await trio.sleep(0.3)
        metrics = await srv.http(lambda c: c.get("/metrics").text)
    assert [len(t) for t in texts] == [20, 20]
    assert 'tickloom_client_disconnects_total{model="stub"} 0.0' in metrics
    assert 'finish_reason="cancelled"' not in metrics
