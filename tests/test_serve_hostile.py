"""``tickloom serve`` as a process, against hostile clients and a failing disk: what it holds, how it ends.

The server runs under an address-space limit (``RLIMIT_AS``): a server that held a 600 MB body, or every frame of
a stream nobody reads, would fail its allocations there instead of growing. A canary stream runs through the
hostile requests and must get every one of its tokens. Bounds here are on memory and on outcomes, not on time.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine_helpers import assert_replays

ROOT = Path(__file__).resolve().parents[1]
ADDRESS_SPACE = 600 << 20
"""The server's address-space limit: about 50 MB used at rest, so a 600 MB body could not be held."""

pytestmark = pytest.mark.slow


@contextmanager
def server(tmp_path: Path, *flags: str, limit_as: int | None = ADDRESS_SPACE,
           limit_fsize: int | None = None) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``tickloom serve --model stub`` on a free port, under the given limits; yields it and its URL."""

    def limits() -> None:
        if limit_as is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))
        if limit_fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_fsize, limit_fsize))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # No access log: these tests read stderr only at the start and the end, and thousands of requests' lines would
    # fill the pipe.
    proc = subprocess.Popen([sys.executable, "-m", "tickloom", "serve", "--model", "stub", "--port", "0",
                             "--no-access-log", *flags],
                            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=limits)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "tickloom serve: model 'stub' on http://127.0.0.1:" in line, line
        yield proc, line.split(" on ")[1].split(";")[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def stream_lines(url: str, body: dict[str, Any], on_first: threading.Event | None = None) -> list[str]:
    """Every ``data:`` payload of a streamed completion; ``on_first`` is set at the first."""
    lines: list[str] = []
    with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if on_first is not None:
                    on_first.set()
    return lines


def raw_post(url: str, head: str, body_parts: Iterator[bytes], *, rcvbuf: int | None = None,
             before_read: Callable[[], None] | None = None) -> bytes:
    """Send a POST's head and as much of its body as the server takes; (after ``before_read``) return what it
    answered."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(120)
    sock.connect((host, int(port)))
    with sock:
        try:
            sock.sendall(head.encode())
            for part in body_parts:
                sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the body was sent: read its answer
        if before_read is not None:
            before_read()
        answer = b""
        try:
            while not answer.endswith(b"\r\n0\r\n\r\n") and (chunk := sock.recv(65536)):
                answer += chunk  # until the server closes, or a chunked body's end (it keeps the connection)
        except ConnectionResetError:
            pass
        return answer


def post_head(length: int | None, path: str = "/v1/completions") -> str:
    size = f"content-length: {length}\r\n" if length is not None else ""
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{size}\r\n"


def test_hostile_clients_under_a_memory_limit(tmp_path: Path) -> None:
    log = tmp_path / "h.tlog"
    with server(tmp_path, "--log", str(log), "--stub-step-time", "0.002", "--body-timeout", "2",
                "--max-stream-buffer-bytes", str(1 << 20), "--max-seq-len", "4096", "--num-blocks", "8192") as (
            proc, url):
        canary: list[list[str]] = []
        started = threading.Event()
        canary_body = {"model": "stub", "prompt": "canary", "max_tokens": 1500, "stream": True, "seed": 7}
        thread = threading.Thread(target=lambda: canary.append(stream_lines(url, canary_body, started)))
        thread.start()
        assert started.wait(60)
        rest = rss_bytes(proc.pid)

        # 600 MB announced, and sent until the server stops taking it.
        big = raw_post(url, post_head(600 << 20), (b"x" * (1 << 20) for _ in range(600)))
        assert big.startswith(b"HTTP/1.1 413"), big[:200]
        # The same without Content-Length: counted as it comes.
        chunked = raw_post(url, post_head(None)[:-2] + "transfer-encoding: chunked\r\n\r\n",
                           (b"100000\r\n" + b"x" * (1 << 20) + b"\r\n" for _ in range(600)))
        assert chunked.startswith(b"HTTP/1.1 413"), chunked[:200]
        # A body at a byte a second: 408 after --body-timeout.
        slow = raw_post(url, post_head(50), (time.sleep(0.5) or b" " for _ in range(50)))
        assert slow.startswith(b"HTTP/1.1 408"), slow[:200]
        # A stream of 128 choices with 20 logprobs each, never read (a small receive window, and no reads until
        # the server has given up on it).
        body = json.dumps({"model": "stub", "prompt": "a", "max_tokens": 1000, "n": 128, "logprobs": 20,
                           "stream": True}).encode()
        def given_up() -> None:
            with httpx.Client(base_url=url, timeout=30) as c:
                for _ in range(600):
                    if 'tickloom_slow_client_streams_total{model="stub"} 1.0' in c.get("/metrics").text:
                        return
                    time.sleep(0.1)

        ended = raw_post(url, post_head(len(body)), iter([body]), rcvbuf=4096, before_read=given_up)
        assert ended.startswith(b"HTTP/1.1 200")
        assert b"stream_buffer_full" in ended[-4096:] and b"data: [DONE]" in ended[-100:]
        # Invented paths.
        with httpx.Client(base_url=url, timeout=30) as c:
            before = len(c.get("/metrics").text)
            for i in range(500):
                c.get(f"/nope-{i}")
            assert abs(len(c.get("/metrics").text) - before) < 1024
            metrics = c.get("/metrics").text
        held = rss_bytes(proc.pid) - rest
        thread.join(120)
        assert 'tickloom_slow_client_streams_total{model="stub"} 1.0' in metrics
        assert held < 100 << 20, f"the server grew by {held / 2**20:.0f} MB"
        [lines] = canary
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        assert "".join(ch["choices"][0]["text"] for ch in chunks) and chunks[-1]["choices"][0]["finish_reason"] == \
            "length"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert_replays(log)


def test_a_full_log_disk_ends_every_stream_and_exits_with_one_line(tmp_path: Path) -> None:
    """The log's file size limit (``RLIMIT_FSIZE``) stands in for a full disk: writes past it fail."""
    log = tmp_path / "f.tlog"
    with server(tmp_path, "--log", str(log), "--stub-step-time", "0.005", limit_fsize=256 << 10) as (proc, url):
        results: list[list[str]] = []
        threads = [threading.Thread(target=lambda: results.append(stream_lines(url, {
            "model": "stub", "prompt": "x", "max_tokens": 2000, "stream": True}))) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        status = proc.wait(timeout=60)
        assert proc.stderr is not None
        err = proc.stderr.read()
    assert status == 70
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("tickloom: error: the engine failed: ") and "File too large" in last
    assert len(results) == 3
    for lines in results:
        assert lines[-1] == "[DONE]"
        assert "File too large" in json.loads(lines[-2])["error"]["message"]


def test_a_second_sigterm_ends_each_stream_with_why(tmp_path: Path) -> None:
    log = tmp_path / "t.tlog"
    with server(tmp_path, "--log", str(log), "--stub-step-time", "0.01", "--drain-timeout", "600") as (proc, url):
        results: list[list[str]] = []
        first = threading.Event()
        thread = threading.Thread(target=lambda: results.append(stream_lines(url, {
            "model": "stub", "prompt": "x", "max_tokens": 2000, "stream": True}, first)))
        thread.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        thread.join(120)
        assert proc.wait(timeout=60) == 0
    [lines] = results
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["code"] == "server_shutting_down" and "second signal" in error["message"]
    assert_replays(log)
