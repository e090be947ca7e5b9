"""Acknowledged means logged: a token or finish a client received is in the log, even after ``kill -9``.

* In process: at the moment the step actor hands a tick's ``EmitTokens``/``Finish`` to the retire actor, the
  tick's frame (and every earlier one) is already in the file, not in the writer's buffer.
* End to end: a real ``tickloom generate --json`` subprocess (stub model, real clock, several concurrent prompts)
  is killed with SIGKILL at many points, after reading k of its output lines or after a random sleep. For every
  point the torn tail is recovered, every request's logged tokens start with the tokens the client printed
  (and a printed finish is logged), and the recovered log replays identically.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
import trio.testing
from engine_helpers import assert_replays, stub_config

from tickloom import Engine, EngineError, SamplingParams
from tickloom.actors.step import Delivers
from tickloom.events import Command, EmitTokens, Finish, LogReader, recover_log
from tickloom.replay import verify

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["first prompt", "the second one", "3rd", "a fourth, longer prompt to prefill"]
MAX_TOKENS = 48
STEP_TIME = 0.01
"""Seconds per stub step: with pipeline depth 2, a run streams for about MAX_TOKENS * STEP_TIME seconds."""


class _CheckedRetire:
    """Stands between the step actor and the retire actor; checks the log on disk at every delivery."""

    def __init__(self, inner: Delivers, engine: Engine, log: Path) -> None:
        self.inner = inner
        self.engine = engine
        self.log = log
        self.deliveries = 0

    def deliver_nowait(self, commands: list[Command]) -> None:
        runtime = self.engine.runtime
        assert runtime.log is not None
        writer = runtime.log.writer
        assert writer.pending_bytes == 0, "a client-visible tick left before its frame was written"
        assert os.path.getsize(self.log) == writer.bytes_written
        with LogReader(self.log) as reader:
            last = list(reader.ticks())[-1]
        assert last.inputs.tick == runtime.step.tick - 1, "the delivering tick is the last one on disk"
        assert all(command in last.outputs.commands for command in commands)
        self.deliveries += 1
        self.inner.deliver_nowait(commands)


async def test_tokens_reach_the_retire_actor_only_after_their_frame_is_written(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log, fsync="never")) as engine:
        checked = _CheckedRetire(engine.runtime.step._retire, engine, log)
        engine.runtime.step._retire = checked
        results: dict[str, list[int]] = {}

        async def one(i: int) -> None:
            tokens: list[int] = []
            async for out in engine.generate(f"prompt {i}", SamplingParams(max_tokens=20, seed=i),
                                             request_id=f"r{i}"):
                tokens += out.token_ids
            results[f"r{i}"] = tokens

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
    assert checked.deliveries > 0
    assert {rid: len(tokens) for rid, tokens in results.items()} == {"r0": 20, "r1": 20, "r2": 20}
    assert_replays(log)


async def test_a_failed_write_is_fatal_and_nothing_of_its_tick_reaches_the_client(
        tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "run.tlog"
    received: list[int] = []
    with pytest.raises(EngineError, match="the log actor failed") as info:
        async with Engine.open(stub_config(log)) as engine:
            await engine.complete("warm", SamplingParams(max_tokens=3))

            def full_disk(self: object) -> None:
                raise OSError(28, "No space left on device")

            monkeypatch.setattr("tickloom.events.log.LogWriter.flush", full_disk)
            with pytest.raises(EngineError):
                async for out in engine.generate("go", SamplingParams(max_tokens=1000)):
                    received += out.token_ids
    assert info.value.actor == "log" and "No space left on device" in str(info.value)
    assert received == [], "no token of an unwritten tick reached the client"
    monkeypatch.undo()
    assert recover_log(log).bytes_dropped == 0
    assert_replays(log)


@dataclass
class _Seen:
    """What the client printed for one request."""

    tokens: list[int] = field(default_factory=list)
    finished: str | None = None


def _client_view(lines: list[str]) -> dict[str, _Seen]:
    seen: dict[str, _Seen] = {}
    for line in lines:
        frame = json.loads(line)
        if "summary" in frame:
            continue
        entry = seen.setdefault(frame["request_id"], _Seen())
        assert entry.finished is None, "no frame after the final one"
        entry.tokens += frame["token_ids"]
        if frame["finished"]:
            entry.finished = frame["finish_reason"]
    return seen


def _logged(path: Path) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Each request's output tokens (in index order) and finish reasons, from the log."""
    tokens: dict[str, list[int]] = {}
    finishes: dict[str, str] = {}
    with LogReader(path) as reader:
        for record in reader.ticks():
            for command in record.outputs.commands:
                if isinstance(command, EmitTokens):
                    for rid, token, index in zip(command.request_ids, command.token_ids, command.token_indices,
                                                 strict=True):
                        out = tokens.setdefault(rid, [])
                        assert index == len(out), f"{rid}: token {index} logged after {len(out)} tokens"
                        out.append(token)
                elif isinstance(command, Finish):
                    finishes[command.request_id] = command.reason
        assert reader.tail.torn_bytes == 0
    return tokens, finishes


