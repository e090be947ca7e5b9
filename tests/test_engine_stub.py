"""E02–E05, E07: the engine with every actor running, on the stub model under ``MockClock``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio
from engine_helpers import assert_replays, core_finishes, joined, stub_config

from tickloom import (
    Engine,
    EngineError,
    EngineOverloaded,
    FaultPlan,
    RequestOutput,
    RequestRejected,
    SamplingParams,
)
from tickloom.events import LogReader, Preempted, recover_log


async def test_e02_leaving_the_stream_cancels(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log)) as engine:
        seen = 0
        async for out in engine.generate("hello", SamplingParams(max_tokens=100, seed=1), request_id="plain"):
            seen += len(out.token_ids)
            if seen >= 3:
                break
        async with engine.stream("hello", SamplingParams(max_tokens=100), request_id="ctx") as stream:
            async for out in stream:
                if out.token_ids:
                    break
        await trio.sleep(0.05)  # a few ticks of 10 ms
        stats = engine.stats()
        assert stats["blocks_free"] + stats["blocks_cached"] == stats["blocks_total"], "blocks are free"
        assert not engine.runtime.live
    finishes = core_finishes(log)
    assert finishes["plain"].reason == "cancelled" and finishes["ctx"].reason == "cancelled"
    assert_replays(log)



async def test_e02_a_stream_closed_just_before_the_engine_ends_cancelled(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """The stream's ClientGone is still pending in the retire reporter (delayed here) when the engine closes: the
    shutdown waits for it, so the request ends ``cancelled``, not with the shutdown's error."""
    log = tmp_path / "run.tlog"
    async with (Engine.open(stub_config(log, faults=FaultPlan(report_delay=0.5))) as engine,
                engine.stream("hello", SamplingParams(max_tokens=1000), request_id="late-close") as stream):
        async for out in stream:
            if out.token_ids:
                break
    finish = core_finishes(log)["late-close"]
    assert (finish.reason, finish.error) == ("cancelled", "")
    assert_replays(log)

async def test_e03_deadline_during_an_in_flight_step(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log, stub_step_time=0.1)) as engine:
        frames = [out async for out in engine.generate("hi", SamplingParams(max_tokens=50), deadline=0.35)]
    tokens, _, last = joined(frames)
    assert last.finish_reason == "timeout" and last.usage is not None
    assert 1 <= len(tokens) <= 4 and last.usage.completion_tokens == len(tokens), "the tokens so far, delivered"
    assert trio.current_time() < 1.0, "no hang"
    assert_replays(log)


async def _stop_run(log: Path, stop: list[str], report_delay: float) -> tuple[list[RequestOutput], str]:
    faults = FaultPlan(report_delay=report_delay)
    async with Engine.open(stub_config(log, faults=faults)) as engine:
        frames = [out async for out in engine.generate("abc", SamplingParams(max_tokens=30, seed=5, stop=stop))]
    return frames, core_finishes(log)[frames[-1].request_id].reason


async def test_e04_stop_strings(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    plain, _ = await _stop_run(tmp_path / "plain.tlog", [], 0.0)
    text = joined(plain)[1]
    stop = text[6:8]  # spans the boundary between tokens 6 and 7 (one character per stub token)
    assert stop not in text[:7]
    at_once, core_reason = await _stop_run(tmp_path / "once.tlog", [stop], 0.0)
    late, _ = await _stop_run(tmp_path / "late.tlog", [stop], 0.05)  # the match reaches the core 5 ticks later
    for frames in (at_once, late):
        tokens, got, last = joined(frames)
        assert got == text[:6], "the text ends before the stop string"
        assert last.finish_reason == "stop" and last.usage is not None
        assert last.usage.completion_tokens == 8 and len(tokens) == 8
    assert at_once[-1].usage == late[-1].usage
    assert core_reason == "stop", "the core stopped scheduling the sequence"
    _with_stop, _ = await _stop_run(tmp_path / "incl.tlog", [stop], 0.0)
    for name in ("plain", "once", "late", "incl"):
        assert_replays(tmp_path / f"{name}.tlog")


async def test_e04_include_stop_str(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log)) as engine:
        text = (await engine.complete("abc", SamplingParams(max_tokens=30, seed=5))).text_delta
        out = await engine.complete("abc", SamplingParams(max_tokens=30, seed=5, stop=[text[6:8]],
                                                           include_stop_str_in_output=True))
    assert out.text_delta == text[:8] and out.finish_reason == "stop"
    assert_replays(log)


