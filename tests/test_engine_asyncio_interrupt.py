"""Ending an asyncio app's engine by cancellation: a second Ctrl-C, or ``asyncio.run`` cancelling the tasks left
when its main coroutine returns (what uvicorn's forced exit does), closes the engine in order: the open stream ends
with the engine's shutdown error, the log records it, and the process exits, without a traceback.

Before, the engine's trio task was cancelled along with its asyncio caller: its actors were cancelled under the
shielded shutdown, which waited out its whole timeout for them, and the open request never ended in the log.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tickloom import EngineConfig, RequestOutput, SamplingParams
from tickloom.asyncio import Engine, _hosts
from tickloom.events import Finish, LogReader
from tickloom.replay import verify


def _finishes(path: Path) -> dict[str, tuple[str, str]]:
    with LogReader(path) as log:
        return {c.request_id: (c.reason, c.error) for t in log.ticks() for c in t.outputs.commands
                if isinstance(c, Finish)}


# A server's shape, as uvicorn has it: the engine lives in a lifespan task, a handler task streams a long request;
# the first Ctrl-C waits for open streams, the second returns from main at once, and asyncio.run cancels the rest.
APP = textwrap.dedent("""
    import asyncio, signal, sys
    from tickloom import EngineConfig, SamplingParams
    from tickloom.asyncio import Engine

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop, force, ready, close = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()
        interrupts = 0

        def on_sigint(signum, frame):
            nonlocal interrupts
            interrupts += 1
            loop.call_soon_threadsafe((stop if interrupts == 1 else force).set)

        signal.signal(signal.SIGINT, on_sigint)
        engines = []

        async def lifespan():
            config = EngineConfig(model="stub", stub_step_time=0.002, max_seq_len=8192, log_path=sys.argv[1])
            async with Engine.open(config) as engine:
                engines.append(engine)
                ready.set()
                await close.wait()

        async def handler():
            async for out in engines[0].generate("hello", SamplingParams(max_tokens=8000), request_id="open"):
                if out.token_ids and not streaming.done():
                    streaming.set_result(None)

        life = asyncio.create_task(lifespan())
        await ready.wait()
        streaming = loop.create_future()
        stream = asyncio.create_task(handler())
        await streaming
        print("streaming", flush=True)
        await stop.wait()
        print("stopping", flush=True)
        forced = asyncio.create_task(force.wait())
        await asyncio.wait([stream, forced], return_when=asyncio.FIRST_COMPLETED)
        if not force.is_set():
            raise SystemExit("the stream ended before the second interrupt")
        print("forced", flush=True)  # leave the engine and the stream to asyncio.run's cancellation

    asyncio.run(main())
    print("exited", flush=True)
""")


def test_second_ctrl_c_ends_the_stream_and_the_engine(tmp_path: Path) -> None:
    app, log = tmp_path / "app.py", tmp_path / "app.tlog"
    app.write_text(APP)
    proc = subprocess.Popen([sys.executable, str(app), str(log)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "streaming"
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline().strip() == "stopping"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)  # guards against a hang only
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert out.split() == ["forced", "exited"]
    assert "Traceback" not in err and "tickloom" not in err, err
    assert _finishes(log) == {"open": ("error", "engine shut down")}
    assert verify(log).exit_code == 0


def _config(tmp_path: Path) -> EngineConfig:
    return EngineConfig(model="stub", stub_step_time=0.002, max_seq_len=8192, log_path=str(tmp_path / "run.tlog"))


def test_cancelling_the_task_that_holds_the_engine_twice_closes_it_in_order(tmp_path: Path) -> None:
    async def main() -> tuple[list[RequestOutput], bool]:
        frames: list[RequestOutput] = []
        first = asyncio.Event()
        consumers: list[asyncio.Task[None]] = []

        async def hold() -> None:
            async with Engine.open(_config(tmp_path)) as engine:

                async def consume() -> None:
                    async for out in engine.generate("hi", SamplingParams(max_tokens=8000), request_id="open"):
                        frames.append(out)
                        first.set()

                consumers.append(asyncio.create_task(consume()))
                await asyncio.Event().wait()

        holder = asyncio.create_task(hold())
        await first.wait()
        holder.cancel()
        await asyncio.sleep(0)  # the engine is closing
        holder.cancel()  # a second interrupt, as asyncio.run's ending cancels every task left
        with pytest.raises(asyncio.CancelledError):
            await holder
        await consumers[0]  # the stream ends with the shutdown's frame
        return frames, not _hosts

    frames, no_host = asyncio.run(main())
    assert frames[-1].finished and (frames[-1].finish_reason, frames[-1].error) == ("error", "engine shut down")
    assert no_host, "the guest run ended with its last engine"
    assert _finishes(tmp_path / "run.tlog") == {"open": ("error", "engine shut down")}
    assert verify(tmp_path / "run.tlog").exit_code == 0


@pytest.mark.parametrize("turns", [0, 1, 2, 4, 8, 16, 32, 64])
def test_cancelled_while_opening_leaves_nothing_behind(tmp_path: Path, turns: int) -> None:
    """Cancelled after ``turns`` loop turns: while the guest run starts, while the engine opens, or once open."""

    async def main() -> bool:
        async def hold() -> None:
            async with Engine.open(_config(tmp_path)):
                await asyncio.Event().wait()

        task = asyncio.create_task(hold())
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return not _hosts

    assert asyncio.run(main())
