"""Behavioural tests that kill the mutants of the actors area (scripts/mutate.sh --area actors): the log actor's
fsync policy and group commit, the mailbox (stamping, bounded reporting), the deadline actor's bound and heap, and
the stream assembly of the retire actor."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from tickloom.actors.deadlines import DeadlineActor
from tickloom.actors.log import FLUSH_BYTES, FLUSH_INTERVAL, LogActor, LogWriteFailed, parse_fsync
from tickloom.actors.mailbox import ChannelOverflow, Envelope, Outbox, Reporter, Source
from tickloom.events import ClientGone, UnwatchDeadline, WatchDeadline

# --- the log actor ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "seconds"), [("never", None), ("tick", None), ("1ms", 0.001), ("5ms", 0.005),
                                                 ("250ms", 0.25), ("1000ms", 1.0), ("999999999ms", 999999.999)])
def test_parse_fsync_accepts(policy: str, seconds: float | None) -> None:
    assert parse_fsync(policy) == seconds


@pytest.mark.parametrize("policy", ["0ms", "ms", "5", "5s", "x5ms", "-5ms", "5 ms", "5MS", "TICK", "Never", "", "0"])
def test_parse_fsync_refuses(policy: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_fsync(policy)
    assert str(info.value) == f"fsync={policy!r} must be 'never', 'tick' or '<N>ms' with N > 0"


class FakeWriter:
    def __init__(self, fail: str = "") -> None:
        self.path = "the.tlog"
        self.pending_bytes = 0
        self.flushes: list[float] = []
        self.fsyncs: list[int] = []
        self.fail = fail

    def flush(self) -> None:
        if self.fail == "flush":
            raise OSError(28, "No space left on device")
        self.flushes.append(trio.current_time())
        self.pending_bytes = 0

    def fsync(self) -> None:
        if self.fail == "fsync":
            raise OSError(5, "Input/output error")
        self.fsyncs.append(len(self.flushes))  # runs in a worker thread: how many flushes came before it


async def test_flush_if_large_flushes_from_the_threshold_on() -> None:
    writer = FakeWriter()
    actor = LogActor(writer, "never")  # type: ignore[arg-type]
    writer.pending_bytes = FLUSH_BYTES - 1
    actor.flush_if_large()
    assert writer.flushes == []
    writer.pending_bytes = FLUSH_BYTES
    actor.flush_if_large()
    assert len(writer.flushes) == 1


async def test_write_errors_are_log_write_failed_naming_the_file() -> None:
    actor = LogActor(FakeWriter("flush"), "never")  # type: ignore[arg-type]
    with pytest.raises(LogWriteFailed) as info:
        actor.flush()
    assert str(info.value) == "writing the.tlog failed: [Errno 28] No space left on device"
    assert isinstance(info.value.__cause__, OSError)
    actor = LogActor(FakeWriter("fsync"), "5ms")  # type: ignore[arg-type]
    with pytest.raises(LogWriteFailed) as info:
        await actor.sync()
    assert str(info.value) == "fsync of the.tlog failed: [Errno 5] Input/output error"


async def test_sync_flushes_then_fsyncs() -> None:
    writer = FakeWriter()
    await LogActor(writer, "never").sync()  # type: ignore[arg-type]
    assert len(writer.flushes) == 1 and writer.fsyncs == [1]


@pytest.mark.parametrize(("policy", "flushes", "fsyncs"), [("never", 4, 0), ("tick", 4, 0), ("20ms", 10, 10)])
async def test_run_flushes_and_fsyncs_on_the_policy_clock(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, policy: str, flushes: int, fsyncs: int
) -> None:
    async def inline(fn: object) -> object:  # no worker thread: the mock clock would jump while one runs
        return fn()  # type: ignore[operator]

    monkeypatch.setattr(trio.to_thread, "run_sync", inline)
    writer = FakeWriter()
    actor = LogActor(writer, policy)  # type: ignore[arg-type]
    with trio.move_on_after(4 * FLUSH_INTERVAL + 0.001):
        await actor.run()
    assert len(writer.flushes) == flushes and len(writer.fsyncs) == fsyncs
    interval = FLUSH_INTERVAL if fsyncs == 0 else 0.02
    assert writer.flushes == pytest.approx([interval * (i + 1) for i in range(flushes)])
    if fsyncs:
        assert writer.fsyncs == list(range(1, fsyncs + 1))  # each fsync after its flush


# --- the mailbox --------------------------------------------------------------------------------------------------


async def test_an_outbox_stamps_its_source_and_a_rising_sequence() -> None:
    send, receive = trio.open_memory_channel[Envelope](10)
    outbox = Outbox(Source.RETIRE, send)
    messages = [ClientGone(f"r{i}") for i in range(5)]
    for msg in messages:
        await outbox.send(msg)
    got = [receive.receive_nowait() for _ in messages]
    assert [e.msg for e in got] == messages
    assert {e.source for e in got} == {int(Source.RETIRE)} and all(type(e.source) is int for e in got)
    seqs = [e.seq for e in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and seqs[0] >= 0
    # arrival order never matters: sorted, one source's inputs come back in the order they were stamped
    shuffled = got[:]
    random.Random(3).shuffle(shuffled)
    assert [e.msg for e in sorted(shuffled)] == messages
    other = Outbox(Source.CLIENT, send)
    await other.send(ClientGone("c"))
    first = receive.receive_nowait()
    assert sorted([got[0], first])[0] is first  # a lower source sorts first, whatever its sequence


async def test_a_reporter_forwards_in_order_within_its_bound(autojump_clock: trio.testing.MockClock) -> None:
    send, receive = trio.open_memory_channel[Envelope](10)
    reporter = Reporter(Outbox(Source.RETIRE, send), 3, "retire")
    for i in range(3):
        reporter.report_nowait(ClientGone(f"r{i}"))
    with pytest.raises(ChannelOverflow) as info:
        reporter.report_nowait(ClientGone("r3"))
    assert str(info.value) == "retire reporter overflowed its bound of 3 pending inputs"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reporter.run)
        with trio.fail_after(1):
            await reporter.wait_flushed()
        assert [receive.receive_nowait().msg.request_id for _ in range(3)] == ["r0", "r1", "r2"]
        reporter.report_nowait(ClientGone("r4"))
        with trio.fail_after(1):
            await reporter.wait_flushed()
        assert receive.receive_nowait().msg == ClientGone("r4")
        with trio.fail_after(1):
            await reporter.wait_flushed()  # nothing pending: returns at once
        nursery.cancel_scope.cancel()


async def test_a_reporter_with_a_delay_holds_each_report_back(autojump_clock: trio.testing.MockClock) -> None:
    send, receive = trio.open_memory_channel[Envelope](10)
    reporter = Reporter(Outbox(Source.RETIRE, send), 8, "retire", delay=0.25)
    arrivals: list[float] = []

    async def collect() -> None:
        async for _envelope in receive:
            arrivals.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reporter.run)
        nursery.start_soon(collect)
        start = trio.current_time()
        reporter.report_nowait(ClientGone("a"))
        reporter.report_nowait(ClientGone("b"))
        await reporter.wait_flushed()
        nursery.cancel_scope.cancel()
    assert [t - start for t in arrivals] == pytest.approx([0.25, 0.5])


# --- the deadline actor -------------------------------------------------------------------------------------------


def _deadlines(limit: int) -> DeadlineActor:
    send, _ = trio.open_memory_channel[Envelope](limit)
    return DeadlineActor(Outbox(Source.DEADLINE, send), limit)


async def test_the_watch_bound_is_exactly_the_limit() -> None:
    actor = _deadlines(3)
    for i in range(3):
        actor.submit_nowait(WatchDeadline(f"r{i}", 10 + i))
    assert actor.watched == 3
    actor.submit_nowait(WatchDeadline("r1", 99))  # a re-watch at the bound is no new watch
    assert actor.watched == 3
    with pytest.raises(ChannelOverflow) as info:
        actor.submit_nowait(WatchDeadline("r9", 5))
    assert str(info.value) == "deadline actor is watching 3 requests, its bound"
    actor.submit_nowait(UnwatchDeadline("r0"))
    actor.submit_nowait(WatchDeadline("r9", 5))
    assert actor.watched == 3


async def test_the_heap_stays_bounded_by_the_watched_requests(autojump_clock: trio.testing.MockClock) -> None:
    actor = _deadlines(100)
    actor.submit_nowait(WatchDeadline("keep", 10**12))
    for i in range(200):
        actor.submit_nowait(WatchDeadline("churn", 10**12 + i))  # each re-watch leaves a stale entry
        assert len(actor._heap) <= 2 * actor.watched + 16 + 1
    sizes = []
    for i in range(16):
        actor.submit_nowait(WatchDeadline(f"w{i}", 10**12 + i))
        sizes.append(len(actor._heap))
    assert max(sizes) <= 2 * actor.watched + 17
    # the rebuilt heap holds exactly the live watches, in heap order, and still reports them in deadline order
    actor.submit_nowait(UnwatchDeadline("churn"))
    assert sorted(actor._heap)[0] == (10**12, "keep")


async def test_the_heap_is_rebuilt_exactly_past_its_bound() -> None:
    actor = _deadlines(100)
    actor.submit_nowait(WatchDeadline("a", 1))
    for i in range(17):
        actor.submit_nowait(WatchDeadline("b", 100 + i))
    # live: a, b (2); a rebuild happens when the heap passes 2 * 2 + 16 = 20 entries
    assert len(actor._heap) == 18
    actor.submit_nowait(WatchDeadline("b", 200))
    actor.submit_nowait(WatchDeadline("b", 201))
    assert len(actor._heap) == 20  # at the bound: kept
    actor.submit_nowait(WatchDeadline("b", 202))
    assert sorted(actor._heap) == [(1, "a"), (202, "b")]  # past it: rebuilt from the live watches
    actor.submit_nowait(ClientGone("x"))  # type: ignore[arg-type]  # not a deadline command: ignored
    assert actor.watched == 2


# --- frames: merging, prompt logprobs, top logprobs ---------------------------------------------------------------

import math  # noqa: E402

from tickloom.actors.retire import _prompt_entry, merge_frames  # noqa: E402
from tickloom.actors.streams import _top_dict  # noqa: E402
from tickloom.engine.outputs import RequestOutput, RequestUsage  # noqa: E402
from tickloom.events import EmitTokens  # noqa: E402


def test_merge_frames_concatenates_and_keeps_the_second_finish() -> None:
    usage = RequestUsage(prompt_tokens=3, cached_prompt_tokens=0, completion_tokens=3, reasoning_tokens=1,
                         time_to_first_token_s=None, mean_inter_token_latency_s=None)
    a = RequestOutput(request_id="r", index=2, token_ids=[1, 2], text_delta="ab", reasoning_delta="x",
                      prompt_logprobs=[None, {5: -1.0}])
    b = RequestOutput(request_id="r", index=2, token_ids=[3], text_delta="c", reasoning_delta="y", finished=True,
                      finish_reason="error", usage=usage, error="boom", prompt_logprobs=[None])
    m = merge_frames(a, b)
    assert (m.request_id, m.index, m.token_ids, m.text_delta, m.reasoning_delta) == ("r", 2, [1, 2, 3], "abc", "xy")
    assert (m.finished, m.finish_reason, m.usage, m.error) == (True, "error", usage, "boom")
    assert m.logprobs is None and m.top_logprobs is None
    assert m.prompt_logprobs == [None, {5: -1.0}]  # the first frame's
    c = RequestOutput(request_id="r", token_ids=[4], prompt_logprobs=[None, {7: -2.0}])
    assert merge_frames(RequestOutput(request_id="r", token_ids=[]), c).prompt_logprobs == [None, {7: -2.0}]
    with pytest.raises(ValueError) as info:
        merge_frames(b, c)
    assert str(info.value) == "'r': cannot merge a frame after the final frame"


def test_merge_frames_pads_missing_logprobs() -> None:
    a = RequestOutput(request_id="r", token_ids=[1, 2], logprobs=[-0.5, -0.25], top_logprobs=[{1: -0.5}, {2: -0.25}])
    b = RequestOutput(request_id="r", token_ids=[3])
    m = merge_frames(a, b)
    assert m.logprobs is not None and m.logprobs[:2] == [-0.5, -0.25] and math.isnan(m.logprobs[2])
    assert len(m.logprobs) == 3
    assert m.top_logprobs == [{1: -0.5}, {2: -0.25}, {}]
    m = merge_frames(b, a)
    assert m.logprobs is not None and math.isnan(m.logprobs[0]) and m.logprobs[1:] == [-0.5, -0.25]
    assert m.top_logprobs == [{}, {1: -0.5}, {2: -0.25}]
    both = merge_frames(a, a)
    assert both.logprobs == [-0.5, -0.25, -0.5, -0.25]


def _emit(indices: list[int], prompt: list[list[float]] | None, ids: object = None, tops: object = None) -> EmitTokens:
    n = len(indices)
    return EmitTokens([f"r{i}" for i in range(n)], [1] * n, indices, [False] * n, prompt_logprobs=prompt,
                      prompt_top_token_ids=ids, prompt_top_logprobs=tops)  # type: ignore[arg-type]


def test_prompt_entry_is_output_zeros_logprobs() -> None:
    assert _prompt_entry(_emit([0, 0], None), [0, 1]) is None
    cmd = _emit([3, 0, 0], [[-9.0], [], [-1.0, -2.0]])
    assert _prompt_entry(cmd, [0]) is None  # not output 0
    assert _prompt_entry(cmd, [1]) is None  # output 0 without prompt logprobs
    assert _prompt_entry(cmd, [0, 1, 2]) == ([-1.0, -2.0], [], [])
    with_tops = _emit([0], [[-1.0]], ids=[[[4, 5]]], tops=[[[-0.1, -0.2]]])
    assert _prompt_entry(with_tops, [0]) == ([-1.0], [[4, 5]], [[-0.1, -0.2]])


def test_top_dict_lists_the_alternatives_then_the_token() -> None:
    assert _top_dict(7, -1.5, None, None) == {7: -1.5}
    assert _top_dict(7, -1.5, [3, 4], None) == {7: -1.5}
    assert _top_dict(7, -1.5, None, [-0.1]) == {7: -1.5}
    got = _top_dict(7, -1.5, [3, 4], [-0.1, -0.2])
    assert got == {3: -0.1, 4: -0.2, 7: -1.5} and list(got) == [3, 4, 7]
    got = _top_dict(4, -9.0, [3, 4], [-0.1, -0.2])
    assert got == {3: -0.1, 4: -0.2} and list(got) == [3, 4]  # the token among them keeps its own logprob
    with pytest.raises(ValueError):
        _top_dict(7, -1.5, [3, 4], [-0.1])


# --- stream assembly: what is held back -----------------------------------------------------------------------------

from test_actors_retire import FakeDetokenizer, ids_of  # noqa: E402

from tickloom.actors.streams import StreamAssembler  # noqa: E402
from tickloom.events import SamplingSpec  # noqa: E402


def _deltas(spec: SamplingSpec, text: str) -> list[str]:
    assembler = StreamAssembler("r", spec, 3, FakeDetokenizer(), submitted_at=0.0)
    out = []
    for i, token in enumerate(ids_of(text)):
        frames, _ = assembler.on_tokens([token], [i], [False], None, now=float(i))
        out.append("".join(f.text_delta for f in frames))
    return out


def test_a_whole_stop_string_before_min_tokens_is_released_at_once() -> None:
    """Before min_tokens a stop string does not stop the stream, and a whole one is no prefix to hold back."""
    assert _deltas(SamplingSpec(stop=["ab"], min_tokens=3), "abc") == ["", "ab", "c"]
    assert _deltas(SamplingSpec(stop=["abc"], min_tokens=5), "dabcd") == ["d", "", "", "abc", "d"]
    assert _deltas(SamplingSpec(stop=["ab"]), "cab") == ["c", "", ""]  # from min_tokens on, it stops


def _assembler(spec: SamplingSpec | None = None, prompt_len: int = 3, **kw: object) -> StreamAssembler:
    return StreamAssembler("r", spec or SamplingSpec(), prompt_len, FakeDetokenizer(), submitted_at=0.0,
                           **kw)  # type: ignore[arg-type]


def test_the_assembler_refuses_columns_of_unequal_length() -> None:
    from tickloom.actors.streams import StreamProtocolError

    for args in (([0, 1], [0], [False, False], None), ([0, 1], [0, 1], [False], None),
                 ([0, 1], [0, 1], [False, False], [-1.0])):
        with pytest.raises(StreamProtocolError) as info:
            _assembler().on_tokens(*args, now=0.0)  # type: ignore[arg-type]
        assert str(info.value) == "'r': token columns differ in length"
    a = _assembler()
    assert a.on_tokens([], [], [], None, now=0.0) == ([], None)
    a.on_tokens([0], [0], [False], None, now=0.0)
    from tickloom.events import Finish, Usage

    a.on_finish(Finish("r", "length", Usage(3, 0, 1)), now=1.0)
    with pytest.raises(StreamProtocolError) as info:
        a.on_tokens([0], [1], [False], None, now=2.0)
    assert str(info.value) == "'r': tokens after the final frame"


@pytest.mark.parametrize(("before", "indices", "message"), [
    (0, [5], "expected token index 0, got 5"),
    (0, [5, 1], "expected token index 0, got 5"),
    (0, [0, 5], "expected token index 1, got 5"),
    (0, [0, 0], "expected token index 1, got 0"),
    (0, [0, 2], "expected token index 1, got 2"),
    (0, [0, -2], "expected token index 1, got -2"),
    (0, [0, 5, 2], "expected token index 1, got 5"),
    (2, [2, 4], "expected token index 3, got 4"),
    (2, [2, 3, 9, 5], "expected token index 4, got 9"),
])
def test_token_indices_must_continue_the_stream(before: int, indices: list[int], message: str) -> None:
    from tickloom.actors.streams import StreamProtocolError

    a = _assembler()
    if before:
        a.on_tokens([0] * before, list(range(before)), [False] * before, None, now=0.0)
    n = len(indices)
    with pytest.raises(StreamProtocolError) as info:
        a.on_tokens([0] * n, indices, [False] * n, None, now=1.0)
    assert str(info.value) == f"'r': {message}"


def test_top_logprobs_come_with_logprobs_when_asked_for() -> None:
    spec = SamplingSpec(logprobs=True, top_logprobs=2)
    frames, _ = _assembler(spec).on_tokens([0, 1], [0, 1], [False, False], [-0.5, -1.5], now=0.0,
                                           top=([[2, 0], [0, 2]], [[-0.1, -0.5], [-0.2, -0.3]]))
    assert frames[0].logprobs == [-0.5, -1.5]
    assert frames[0].top_logprobs == [{2: -0.1, 0: -0.5}, {0: -0.2, 2: -0.3, 1: -1.5}]
    frames, _ = _assembler(spec).on_tokens([0], [0], [False], [-0.5], now=0.0)
    assert frames[0].top_logprobs == [{0: -0.5}]
    frames, _ = _assembler(SamplingSpec()).on_tokens([0], [0], [False], [-0.5], now=0.0)
    assert frames[0].logprobs == [-0.5] and frames[0].top_logprobs is None
    frames, _ = _assembler(spec).on_tokens([0], [0], [False], None, now=0.0)
    assert frames[0].logprobs is None and frames[0].top_logprobs is None


def test_prompt_logprobs_come_with_the_first_frame_only() -> None:
    spec = SamplingSpec(prompt_logprobs=1)
    a = _assembler(spec, prompt_len=3, prompt_token_ids=[4, 1, 2])
    prompt = ([-0.25, -0.75], [[0], [1]], [[-0.1], [-0.75]])
    frames, _ = a.on_tokens([0], [0], [False], None, now=0.0, prompt=prompt)
    assert frames[0].prompt_logprobs == [None, {0: -0.1, 1: -0.25}, {1: -0.75, 2: -0.75}]
    frames, _ = a.on_tokens([0], [1], [False], None, now=0.0, prompt=prompt)
    assert frames[0].prompt_logprobs is None
    no_tops = _assembler(spec, prompt_len=2, prompt_token_ids=[4, 1])
    frames, _ = no_tops.on_tokens([0], [0], [False], None, now=0.0, prompt=([-0.5], [], []))
    assert frames[0].prompt_logprobs == [None, {1: -0.5}]
    # a one-token prompt has no logprobs to report but its None; a longer one without them reports none
    frames, _ = _assembler(spec, prompt_len=1, prompt_token_ids=[4]).on_tokens([0], [0], [False], None, now=0.0)
    assert frames[0].prompt_logprobs == [None]
    frames, _ = _assembler(spec, prompt_len=2, prompt_token_ids=[4, 1]).on_tokens([0], [0], [False], None, now=0.0)
    assert frames[0].prompt_logprobs is None
    frames, _ = _assembler(SamplingSpec(), prompt_len=1, prompt_token_ids=[4]).on_tokens(
        [0], [0], [False], None, now=0.0, prompt=([], [], []))
    assert frames[0].prompt_logprobs is None


def test_the_longest_held_prefix_is_found_past_a_false_start() -> None:
    assert _deltas(SamplingSpec(stop=["aba"]), "aa") == ["", "a"]
    assert _deltas(SamplingSpec(stop=["ab"]), "aab") == ["", "a", ""]
    assert _deltas(SamplingSpec(stop=["abc"]), "abab") == ["", "", "ab", ""]


def test_the_final_frame_decodes_held_special_tokens_as_asked() -> None:
    from tickloom.events import Finish, Usage

    for skip, text in [(False, "<eos>\ufffd"), (True, "\ufffd")]:
        a = _assembler(SamplingSpec(skip_special_tokens=skip))
        frames, _ = a.on_tokens([0], [0], [False], None, now=0.0)
        frames, _ = a.on_tokens([11, 6], [1, 2], [False, False], None, now=0.0)
        final = a.on_finish(Finish("r", "length", Usage(3, 0, 3)), now=1.0)
        assert "".join(f.text_delta for f in frames) + final.text_delta == text, skip


def test_the_final_frame_rules() -> None:
    from tickloom.actors.streams import StreamProtocolError
    from tickloom.events import Finish, Usage

    a = _assembler(SamplingSpec(stop=["b"]), index=2, output_id="o")
    frames, match = a.on_tokens([0, 1], [0, 1], [False, False], None, now=1.0)
    assert match == 1 and frames[0].request_id == "o" and frames[0].index == 2
    final = a.on_finish(Finish("r", "stop", Usage(3, 0, 2, reasoning_tokens=7)), now=2.0)
    assert (final.request_id, final.index, final.finish_reason) == ("o", 2, "stop")
    assert final.usage is not None and final.usage.reasoning_tokens == 7  # the core's own stop at that token
    assert a.finished
    with pytest.raises(StreamProtocolError) as info:
        a.on_finish(Finish("r", "stop", Usage(3, 0, 2)), now=3.0)
    assert str(info.value) == "'r': a second finish"

    early = _assembler(SamplingSpec(stop=["b"]))
    early.on_tokens([0, 1], [0, 1], [False, False], None, now=1.0)
    with pytest.raises(StreamProtocolError) as info:
        early.on_finish(Finish("r", "length", Usage(3, 0, 1)), now=2.0)
    assert str(info.value) == "'r': finished at token 0 before the stop match at 1 it delivered"
    short = _assembler()
    short.on_tokens([0, 1], [0, 1], [False, False], None, now=1.0)
    with pytest.raises(StreamProtocolError) as info:
        short.on_finish(Finish("r", "length", Usage(3, 0, 1)), now=2.0)
    assert str(info.value) == "'r': finished after 1 tokens but 2 were delivered"


def test_a_stop_string_inside_held_text_before_min_tokens_does_not_match_later() -> None:
    """Before min_tokens nothing matches; once it is reached, only a match ending in the new text counts."""
    assert _deltas(SamplingSpec(stop=["b", "abc"], min_tokens=3), "abd") == ["", "", "abd"]


def test_the_earliest_ending_stop_string_wins() -> None:
    spec = SamplingSpec(stop=["a", "ab"], include_stop_str_in_output=True)
    frames, match = _assembler(spec).on_tokens([4], [0], [False], None, now=0.0)  # one token: "ab"
    assert match == 0 and frames[0].text_delta == "a"
