"""E06: the engine API inside ``asyncio.run``, through trio's guest mode (``tickloom.asyncio``).

The stub model runs on trio's real clock here (asyncio has no virtual clock), with a small step time. A cancelled
request is given far more tokens than the others, so it is still running when its cancel lands.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Literal

import pytest

from tickloom import EngineConfig, EngineError, RequestOutput, RequestRejected, SamplingParams
from tickloom.asyncio import Engine, _hosts
from tickloom.events import Finish, LogReader
from tickloom.replay import verify


def _config(tmp_path: Path, name: str = "e06.tlog", **kw: object) -> EngineConfig:
    return EngineConfig(model="stub", stub_step_time=0.002, log_path=str(tmp_path / name), **kw)  # type: ignore[arg-type]


def _logged_finishes(path: Path) -> dict[str, str]:
    with LogReader(path) as log:
        return {c.request_id: c.reason for t in log.ticks() for c in t.outputs.commands if isinstance(c, Finish)}


@pytest.mark.parametrize("how", ["cancel", "break"])
def test_e06_asyncio_eight_requests_one_cancelled(tmp_path: Path, how: Literal["cancel", "break"]) -> None:
    victim = "req-3"
    seen: dict[str, list[RequestOutput]] = {}

    async def consume(engine: Engine, i: int) -> None:
        rid = f"req-{i}"
        frames = seen.setdefault(rid, [])
        params = SamplingParams(max_tokens=1500 if rid == victim else 20, seed=i)
        async for out in engine.generate(f"prompt {i}", params, request_id=rid):
            frames.append(out)
            if rid == victim and len(frames) == 3:
                if how == "cancel":
                    await engine.cancel(rid)  # the stream goes on to its `cancelled` frame
                else:
                    break  # leaving the stream cancels the request

    async def main() -> dict[str, object]:
        async with Engine.open(_config(tmp_path, max_seq_len=2048)) as engine:
            async with asyncio.TaskGroup() as tg:
                for i in range(8):
                    tg.create_task(consume(engine, i))
            assert await engine.drain(timeout=30)
            return engine.stats()

    stats = asyncio.run(main())
    assert len(seen) == 8
    for rid, frames in seen.items():
        tokens = sum(len(f.token_ids) for f in frames)
        if rid == victim:
            assert 3 <= tokens < 1500
            if how == "cancel":
                assert frames[-1].finished and frames[-1].finish_reason == "cancelled"
                assert frames[-1].usage is not None and frames[-1].usage.completion_tokens == tokens
            else:
                assert not frames[-1].finished
            continue
        assert frames[-1].finished and frames[-1].finish_reason == "length", rid
        assert tokens == 20
        assert "".join(f.text_delta for f in frames)
    assert stats["running"] == 0 and stats["waiting"] == 0
    finishes = _logged_finishes(tmp_path / "e06.tlog")
    assert finishes == {f"req-{i}": "cancelled" if f"req-{i}" == victim else "length" for i in range(8)}
    assert verify(tmp_path / "e06.tlog").exit_code == 0  # E07
    assert not _hosts  # the loop (and with it its guest host) is gone


def test_asyncio_task_cancellation_cancels_the_request(tmp_path: Path) -> None:
    async def main() -> list[RequestOutput]:
        frames: list[RequestOutput] = []
        async with Engine.open(_config(tmp_path)) as engine:
            first = asyncio.Event()

            async def consume() -> None:
                async for out in engine.generate("abc", SamplingParams(max_tokens=1500), request_id="slow"):
                    frames.append(out)
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await engine.drain(timeout=30)
        return frames

    frames = asyncio.run(main())
    assert frames and not frames[-1].finished
    assert _logged_finishes(tmp_path / "e06.tlog") == {"slow": "cancelled"}


def test_asyncio_complete_stream_and_two_engines_share_the_guest_run(tmp_path: Path) -> None:
    async def main() -> tuple[RequestOutput, RequestOutput, str]:
        async with Engine.open(_config(tmp_path, "a.tlog")) as a, Engine.open(_config(tmp_path, "b.tlog")) as b:
            host = _hosts[asyncio.get_running_loop()]
            assert host._users == 2
            params = SamplingParams(max_tokens=12, temperature=0)
            ra, rb = await asyncio.gather(a.complete("same", params), b.complete("same", params))
            with pytest.raises(RequestRejected):
                a.generate("", params)  # rejected at the call, before any stream opens
            text = ""
            async with b.stream("other", SamplingParams(max_tokens=1500), request_id="s") as stream:
                async for out in stream:
                    text += out.text_delta
                    if len(text) >= 2:
                        break
        assert host._users == 0 and host._token is None
        return ra, rb, text

    ra, rb, text = asyncio.run(main())
    assert ra.finish_reason == rb.finish_reason == "length"
    assert ra.token_ids == rb.token_ids and len(ra.token_ids) == 12 and ra.text_delta
    assert len(text) >= 2
    assert _logged_finishes(tmp_path / "b.tlog")["s"] == "cancelled"
    for name in ("a.tlog", "b.tlog"):
        assert verify(tmp_path / name).exit_code == 0


def test_asyncio_actor_crash_raises_engine_error(tmp_path: Path) -> None:
    from tickloom import FaultPlan

    config = _config(tmp_path, faults=FaultPlan(crash_actor="deadlines", crash_after=0.05))

    async def main() -> None:
        async with Engine.open(config) as engine:
            with pytest.raises(EngineError, match="deadlines"):
                async for _ in engine.generate("abc", SamplingParams(max_tokens=1500)):
                    pass

    with pytest.raises(EngineError, match="deadlines"):
        asyncio.run(main())


def test_asyncio_cancelled_waits_lose_no_frame(tmp_path: Path) -> None:
    async def main() -> tuple[int, int, str | None]:
        async with Engine.open(_config(tmp_path)) as engine:
            stream = engine.generate("abc", SamplingParams(max_tokens=40))
            tokens = timeouts = 0
            last: RequestOutput | None = None
            while True:
                try:
                    # Waits shorter than a step: many are cancelled, some just as a frame arrives.
                    last = await asyncio.wait_for(stream.__anext__(), timeout=0.0005)
                except TimeoutError:
                    timeouts += 1
                    continue
                except StopAsyncIteration:
                    break
                tokens += len(last.token_ids)
            assert last is not None
            return tokens, timeouts, last.finish_reason

    tokens, timeouts, reason = asyncio.run(main())
    assert (tokens, reason) == (40, "length")
    assert timeouts > 0