@dataclass(frozen=True)
class _Point:
    """Kill after reading ``lines`` output lines, then sleeping ``sleep`` seconds."""

    lines: int
    sleep: float = 0.0


@dataclass
class _Outcome:
    killed: bool
    """The process died of SIGKILL (not: it had already finished)."""
    client_tokens: int
    logged_tokens: int
    bytes_dropped: int


def _run_and_kill(path: Path, point: _Point, seed: int) -> _Outcome:
    argv = [sys.executable, "-m", "tickloom", "generate", "--model", "stub", "--json", "--log", str(path),
            "--max-tokens", str(MAX_TOKENS), "--stub-step-time", str(STEP_TIME), "--seed", str(seed), *PROMPTS]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    try:
        read: list[bytes] = []
        while len(read) < point.lines:
            line = proc.stdout.readline()
            if not line:
                break
            read.append(line)
        time.sleep(point.sleep)
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read()  # whatever the client printed before it died, unread in the pipe
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    killed = proc.returncode == -signal.SIGKILL
    if not killed:
        assert proc.returncode == 0
    output = b"".join(read) + rest
    complete = output[: output.rfind(b"\n") + 1].decode()  # a torn last line is text no one could parse
    seen = _client_view(complete.splitlines())
    if not path.exists() or path.stat().st_size == 0:
        assert not seen, "the client saw tokens but no log was written"
        return _Outcome(killed, 0, 0, 0)
    recovery = recover_log(path)
    logged, finishes = _logged(path)
    for rid, client in seen.items():
        assert logged.get(rid, [])[: len(client.tokens)] == client.tokens, f"{rid}: a received token is not logged"
        if client.finished is not None:
            assert finishes.get(rid) == client.finished, f"{rid}: a received finish is not logged"
            assert len(logged[rid]) == len(client.tokens)
    report = verify(path)
    assert report.status == "identical", report.format_text()
    return _Outcome(killed, sum(len(s.tokens) for s in seen.values()), sum(map(len, logged.values())),
                    recovery.bytes_dropped)


@pytest.mark.slow
def test_kill_9_at_many_points_loses_no_acknowledged_token(tmp_path: Path) -> None:
    rng = random.Random(20240610)
    total_lines = len(PROMPTS) * (MAX_TOKENS + 1)
    points = [_Point(lines=k) for k in (1, 2, 3, 5, 8, 13, 21, 34, 55, 80, 110, 140, 170, 190)]
    points += [_Point(lines=rng.randrange(1, total_lines)) for _ in range(4)]
    points += [_Point(lines=1, sleep=rng.uniform(0.0, MAX_TOKENS * STEP_TIME * 0.8)) for _ in range(8)]
    points += [_Point(lines=0, sleep=s) for s in (0.05, 0.3)]  # may land before the engine starts
    outcomes = [_run_and_kill(tmp_path / f"kill-{i}.tlog", point, seed=i) for i, point in enumerate(points)]
    mid_run = [o for o in outcomes if o.killed and o.client_tokens > 0]
    print(f"kill points: {len(points)} tried, {sum(o.killed for o in outcomes)} killed before exit, "
          f"{len(mid_run)} killed mid-stream; all recovered and replayed; torn bytes dropped: "
          f"{[o.bytes_dropped for o in outcomes]}; client/logged tokens: "
          f"{[(o.client_tokens, o.logged_tokens) for o in outcomes]}")
    assert len(mid_run) >= 20, "most kills must land while tokens are streaming"