async def test_e05_step_failure_affects_only_its_requests(tmp_path: Path,
                                                          autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log, faults=FaultPlan(fail_steps=[4]))) as engine:
        first = await engine.complete("early", SamplingParams(max_tokens=20))
        async with trio.open_nursery() as nursery:
            results: dict[str, RequestOutput] = {}

            async def run(name: str) -> None:
                results[name] = await engine.complete(name, SamplingParams(max_tokens=5), request_id=name)

            for name in ("late-a", "late-b"):
                nursery.start_soon(run, name)
    assert first.finish_reason == "error" and "step 4 failed" in (first.error or "")
    assert all(r.finish_reason == "length" for r in results.values())
    assert_replays(log)


async def test_e05_spill_and_swap_in_faults(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    faults = FaultPlan(fail_spill=["r5"], fail_swap_in=["r4"])
    config = stub_config(log, num_blocks=12, max_seq_len=96, spill_dir=str(tmp_path / "spill"), faults=faults,
                         max_batch_size=8)
    outs: dict[str, RequestOutput] = {}
    async with Engine.open(config) as engine:
        async with trio.open_nursery() as nursery:
            async def run(i: int) -> None:
                rid = f"r{i}"
                outs[rid] = await engine.complete("x" * 20, SamplingParams(max_tokens=40, seed=i), request_id=rid)

            for i in range(6):
                nursery.start_soon(run, i)
                await trio.sleep(0.001)
        assert engine.stats()["swaps"] > 0
    with LogReader(log) as reader:
        modes = {(c.request_id, c.mode) for t in reader.ticks() for c in t.outputs.commands
                 if isinstance(c, Preempted)}
    swapped = {rid for rid, mode in modes if mode == "swap"}
    assert {"r4", "r5"} <= swapped, modes
    assert outs["r4"].finish_reason == "error" and "swap-in failed" in (outs["r4"].error or "")
    for rid, out in outs.items():
        if rid != "r4":
            assert out.finish_reason == "length" and len(out.token_ids) == 40, (rid, out)
    assert not list((tmp_path / "spill").iterdir()), "spill files are removed"
    assert_replays(log)


@pytest.mark.parametrize("actor", ["deadlines", "retire", "spill", "swap-in", "log"])
async def test_e05_actor_crash_is_fatal(actor: str, tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    config = stub_config(log, spill_dir=str(tmp_path / "spill"),
                         faults=FaultPlan(crash_actor=actor, crash_after=0.5))
    raised: list[BaseException] = []
    with pytest.raises(EngineError, match=f"the {actor} actor failed: RuntimeError: injected crash") as info:
        async with Engine.open(config) as engine:
            async def client(i: int) -> None:
                try:
                    async for _ in engine.generate("go", SamplingParams(max_tokens=1000, seed=i)):
                        pass
                except EngineError as exc:
                    raised.append(exc)
                    raise

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(client, i)
    assert info.value.actor == actor
    assert trio.current_time() < 1.5, "every stream ended within one second of the crash"
    assert len(raised) == 3 and all(isinstance(e, EngineError) and e.actor == actor for e in raised)
    assert recover_log(log).bytes_dropped == 0, "the log ends at its last whole frame"
    assert_replays(log)


async def test_e05_log_write_error_is_fatal(tmp_path: Path, autojump_clock: trio.testing.MockClock,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "run.tlog"
    with pytest.raises(EngineError, match="the log actor failed") as info:
        async with Engine.open(stub_config(log)) as engine:
            await engine.complete("warm", SamplingParams(max_tokens=3))
            await trio.sleep(0.2)  # the log actor flushes every 50 ms: these frames reach the file

            def full_disk(self: object) -> None:
                raise OSError(28, "No space left on device")

            monkeypatch.setattr("tickloom.events.log.LogWriter.flush", full_disk)
            with pytest.raises(EngineError):
                async for _ in engine.generate("go", SamplingParams(max_tokens=1000)):
                    pass
    assert "No space left on device" in str(info.value)
    monkeypatch.undo()
    assert_replays(log)


async def test_e05_rejected_requests_open_no_stream(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log, max_seq_len=64)) as engine:
        with pytest.raises(RequestRejected, match="empty"):
            engine.generate("", SamplingParams())
        with pytest.raises(RequestRejected, match="max_seq_len=64"):
            engine.generate("x" * 64, SamplingParams())
        with pytest.raises(RequestRejected, match="outside vocab_size=96"):
            engine.generate([1, 2, 500], SamplingParams())
        with pytest.raises(RequestRejected, match=r"SamplingParams\.top_p=0"):
            SamplingParams(top_p=0)
        with pytest.raises(RequestRejected, match="deadline"):
            engine.generate("ok", deadline=-1)
        assert not engine.runtime.live
    assert_replays(log)


async def test_e07_every_run_replays_with_the_cli(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log, snapshot_every=4)) as engine, trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(engine.complete, f"p{i}", SamplingParams(max_tokens=12, seed=i))
    result = subprocess.run([sys.executable, "-m", "tickloom", "replay", str(log)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("identical:")


async def test_errors_raised_inside_the_block_come_out_unwrapped(tmp_path: Path,
                                                                 autojump_clock: trio.testing.MockClock) -> None:
    with pytest.raises(KeyError, match="mine"):
        async with Engine.open(stub_config(tmp_path / "run.tlog")):
            raise KeyError("mine")


async def test_chat_messages_on_the_stub(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log)) as engine:
        out = await engine.complete([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4))
        assert out.finish_reason == "length"
        out = await engine.complete([{"role": "user", "content": "caf\u00e9\n\tok"}], SamplingParams(max_tokens=4))
        assert out.finish_reason == "length"  # the stub tokenizer takes any text
        with pytest.raises(RequestRejected, match="not encodable as UTF-8"):
            engine.generate([{"role": "user", "content": "lone \ud800"}])
    assert_replays(log)


async def test_overload_reject_and_drain(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log, max_waiting=4, max_batch_size=2, overload="reject")) as engine:
        streams = [engine.generate("go", SamplingParams(max_tokens=20), request_id=f"r{i}") for i in range(4)]
        for stream in streams:
            await stream.start()
        with pytest.raises(EngineOverloaded, match="waiting queue is full"):
            await engine.generate("one more", SamplingParams(max_tokens=20)).start()
        assert await engine.drain(timeout=10.0), "the open requests finish"
        for stream in streams:
            frames = [out async for out in stream]
            assert frames[-1].finish_reason == "length"
        with pytest.raises(EngineOverloaded, match="draining"):
            await engine.generate("after drain").start()
    assert_replays(log)


async def test_drain_times_out_and_shutdown_ends_the_rest(tmp_path: Path,
                                                          autojump_clock: trio.testing.MockClock) -> None:
    log = tmp_path / "run.tlog"
    stream = None
    async with Engine.open(stub_config(log, max_seq_len=4096, num_blocks=512)) as engine:
        stream = engine.generate("long", SamplingParams(max_tokens=3000))
        await stream.start()
        assert not await engine.drain(timeout=0.5)
    frames = [out async for out in stream]
    assert frames[-1].finish_reason == "error" and frames[-1].error == "engine shut down"
    assert_replays(log)
