"""What the server says while it runs: an access line per request and a periodic stats line, each switchable off."""

from __future__ import annotations

import functools
import io
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from tests.test_serve import stub
from tickloom.tools.cli import EX_USAGE, main
from tickloom.tools.serve.activity import MAX_LOGGED_PATH, AccessLog, printable, report_stats, stats_line
from tickloom.tools.serve.server import ServeOptions, serve

ACCESS = re.compile(r'^127\.0\.0\.1 "(GET|POST) (\S+) HTTP/1\.1" (\d{3}) (\d+) B \d+\.\d ms$')


def test_printable_escapes_what_could_forge_a_line_and_cuts_long_paths() -> None:
    assert printable("/v1/models?x=1") == "/v1/models?x=1"
    assert printable("/a\nfake 200 line") == "/a\\nfake 200 line"
    assert printable("/\x1b[2J\r\t") == "/\\x1b[2J\\r\\t"
    assert printable("/caf\u00e9\u2028") == "/caf\\xe9\\u2028"
    assert printable("/back\\slash") == "/back\\\\slash"  # an escape in the input cannot pass for one of ours
    long = "/" + "x" * 500
    assert printable(long) == long[:MAX_LOGGED_PATH] + "..."
    assert printable("/" + "x" * (MAX_LOGGED_PATH - 1)) == "/" + "x" * (MAX_LOGGED_PATH - 1)


def test_a_stats_line_reports_the_interval_s_throughput_queues_and_kv_use() -> None:
    before = {"tokens": 100, "running": 1, "waiting": 0, "blocks_total": 200, "blocks_free": 150,
              "blocks_cached": 10}
    now = {"tokens": 180, "running": 3, "waiting": 2, "blocks_total": 200, "blocks_free": 120, "blocks_cached": 30}
    assert stats_line(now, before, 4.0) == ("tickloom serve: 20.0 tokens/s, 3 running, 2 waiting, "
                                            "KV cache 25.0% used")
    assert stats_line(now, None, 4.0).startswith("tickloom serve: 0.0 tokens/s, 3 running, 2 waiting")
    assert stats_line({"tokens": 5, "running": 0, "waiting": 0}, None, 1.0) == (
        "tickloom serve: 0.0 tokens/s, 0 running, 0 waiting")  # a fleet without block counts: no KV figure


async def test_report_stats_writes_a_line_every_interval(autojump_clock: trio.testing.MockClock) -> None:
    tokens = iter(range(0, 10_000, 50))
    out = io.StringIO()
    with trio.move_on_after(3.5):
        await report_stats(lambda: {"tokens": next(tokens), "running": 1, "waiting": 0}, 1.0, out)
    assert out.getvalue().splitlines() == ["tickloom serve: 50.0 tokens/s, 1 running, 0 waiting"] * 3


async def _plain(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": b"abc", "more_body": True})
    await send({"type": "http.response.body", "body": b"de"})


async def _broken(scope: Any, receive: Any, send: Any) -> None:
    raise RuntimeError("app failed")


async def test_the_access_log_counts_status_and_bytes_and_still_logs_a_failure() -> None:
    out = io.StringIO()
    scope = {"type": "http", "method": "POST", "path": "/x\n", "query_string": b"a=1", "http_version": "1.1",
             "client": ("10.0.0.7", 5555)}
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.request", "body": b""}

    await AccessLog(_plain, out)(scope, receive, send)
    assert len(sent) == 3  # passed through untouched
    with pytest.raises(RuntimeError, match="app failed"):  # logged, never swallowed
        await AccessLog(_broken, out)(scope, receive, send)
    first, second = out.getvalue().splitlines()
    assert re.fullmatch(r'10\.0\.0\.7 "POST /x\\n\?a=1 HTTP/1\.1" 201 5 B \d+\.\d ms', first), first
    assert re.fullmatch(r'10\.0\.0\.7 "POST /x\\n\?a=1 HTTP/1\.1" - 0 B \d+\.\d ms', second), second
    lifespan = io.StringIO()
    await AccessLog(_plain, lifespan)({"type": "lifespan"}, receive, send)
    assert lifespan.getvalue() == ""


async def _serve_and_call(tmp_path: Path, **options: Any) -> list[str]:
    out = io.StringIO()
    shutdown = trio.Event()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(functools.partial(serve, stub(tmp_path / "s.tlog"),
                                                          ServeOptions(port=0, **options), shutdown=shutdown,
                                                          out=out))

            def go() -> list[int]:
                with httpx.Client(base_url=binds[0], timeout=30.0) as c:
                    return [c.post("/v1/completions", json={"model": "stub", "prompt": "hi", "max_tokens": 8}
                                   ).status_code, c.get("/nope").status_code]

            assert await trio.to_thread.run_sync(go) == [200, 404]
            if options.get("stats_interval", 10.0) > 0:
                while "tokens/s" not in out.getvalue():  # the first line comes one interval after the start
                    await trio.sleep(0.05)
            shutdown.set()
    return out.getvalue().splitlines()


async def test_the_server_writes_an_access_line_per_request_and_stats_lines(tmp_path: Path) -> None:
    lines = await _serve_and_call(tmp_path, stats_interval=0.2)
    access = [m.groups() for line in lines if (m := ACCESS.match(line))]
    assert access[0][:3] == ("POST", "/v1/completions", "200") and int(access[0][3]) > 0
    assert access[1][:3] == ("GET", "/nope", "404")
    assert len(access) == 2
    stats = [line for line in lines if "tokens/s" in line]
    assert stats and all(re.fullmatch(r"tickloom serve: \d+\.\d tokens/s, \d+ running, \d+ waiting, "
                                      r"KV cache \d+\.\d% used", line) for line in stats), stats


async def test_both_can_be_switched_off(tmp_path: Path) -> None:
    lines = await _serve_and_call(tmp_path, access_log=False, stats_interval=0)
    assert not [line for line in lines if ACCESS.match(line) or "tokens/s" in line], lines
    assert any(line.startswith("tickloom serve: model 'stub' on http://") for line in lines)


def test_the_cli_refuses_a_negative_stats_interval(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "stub", "--no-log", "--stats-interval", "-1"]) == EX_USAGE
    assert "--stats-interval" in capsys.readouterr().err
