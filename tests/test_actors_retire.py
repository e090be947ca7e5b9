"""The retire actor and its sans-I/O stream assembler: detokenization, stop strings, frames, slow clients, failures.

A fake detokenizer maps each token id to fixed bytes and decodes with ``errors="replace"``, like a byte-level BPE
tokenizer: ids 6+7 spell "é" and 8+9 spell "€", so a lone first half decodes to U+FFFD.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import hypothesis.strategies as st
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings

from tickloom.actors.retire import ClientStream, RetireActor, merge_frames
from tickloom.actors.streams import FINISH_PRECEDENCE, StreamAssembler, StreamProtocolError
from tickloom.engine.outputs import RequestOutput
from tickloom.events import ClientGone, Command, EmitTokens, Finish, Input, SamplingSpec, StopMatched, Usage
from tickloom.events.types import FINISH_REASONS, FinishReason

VOCAB: dict[int, bytes] = {
    0: b"a",
    1: b"b",
    2: b"c",
    3: b" ",
    4: b"ab",
    5: "é".encode(),
    6: b"\xc3",  # first byte of "é"
    7: b"\xa9",  # second byte of "é"
    8: b"\xe2",  # first byte of "€"
    9: b"\x82\xac",  # rest of "€"
    10: b"d",
    11: b"<eos>",  # special: skipped when skip_special_tokens
    12: b"\n",
}
SPECIAL = {11}
TEXT = {"a": 0, "b": 1, "c": 2, " ": 3, "d": 10, "\n": 12, "é": 5}


class FakeDetokenizer:
    """Byte-level decode; records the longest window it was asked to decode."""

    def __init__(self) -> None:
        self.calls = 0
        self.max_window = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        self.max_window = max(self.max_window, len(ids))
        data = b"".join(VOCAB[i] for i in ids if not (skip_special_tokens and i in SPECIAL))
        return data.decode("utf-8", errors="replace")


def ids_of(text: str) -> list[int]:
    """Token ids spelling ``text``; "é" as its split pair, "€" as its split pair."""
    out: list[int] = []
    for ch in text:
        if ch == "é":
            out += [6, 7]
        elif ch == "€":
            out += [8, 9]
        else:
            out.append(TEXT[ch])
    return out


class Harness:
    def __init__(self, max_buffered_frames: int = 1024) -> None:
        self.reports: list[Input] = []
        self.now = 100.0
        self.detok = FakeDetokenizer()
        self.actor = RetireActor(self.detok, self.reports.append, max_buffered_frames, clock=lambda: self.now)
        self.next_index: dict[str, int] = {}

    def open(self, rid: str = "r", prompt_len: int = 3, **spec: object) -> ClientStream:
        self.next_index[rid] = 0
        return self.actor.open_stream(rid, SamplingSpec(**spec), prompt_len, submitted_at=self.now)  # type: ignore[arg-type]

    def tokens(self, rid: str, ids: list[int], reasoning: bool | list[bool] = False) -> None:
        """Deliver ``ids`` as the next tokens of ``rid`` in one tick."""
        start = self.next_index.get(rid, 0)
        flags = reasoning if isinstance(reasoning, list) else [reasoning] * len(ids)
        idx = list(range(start, start + len(ids)))
        self.next_index[rid] = start + len(ids)
        self.actor.deliver_nowait([EmitTokens([rid] * len(ids), ids, idx, flags)])

    def finish(self, rid: str, reason: FinishReason, n: int, reasoning: int = 0, error: str = "") -> None:
        self.actor.deliver_nowait([Finish(rid, reason, Usage(3, 1, n, reasoning), error)])


async def collect(stream: ClientStream) -> list[RequestOutput]:
    return [frame async for frame in stream]


def joined(frames: list[RequestOutput]) -> tuple[list[int], str, str]:
    tokens = [t for f in frames for t in f.token_ids]
    return tokens, "".join(f.text_delta for f in frames), "".join(f.reasoning_delta for f in frames)


def final(frames: list[RequestOutput]) -> RequestOutput:
    assert frames and frames[-1].finished
    assert not any(f.finished for f in frames[:-1])
    return frames[-1]


# --- E04: stop strings -------------------------------------------------------------------------------------------


async def test_e04_stop_strings_span_token_boundary_and_end_the_text() -> None:
    for include in (False, True):
        h = Harness()
        s = h.open(stop=["dé c"], include_stop_str_in_output=include)
        ids = ids_of("abcdé cab")  # "dé c" spans five tokens, "é" itself split across two
        for tok in ids:
            h.tokens("r", [tok])
        k = ids.index(2, 4)  # the "c" after the space completes the match
        assert h.reports == [StopMatched("r", k)]
        h.finish("r", "stop", k + 1)
        frames = await collect(s)
        tokens, text, _ = joined(frames)
        assert tokens == ids[: k + 1]  # nothing after the match
        assert text == ("abcdé c" if include else "abc")
        last = final(frames)
        assert last.finish_reason == "stop"
        assert last.usage is not None and last.usage.completion_tokens == k + 1


async def test_e04_stop_strings_late_core_finish_is_overridden() -> None:
    """The core ran on (length at a later token) before it learnt of the match: the client sees the match."""
    h = Harness()
    s = h.open(stop=["bc"])
    h.tokens("r", ids_of("abcab"))  # the match completes at index 2, within this one tick
    assert h.reports == [StopMatched("r", 2)]
    h.tokens("r", ids_of("cd"))  # over-run tokens from the core: ignored
    h.finish("r", "length", 7)
    frames = await collect(s)
    assert joined(frames) == ([0, 1, 2], "a", "")
    last = final(frames)
    assert last.finish_reason == "stop"
    assert last.usage is not None and last.usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("core_reason", "expected"),
    [("length", "stop"), ("error", "stop"), ("stop", "stop"), ("timeout", "timeout"), ("cancelled", "cancelled")],
)
async def test_e04_stop_strings_same_token_precedence(core_reason: FinishReason, expected: str) -> None:
    h = Harness()
    s = h.open(stop=["cd"])
    h.tokens("r", ids_of("abcd"))
    h.finish("r", core_reason, 4, error="boom")
    frames = await collect(s)
    last = final(frames)
    assert last.finish_reason == expected
    assert last.error == ("boom" if expected == "error" else None)
    assert last.usage is not None and last.usage.completion_tokens == 4
    assert joined(frames)[1] == "ab"  # the stop string never reaches the client either way


async def test_e04_stop_strings_held_prefix_released() -> None:
    h = Harness()
    s = h.open(stop=["abd", "b\n"])
    h.tokens("r", ids_of("ca"))
    h.tokens("r", ids_of("b"))  # "ab" could start "abd"; "b" could start "b\n"
    h.tokens("r", ids_of("c"))  # no: released
    h.tokens("r", ids_of("a"))
    h.tokens("r", ids_of("b"))  # held again, then the request ends by length
    h.finish("r", "length", 6)
    frames = await collect(s)
    assert [f.text_delta for f in frames] == ["c", "", "abc", "", "", "ab"]
    assert final(frames).finish_reason == "length"
    assert h.reports == []


async def test_e04_stop_strings_earliest_ending_match_wins() -> None:
    h = Harness()
    s = h.open(stop=["abcd", "bc"])
    h.tokens("r", ids_of("abcd"))
    assert h.reports == [StopMatched("r", 2)]
    h.finish("r", "stop", 3)
    assert joined(await collect(s))[1] == "a"


async def test_e04_stop_strings_inside_one_token_and_min_tokens() -> None:
    h = Harness()
    s = h.open(stop=["b"], min_tokens=3)
    h.tokens("r", [4, 4])  # "ab" "ab": matches before min_tokens are ignored
    h.tokens("r", [0, 4, 2])  # "a" "ab" "c": the third token reaches min_tokens but holds no "b"; the fourth does
    assert h.reports == [StopMatched("r", 3)]
    h.finish("r", "stop", 4)
    frames = await collect(s)
    assert joined(frames)[1] == "ababaa"
    assert joined(frames)[0] == [4, 4, 0, 4]


async def test_e04_stop_strings_content_only_and_reasoning_split() -> None:
    h = Harness()
    s = h.open(stop=["ab"])
    h.tokens("r", ids_of("ab") + ids_of("c"), reasoning=[True, True, False])  # "ab" in reasoning does not stop
    h.tokens("r", ids_of("a"), reasoning=True)
    h.tokens("r", ids_of("a"))
    h.tokens("r", ids_of("é"), reasoning=[True, True])
    h.tokens("r", ids_of("b"))  # content "c" + "a" + "b": stops, across the reasoning tokens between
    assert h.reports == [StopMatched("r", 7)]
    h.finish("r", "stop", 8, reasoning=5)
    frames = await collect(s)
    assert joined(frames)[1:] == ("c", "abaé")
    usage = final(frames).usage
    assert usage is not None and (usage.completion_tokens, usage.reasoning_tokens) == (8, 5)


async def test_e04_stop_strings_finish_reason_and_usage_reasoning_counted_to_match() -> None:
    h = Harness()
    s = h.open(stop=["c"])
    h.tokens("r", [0, 1], reasoning=True)
    h.tokens("r", [2, 0, 0], reasoning=[False, True, True])  # match at 2; the core later counts 4 reasoning tokens
    h.finish("r", "length", 5, reasoning=4)
    usage = final(await collect(s)).usage
    assert usage is not None and (usage.completion_tokens, usage.reasoning_tokens) == (3, 2)


# The E04 property: over random token streams, stop strings, core finishes and delays before the core learns of
# a match, the client's text, finish reason and token counts equal an offline oracle's, which knows nothing of
# ticks. Units are whole characters (one token, or the split pairs 6+7 and 8+9), each all reasoning or all content.

UNIT_TOKENS: list[tuple[int, ...]] = [(0,), (1,), (2,), (3,), (4,), (5,), (10,), (11,), (12,), (6, 7), (8, 9)]


def unit_text(unit: Sequence[int]) -> str:
    return FakeDetokenizer().decode(list(unit))


@st.composite
def e04_cases(draw: st.DrawFn) -> dict[str, object]:
    units = draw(
        st.lists(
            st.tuples(st.sampled_from(UNIT_TOKENS), st.sampled_from([False, False, False, True])),
            min_size=1,
            max_size=20,
        )
    )
    tokens = [t for unit, _ in units for t in unit]
    content = "".join(unit_text(u) for u, flag in units if not flag)
    stop_strategy = st.text(alphabet="abcdé€ \n", min_size=1, max_size=4)
    if content:
        start = st.integers(0, len(content) - 1)
        stop_strategy = stop_strategy | start.flatmap(
            lambda i: st.integers(i + 1, min(len(content), i + 5)).map(lambda j: content[i:j])
        )
    return {
        "units": units,
        "stops": draw(st.lists(stop_strategy, max_size=3)),
        "include": draw(st.booleans()),
        "min_tokens": draw(st.sampled_from([0, 0, 0, 1, 3])),
        "j0": draw(st.integers(0, len(tokens) - 1)),
        "r0": draw(st.sampled_from(FINISH_REASONS)),
        "delay": draw(st.integers(0, 4)),
        "chunks": draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)),
        "max_frames": draw(st.sampled_from([1, 2, 1024])),
    }


def e04_oracle(case: dict[str, object]) -> tuple[int | None, str, str, str, int]:
    """(stop index, content text, reasoning text, finish reason, completion tokens) from whole strings."""
    units: list[tuple[tuple[int, ...], bool]] = case["units"]  # type: ignore[assignment]
    stops: list[str] = case["stops"]  # type: ignore[assignment]
    j0: int = case["j0"]  # type: ignore[assignment]
    r0: FinishReason = case["r0"]  # type: ignore[assignment]
    content, reasoning = "", ""
    match: int | None = None
    start = 0
    for unit, flag in units:
        end = start + len(unit) - 1
        text = FakeDetokenizer().decode(list(unit[: j0 + 1 - start]))  # a unit cut by the finish: "\ufffd"
        start = end + 1
        if flag:
            reasoning += text
        else:
            before = len(content)
            content += text
            if end <= j0 and end + 1 >= case["min_tokens"]:  # type: ignore[operator]
                hits = [
                    (p + len(s), p) for s in stops for p in [content.find(s, max(0, before - len(s) + 1))] if p >= 0
                ]
                if hits:
                    stop_end, stop_start = min(hits)
                    content = content[: stop_end if case["include"] else stop_start]
                    match = end
                    break
        if end >= j0:
            break
    if match is not None and (match < j0 or FINISH_PRECEDENCE[r0] < FINISH_PRECEDENCE["stop"]):
        return match, content, reasoning, "stop", match + 1
    return match, content, reasoning, r0, j0 + 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=e04_cases())
async def test_e04_stop_strings_finish_independent_of_when_match_is_noticed(case: dict[str, object]) -> None:
    units: list[tuple[tuple[int, ...], bool]] = case["units"]  # type: ignore[assignment]
    tokens = [t for unit, _ in units for t in unit]
    flags = [flag for unit, flag in units for _ in unit]
    j0: int = case["j0"]  # type: ignore[assignment]
    r0: FinishReason = case["r0"]  # type: ignore[assignment]
    delay: int = case["delay"]  # type: ignore[assignment]
    chunks: list[int] = case["chunks"]  # type: ignore[assignment]
    h = Harness(max_buffered_frames=case["max_frames"])  # type: ignore[arg-type]
    h.now = 0.0
    s = h.open(stop=case["stops"], include_stop_str_in_output=case["include"], min_tokens=case["min_tokens"])
    # A simulated core: emits a chunk of tokens per tick; learns of a reported match `delay` ticks late.
    emitted, tick = 0, 0
    arrival: list[float] = []
    stop_at: tuple[int, int] | None = None  # (tick it reaches the core, token index)
    while True:
        h.now = float(tick + 1)
        commands: list[Command] = []
        n = min(chunks[tick % len(chunks)], j0 + 1 - emitted)
        if n:
            idx = list(range(emitted, emitted + n))
            commands.append(EmitTokens(["r"] * n, tokens[emitted : emitted + n], idx, flags[emitted : emitted + n]))
            arrival += [h.now] * n
            emitted += n
        ends: list[tuple[int, int, FinishReason]] = []
        if emitted == j0 + 1:
            ends.append((j0, -FINISH_PRECEDENCE[r0], r0))
        if stop_at is not None and stop_at[0] <= tick:
            ends.append((stop_at[1], -FINISH_PRECEDENCE["stop"], "stop"))
        if ends:
            index, _, reason = min(ends)
            usage = Usage(3, 1, index + 1, sum(flags[: index + 1]))
            commands.append(Finish("r", reason, usage, "boom" if reason == "error" else ""))
        before = len(h.reports)
        h.actor.deliver_nowait(commands)
        for report in h.reports[before:]:
            assert isinstance(report, StopMatched)
            stop_at = (tick + 1 + delay, report.token_index)
        if ends:
            break
        tick += 1
    frames = await collect(s)
    match, text, reasoning, expected_reason, count = e04_oracle(case)
    assert h.reports == ([] if match is None else [StopMatched("r", match)])
    assert joined(frames) == (tokens[:count], text, reasoning)
    last = final(frames)
    assert last.finish_reason == expected_reason
    assert last.error == ("boom" if expected_reason == "error" else None)
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.cached_prompt_tokens) == (3, 1)
    assert (last.usage.completion_tokens, last.usage.reasoning_tokens) == (count, sum(flags[:count]))
    assert last.usage.time_to_first_token_s == arrival[0]
    expected_itl = None if count < 2 else (arrival[count - 1] - arrival[0]) / (count - 1)
    assert last.usage.mean_inter_token_latency_s == expected_itl
    if case["max_frames"] == 1024:
        assert all(len(f.token_ids) <= max(chunks) for f in frames)


# --- detokenization ----------------------------------------------------------------------------------------------


async def test_incomplete_utf8_is_held_back_until_completed() -> None:
    h = Harness()
    s = h.open()
    h.tokens("r", [0, 8])  # "a" + first byte of "€"
    h.tokens("r", [9])
    h.tokens("r", [6])  # first byte of "é", then the request ends: flushed as it decodes
    h.finish("r", "length", 4)
    frames = await collect(s)
    assert [f.text_delta for f in frames] == ["a", "€", "", "\ufffd"]
    assert [f.token_ids for f in frames] == [[0, 8], [9], [6], []]


async def test_special_tokens_follow_skip_special_tokens() -> None:
    for skip, expected in ((True, "ab"), (False, "a<eos>b")):
        h = Harness()
        s = h.open(skip_special_tokens=skip)
        h.tokens("r", [0, 11, 1])
        h.finish("r", "stop", 3)
        assert joined(await collect(s))[1] == expected


async def test_detokenization_decodes_a_short_window() -> None:
    """Each token costs a decode of a few recent ids, never of the whole output."""
    h = Harness()
    s = h.open(stop=["zz"], max_tokens=3000)
    text = "ab cé d\n€" * 200
    ids = ids_of(text)
    for i in range(0, len(ids), 3):
        h.tokens("r", ids[i : i + 3])
    h.finish("r", "length", len(ids))
    assert joined(await collect(s))[1] == text
    assert h.detok.max_window <= 4
    assert h.detok.calls <= 2 * len(ids) + 2


def test_assembler_is_sans_io_and_checks_indices() -> None:
    a = StreamAssembler("r", SamplingSpec(stop=["b"]), 3, FakeDetokenizer(), submitted_at=0.0)
    frames, match = a.on_tokens([0, 1, 2], [0, 1, 2], [False] * 3, [-0.5, -1.0, -2.0], now=1.0)
    assert match == 1
    assert frames == [RequestOutput(request_id="r", token_ids=[0, 1], text_delta="a", logprobs=[-0.5, -1.0])]
    assert a.on_tokens([2], [3], [False], None, now=2.0) == ([], None)  # beyond the match: ignored
    with pytest.raises(StreamProtocolError, match="expected token index 4"):
        a.on_tokens([2], [5], [False], None, now=2.0)
    b = StreamAssembler("q", SamplingSpec(), 3, FakeDetokenizer(), submitted_at=0.0)
    b.on_tokens([0], [0], [False], None, now=1.0)
    with pytest.raises(StreamProtocolError, match="expected token index 1"):
        b.on_tokens([0], [0], [False], None, now=1.0)
    with pytest.raises(StreamProtocolError, match="only 1 arrived"):
        b.on_finish(Finish("q", "length", Usage(3, 0, 2)), now=2.0)


# --- usage -------------------------------------------------------------------------------------------------------


async def test_usage_latencies() -> None:
    h = Harness()
    h.now = 10.0
    s = h.open()
    for now, ids in ((11.0, [0]), (12.0, [1, 2]), (15.0, [0])):
        h.now = now
        h.tokens("r", ids)
    h.finish("r", "length", 4)
    usage = final(await collect(s)).usage
    assert usage is not None
    assert usage.time_to_first_token_s == 1.0
    assert usage.mean_inter_token_latency_s == pytest.approx(4.0 / 3)
    assert (usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens) == (3, 1, 4)


async def test_usage_without_tokens() -> None:
    h = Harness()
    s = h.open()
    h.finish("r", "cancelled", 0)
    [last] = await collect(s)
    assert last.finish_reason == "cancelled"
    assert last.usage is not None
    assert (last.usage.time_to_first_token_s, last.usage.mean_inter_token_latency_s) == (None, None)


# --- the actor ---------------------------------------------------------------------------------------------------


async def test_columnar_emits_for_several_requests_and_unknown_ids() -> None:
    h = Harness()
    s1, s2 = h.open("x"), h.open("y")
    h.actor.deliver_nowait(
        [
            EmitTokens(["x", "ghost", "y", "x"], [0, 5, 1, 2], [0, 0, 0, 1], [False] * 4, [-1.0, -2.0, -3.0, -4.0]),
            Finish("ghost", "error", Usage(0, 0, 0), "request rejected: too long"),
            Finish("x", "length", Usage(3, 1, 2)),
        ]
    )
    h.actor.deliver_nowait([Finish("y", "error", Usage(3, 1, 1), "step 4 failed: boom")])
    f1, f2 = await collect(s1), await collect(s2)
    assert joined(f1) == ([0, 2], "ac", "")
    assert f1[0].logprobs == [-1.0, -4.0]
    assert final(f1).finish_reason == "length" and final(f1).error is None
    assert joined(f2) == ([1], "b", "")
    assert (final(f2).finish_reason, final(f2).error) == ("error", "step 4 failed: boom")
    assert h.actor.open_streams == 0
    assert h.reports == []


async def test_open_stream_twice_is_an_error() -> None:
    h = Harness()
    kept = h.open("x")
    with pytest.raises(ValueError, match="already open"):
        h.open("x")
    assert kept.request_id == "x"


async def test_client_is_woken_by_delivery() -> None:
    h = Harness()
    s = h.open()
    got: list[RequestOutput] = []

    async def reader() -> None:
        async for frame in s:
            got.append(frame)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        h.tokens("r", [0])
        await trio.testing.wait_all_tasks_blocked()
        assert [f.text_delta for f in got] == ["a"]
        h.tokens("r", [1])
        h.finish("r", "length", 2)
    assert [f.text_delta for f in got] == ["a", "b", ""]
    assert got[-1].finished


async def test_slow_client_frames_coalesce_nothing_lost() -> None:
    h = Harness(max_buffered_frames=3)
    s = h.open(stop=["zz"], logprobs=True)
    text = "abcd é€\n" * 20
    ids = ids_of(text)
    for i, tok in enumerate(ids):
        h.actor.deliver_nowait([EmitTokens(["r"], [tok], [i], [i % 5 == 0], [float(-i)])])
        assert len(h.actor._streams["r"].frames) <= 3
    h.finish("r", "length", len(ids), reasoning=sum(1 for i in range(len(ids)) if i % 5 == 0))
    frames = await collect(s)
    assert len(frames) == 3
    tokens, content, reasoning = joined(frames)
    assert tokens == ids
    assert content + reasoning != "" and len(content) + len(reasoning) == len(text)
    assert [lp for f in frames for lp in (f.logprobs or [])] == [float(-i) for i in range(len(ids))]
    last = final(frames)
    assert last.finish_reason == "length" and last.usage is not None and last.usage.completion_tokens == len(ids)


async def test_slow_client_reading_between_ticks() -> None:
    h = Harness(max_buffered_frames=1)
    s = h.open()
    h.tokens("r", [0])
    h.tokens("r", [1])
    assert joined([await s.__anext__()]) == ([0, 1], "ab", "")
    h.tokens("r", [2])
    h.finish("r", "stop", 3)
    frames = await collect(s)
    assert len(frames) == 1 and joined(frames) == ([2], "c", "") and final(frames).finish_reason == "stop"


def test_merge_frames_refuses_after_final() -> None:
    done = RequestOutput(request_id="r", token_ids=[], finished=True, finish_reason="stop")
    with pytest.raises(ValueError, match="after the final frame"):
        merge_frames(done, RequestOutput(request_id="r", token_ids=[1]))


async def test_fail_all_raises_in_every_open_stream() -> None:
    h = Harness()
    streams = [h.open(rid) for rid in ("a", "b", "c")]
    done = h.open("d")
    h.tokens("a", [0])
    h.tokens("d", [0])
    h.finish("d", "length", 1)
    error = RuntimeError("step actor crashed: boom")
    raised: list[str] = []

    async def reader(stream: ClientStream) -> None:
        try:
            async for _ in stream:
                pass
        except RuntimeError as exc:
            assert exc is error
            raised.append(stream.request_id)

    async with trio.open_nursery() as nursery:
        for stream in streams[1:]:
            nursery.start_soon(reader, stream)
        await trio.testing.wait_all_tasks_blocked()
        h.actor.fail_all(error)
    assert sorted(raised) == ["b", "c"]
    with pytest.raises(RuntimeError, match="boom"):
        await streams[0].__anext__()  # pending frames are not delivered after a fatal error
    assert final(await collect(done)).finish_reason == "length"  # finished before the failure: still readable
    later = h.open("e")
    with pytest.raises(RuntimeError, match="boom"):
        await later.__anext__()
    h.tokens("b", [0])  # deliveries after the failure are ignored
    for stream in [*streams, later]:
        await stream.aclose()
    assert h.reports == []


async def test_aclose_reports_client_gone_once_and_only_if_unfinished() -> None:
    h = Harness()
    s = h.open("x")
    h.tokens("x", [0, 1])
    assert (await s.__anext__()).text_delta == "ab"
    await s.aclose()
    await s.aclose()
    s.close_nowait()
    assert h.reports == [ClientGone("x")]
    with pytest.raises(StopAsyncIteration):
        await s.__anext__()
    h.tokens("x", [2])  # the core has not seen ClientGone yet: ignored
    h.finish("x", "cancelled", 3)
    assert h.actor.open_streams == 0

    finished = h.open("y")
    h.finish("y", "length", 0)  # finished, final frame still unread
    await finished.aclose()
    assert h.reports == [ClientGone("x")]


async def test_async_with_and_break_cancel() -> None:
    h = Harness()
    async with h.open("x") as s:
        h.tokens("x", [0])
        async for _ in s:
            break
    assert h.reports == [ClientGone("x")]
    async with h.open("y") as s2:
        h.finish("y", "length", 0)
        assert len(await collect(s2)) == 1
    assert h.reports == [ClientGone("x")]


async def test_close_nowait_and_garbage_collection() -> None:
    h = Harness()
    s = h.open("x")
    s.close_nowait()
    s.close_nowait()
    assert h.reports == [ClientGone("x")]
    abandoned = h.open("y")
    h.tokens("y", [0])
    del abandoned
    gc.collect()
    assert h.reports == [ClientGone("x"), ClientGone("y")]
    done = h.open("z")
    h.finish("z", "length", 0)
    del done
    gc.collect()
    assert h.reports == [ClientGone("x"), ClientGone("y")]


async def test_stop_matched_reported_once_per_request() -> None:
    h = Harness()
    s = h.open("x", stop=["a"])
    t = h.open("y", stop=["c"])
    h.actor.deliver_nowait([EmitTokens(["x", "y", "x", "y"], [0, 1, 0, 2], [0, 0, 1, 1], [False] * 4)])
    assert h.reports == [StopMatched("x", 0), StopMatched("y", 1)]
    h.finish("x", "stop", 1)
    h.finish("y", "stop", 2)
    assert joined(await collect(s))[:2] == ([0], "")
    assert joined(await collect(t))[:2] == ([1, 2], "b")


async def test_run_starts() -> None:
    h = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.actor.run)
        nursery.cancel_scope.cancel()
