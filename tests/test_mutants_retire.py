"""Behavioural tests that kill mutants of the retire actor (scripts/mutate.sh --area actors) that its own tests leave
alive: groups of ``n`` choices, abandoned streams, logprobs whatever a tick's layout, buffers and protocol errors."""

from __future__ import annotations

import gc
from collections.abc import Sequence

import pytest
import trio
import trio.testing

from tickloom.actors.retire import ClientStream, GroupStream, RetireActor
from tickloom.engine.outputs import RequestOutput
from tickloom.events import (
    ClientGone,
    EmitTokens,
    Finish,
    Input,
    SamplingSpec,
    StopMatched,
    Usage,
)

# --- the retire actor: groups of n choices, abandoned streams -------------------------------------------------------


class _Letters:
    """Token i decodes to the i-th lowercase letter."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


class _Retire:
    def __init__(self, max_buffered_frames: int = 1024) -> None:
        self.reports: list[Input] = []
        self.actor = RetireActor(_Letters(), self.reports.append, max_buffered_frames, clock=lambda: 5.0)
        self.sent: dict[str, int] = {}

    def group(self, rid: str, n: int, **spec: object) -> GroupStream:
        return self.actor.open_group(rid, [f"{rid}#{i}" for i in range(n)], SamplingSpec(**spec), 2,  # type: ignore[arg-type]
                                     submitted_at=1.0)

    def tokens(self, rid: str, ids: list[int]) -> None:
        start = self.sent.get(rid, 0)
        self.sent[rid] = start + len(ids)
        self.actor.deliver_nowait([EmitTokens([rid] * len(ids), ids, list(range(start, start + len(ids))),
                                              [False] * len(ids))])

    def finish(self, rid: str, reason: str = "length") -> None:
        self.actor.deliver_nowait([Finish(rid, reason, Usage(2, 0, self.sent.get(rid, 0)), "")])  # type: ignore[arg-type]


async def _read(stream: GroupStream) -> list[RequestOutput]:
    return [frame async for frame in stream]


async def test_a_group_reads_its_choices_frames_in_arrival_order_with_their_index() -> None:
    r = _Retire()
    stream = r.group("g", 3)
    assert stream.request_id == "g" and r.actor.open_streams == 3
    r.tokens("g#1", [0])
    r.tokens("g#0", [1])
    r.tokens("g#1", [2])
    r.finish("g#1")
    r.tokens("g#2", [3])
    r.finish("g#0")
    r.finish("g#2", "stop")
    frames = await _read(stream)
    assert [(f.request_id, f.index, f.text_delta, f.finished) for f in frames] == [
        ("g", 1, "a", False), ("g", 0, "b", False), ("g", 1, "c", False), ("g", 1, "", True),
        ("g", 2, "d", False), ("g", 0, "", True), ("g", 2, "", True)]
    assert frames[-1].finish_reason == "stop" and r.actor.open_streams == 0
    assert r.reports == []


async def test_each_choice_of_a_group_reports_its_usage_and_the_prompts_logprobs() -> None:
    r = _Retire()
    stream = r.actor.open_group("g", ["g#0", "g#1"], SamplingSpec(prompt_logprobs=0), 2, submitted_at=1.0,
                                prompt_token_ids=[3, 4])
    r.actor.deliver_nowait([EmitTokens(["g#0", "g#1"], [0, 1], [0, 0], [False, False],
                                       prompt_logprobs=[[-0.5], [-0.5]])])
    r.sent.update({"g#0": 1, "g#1": 1})
    r.finish("g#0")
    r.finish("g#1")
    frames = await _read(stream)
    assert [(f.index, f.prompt_logprobs) for f in frames if not f.finished] == [
        (0, [None, {4: -0.5}]), (1, [None, {4: -0.5}])]
    finals = {f.index: f.usage for f in frames if f.finished}
    assert finals[0] is not None and finals[1] is not None
    assert finals[0].time_to_first_token_s == 4.0 and finals[1].time_to_first_token_s == 4.0
    assert finals[0].completion_tokens == 1 and finals[0].prompt_tokens == 2


async def test_a_group_waits_for_its_last_choice_and_is_woken_by_any() -> None:
    r = _Retire()
    stream = r.group("g", 2)
    got: list[tuple[int, str, bool]] = []

    async def reader() -> None:
        async for frame in stream:
            got.append((frame.index, frame.text_delta, frame.finished))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        r.tokens("g#1", [0])
        await trio.testing.wait_all_tasks_blocked()
        assert got == [(1, "a", False)]
        r.finish("g#1")
        await trio.testing.wait_all_tasks_blocked()
        assert got == [(1, "a", False), (1, "", True)], "one choice finished: the group still waits"
        r.tokens("g#0", [1])
        r.finish("g#0")
    assert got == [(1, "a", False), (1, "", True), (0, "b", False), (0, "", True)]


async def test_a_slow_group_reader_gets_each_choices_frames_coalesced() -> None:
    r = _Retire(max_buffered_frames=1)
    stream = r.group("g", 2)
    r.tokens("g#0", [0])
    r.tokens("g#1", [1])
    r.tokens("g#0", [2])
    r.tokens("g#0", [3])
    r.finish("g#1")
    r.finish("g#0")
    frames = await _read(stream)
    assert [(f.index, f.token_ids, f.text_delta, f.finished) for f in frames] == [
        (0, [0, 2, 3], "acd", True), (1, [1], "b", True)]


async def test_open_group_refuses_a_choice_id_already_open() -> None:
    r = _Retire()
    single = r.actor.open_stream("g#1", SamplingSpec(), 2, submitted_at=1.0)
    with pytest.raises(ValueError, match=r"^a stream for request 'g#1' is already open$"):
        r.group("g", 3)
    assert r.actor.open_streams == 1, "nothing of the refused group was opened"
    r.tokens("g#1", [0])
    r.finish("g#1")
    assert [f.text_delta async for f in single] == ["a", ""]


async def test_closing_a_group_reports_each_unfinished_choice_once() -> None:
    r = _Retire()
    stream = r.group("g", 3)
    r.tokens("g#0", [0])
    r.finish("g#1")
    first = await stream.__anext__()
    assert (first.index, first.text_delta) == (0, "a")
    await stream.aclose()
    stream.close_nowait()
    assert r.reports == [ClientGone("g#0"), ClientGone("g#2")]
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()  # the finished choice's final frame is dropped with the rest
    assert r.actor.open_streams == 0


async def test_a_group_left_with_async_with_cancels_its_choices() -> None:
    r = _Retire()
    async with r.group("g", 2) as stream:
        r.tokens("g#1", [0])
        async for frame in stream:
            assert frame.index == 1
            break
    assert r.reports == [ClientGone("g#0"), ClientGone("g#1")]


async def test_a_garbage_collected_group_cancels_only_if_a_choice_is_unfinished() -> None:
    r = _Retire()
    stream = r.group("g", 2)
    r.finish("g#0")
    del stream
    gc.collect()
    assert r.reports == [ClientGone("g#1")]
    done = r.group("h", 2)
    r.finish("h#0")
    r.finish("h#1")
    del done
    gc.collect()
    assert r.reports == [ClientGone("g#1")]


async def test_a_fatal_error_raises_in_a_group_at_once() -> None:
    r = _Retire()
    stream = r.group("g", 2)
    r.tokens("g#0", [0])
    error = RuntimeError("device lost")
    raised: list[BaseException] = []

    async def reader() -> None:
        try:
            async for _ in stream:
                pass
        except RuntimeError as exc:
            raised.append(exc)

    r.actor.fail_all(error)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
    assert raised == [error]
    later = r.group("h", 2)
    with pytest.raises(RuntimeError, match="device lost"):
        await later.__anext__()
    assert r.actor.open_streams == 0
    await later.aclose()
    assert r.reports == []


async def test_a_group_error_in_one_choice_raises_even_with_frames_pending() -> None:
    r = _Retire()
    stream = r.group("g", 2)
    r.tokens("g#0", [0])
    r.tokens("g#1", [1])
    stream._group.streams[1].fail(RuntimeError("only this choice"))
    with pytest.raises(RuntimeError, match="only this choice"):
        await stream.__anext__()


@pytest.mark.parametrize("layout", ["alone", "one row among others", "rows among others"])
async def test_logprobs_reach_each_stream_whatever_the_ticks_layout(layout: str) -> None:
    """A tick's columns are split by request: the request alone in the tick, one row of it among other requests'
    rows, or several rows among others. Each stream gets its own tokens, logprobs, top alternatives (only if it
    asked for them), its prompt's logprobs with output 0, and the tick's time."""
    r = _Retire()
    clock = iter([5.0, 6.0, 8.0, 8.0])
    r.actor._clock = lambda: next(clock)
    asks = r.actor.open_stream("x", SamplingSpec(logprobs=1, prompt_logprobs=0), 2, submitted_at=1.0,
                               prompt_token_ids=[3, 4])
    plain = r.actor.open_stream("y", SamplingSpec(), 2, submitted_at=1.0, prompt_token_ids=[3, 4])
    rows = {"alone": ["x", "x"], "one row among others": ["y", "x", "y"],
            "rows among others": ["x", "y", "x"]}[layout]
    xs = [i for i, rid in enumerate(rows) if rid == "x"]
    indices = [0] * len(rows)
    for rid in ("x", "y"):
        for k, i in enumerate([i for i, q in enumerate(rows) if q == rid]):
            indices[i] = k
    r.actor.deliver_nowait([EmitTokens(
        rows, [10 + i for i in range(len(rows))], indices, [False] * len(rows), [-1.0 - i for i in range(len(rows))],
        [[20 + i] for i in range(len(rows))], [[-0.5 - i] for i in range(len(rows))],
        [[-0.25] if indices[i] == 0 else [] for i in range(len(rows))])])
    r.sent = {"x": len(xs), "y": len(rows) - len(xs)}
    r.actor.deliver_nowait([EmitTokens(["x"], [12 + len(rows)], [len(xs)], [False], [-7.0], [[30]], [[-0.1]])])
    r.sent["x"] += 1
    r.finish("x")
    if "y" in rows:
        r.finish("y")
    first, second, last = [f async for f in asks]
    assert first.token_ids == [10 + i for i in xs] and first.logprobs == [-1.0 - i for i in xs]
    assert first.top_logprobs == [{20 + i: -0.5 - i, 10 + i: -1.0 - i} for i in xs]
    assert first.prompt_logprobs == [None, {4: -0.25}] and second.prompt_logprobs is None
    assert second.top_logprobs == [{30: -0.1, 12 + len(rows): -7.0}]
    assert last.usage is not None and last.usage.time_to_first_token_s == 4.0
    assert last.usage.mean_inter_token_latency_s == pytest.approx(1.0 / len(xs))
    if "y" in rows:
        others = [f async for f in plain]
        assert others[0].logprobs == [-1.0 - i for i, rid in enumerate(rows) if rid == "y"]
        assert others[0].top_logprobs is None and others[0].prompt_logprobs is None, "y asked for neither"


async def test_a_closed_stream_is_no_longer_open() -> None:
    r = _Retire()
    stream = r.actor.open_stream("x", SamplingSpec(), 2, submitted_at=1.0)
    await stream.aclose()
    assert r.actor.open_streams == 0 and r.reports == [ClientGone("x")]
    again = r.actor.open_stream("x", SamplingSpec(), 2, submitted_at=1.0)
    stream.close_nowait()  # the old stream's close leaves the new one open
    assert r.actor.open_streams == 1 and r.reports == [ClientGone("x")]
    await again.aclose()


async def test_an_abandoned_stream_ends_without_a_report_and_frees_its_id() -> None:
    r = _Retire()
    stream = r.actor.open_stream("x", SamplingSpec(), 2, submitted_at=1.0)
    r.tokens("x", [0])
    got: list[str] = []

    async def reader(client: ClientStream) -> None:
        async for frame in client:
            got.append(frame.text_delta)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader, stream)
        await trio.testing.wait_all_tasks_blocked()
        r.tokens("x", [1])
        await trio.testing.wait_all_tasks_blocked()
        r.actor.abandon("x")  # the reader wakes and ends
    assert got == ["a", "b"] and r.actor.open_streams == 0
    r.tokens("x", [2])  # nothing to deliver to
    r.actor.abandon("x")
    r.actor.abandon("never-opened")
    del stream
    gc.collect()
    assert r.reports == [], "an abandoned request never reached the core: nothing to cancel"
    again = r.actor.open_stream("x", SamplingSpec(), 2, submitted_at=1.0)
    r.sent["x"] = 0
    r.tokens("x", [3])
    r.finish("x")
    assert [f.text_delta async for f in again] == ["d", ""]


async def test_an_abandoned_stream_drops_its_pending_frames() -> None:
    r = _Retire()
    stream = r.actor.open_stream("x", SamplingSpec(), 2, submitted_at=1.0)
    r.tokens("x", [0, 1])
    r.actor.abandon("x")
    assert [f async for f in stream] == []


async def test_stop_matches_in_a_group_are_reported_per_choice() -> None:
    r = _Retire()
    stream = r.group("g", 2, stop=["b"])
    r.actor.deliver_nowait([EmitTokens(["g#0", "g#1", "g#1"], [0, 0, 1], [0, 0, 1], [False] * 3)])
    assert r.reports == [StopMatched("g#1", 1)]
    await stream.aclose()



async def test_a_retire_actor_buffers_1024_frames_per_stream_by_default() -> None:
    actor = RetireActor(_Letters(), [].append, clock=lambda: 5.0)
    stream = actor.open_stream("x", SamplingSpec(), 2, submitted_at=1.0)
    for i in range(1025):
        actor.deliver_nowait([EmitTokens(["x"], [0], [i], [False])])
    actor.deliver_nowait([Finish("x", "length", Usage(2, 0, 1025), "")])
    frames = [f async for f in stream]
    assert len(frames) == 1024 and frames[-1].finished and len(frames[-1].token_ids) == 2, "the last two merged"
    assert all(f.index == 0 and f.request_id == "x" for f in frames)
    with pytest.raises(ValueError) as info:
        RetireActor(_Letters(), [].append, 0)
    assert str(info.value) == "max_buffered_frames must be at least 1, got 0"


async def test_prompt_logprobs_a_device_did_not_report_are_none_for_a_longer_prompt() -> None:
    r = _Retire()
    spec = SamplingSpec(prompt_logprobs=0)
    lone = r.actor.open_stream("x", spec, 3, submitted_at=1.0, prompt_token_ids=[5, 6, 7])
    group = r.actor.open_group("g", ["g#0"], spec, 3, submitted_at=1.0, prompt_token_ids=[5, 6, 7])
    r.actor.deliver_nowait([EmitTokens(["x", "g#0"], [0, 1], [0, 0], [False, False])])
    assert (await lone.__anext__()).prompt_logprobs is None
    assert (await group.__anext__()).prompt_logprobs is None


async def test_a_stream_opened_after_a_fatal_error_keeps_its_id() -> None:
    r = _Retire()
    r.actor.fail_all(RuntimeError("gone"))
    stream = r.actor.open_stream("late", SamplingSpec(), 2, submitted_at=1.0)
    assert stream.request_id == "late"
    with pytest.raises(RuntimeError, match="gone"):
        await stream.__anext__()


def test_tokens_out_of_order_are_a_protocol_error_naming_the_request() -> None:
    from tickloom.actors.streams import StreamProtocolError

    r = _Retire()
    stream = r.actor.open_stream("x", SamplingSpec(), 2, submitted_at=1.0)
    with pytest.raises(StreamProtocolError, match=r"^'x': expected token index 0, got 5$"):
        r.actor.deliver_nowait([EmitTokens(["x"], [0], [5], [False])])
    assert stream.request_id == "x"
