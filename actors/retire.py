"""The retire actor: owns the client streams.

The step actor hands it each tick's ``EmitTokens`` and ``Finish`` with ``deliver_nowait``, which never blocks or
awaits: each request's ``StreamAssembler`` turns them into frames (detokenized, reasoning split, stop strings
matched), and the frames wait in that request's bounded buffer until its client reads them. A client that falls
behind gets its pending frames coalesced (deltas merged into the last pending frame) rather than a longer buffer,
so a slow client never blocks the engine and never loses anything; the final frame is always kept.

Stop matches are reported as ``StopMatched`` and clients that leave early as ``ClientGone``, both through the
non-blocking ``report_nowait`` the engine supplies. ``fail_all`` makes every open stream raise a fatal error.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Self

import trio

from tickloom.actors.streams import Detokenizer, StreamAssembler
from tickloom.engine.outputs import RequestOutput
from tickloom.events.commands import Command, EmitTokens, Finish, PromptLogprobs
from tickloom.events.inputs import ClientGone, Input, StopMatched
from tickloom.events.types import SamplingSpec

__all__ = ["ClientStream", "GroupStream", "RetireActor", "merge_frames"]


def merge_frames(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One frame carrying ``a`` then ``b``: tokens and deltas concatenated, ``b``'s finish fields."""
    if a.finished:
        raise ValueError(f"{a.request_id!r}: cannot merge a frame after the final frame")
    if a.logprobs is None and b.logprobs is None:
        logprobs = None
    else:
        nan = float("nan")
        logprobs = (a.logprobs or [nan] * len(a.token_ids)) + (b.logprobs or [nan] * len(b.token_ids))
    tops = None
    if a.top_logprobs is not None or b.top_logprobs is not None:
        tops = (a.top_logprobs or [{} for _ in a.token_ids]) + (b.top_logprobs or [{} for _ in b.token_ids])
    return RequestOutput(
        request_id=a.request_id,
        index=a.index,
        token_ids=a.token_ids + b.token_ids,
        text_delta=a.text_delta + b.text_delta,
        reasoning_delta=a.reasoning_delta + b.reasoning_delta,
        finished=b.finished,
        finish_reason=b.finish_reason,
        usage=b.usage,
        error=b.error,
        logprobs=logprobs,
        top_logprobs=tops,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
    )


def _prompt_entry(command: EmitTokens, rows: list[int]) -> PromptLogprobs | None:
    """The prompt logprobs carried by the entry of ``rows`` that is output 0, if it carries any."""
    lps = command.prompt_logprobs
    if lps is None:
        return None
    for i in rows:
        if command.token_indices[i] == 0 and lps[i]:
            ids, tops = command.prompt_top_token_ids, command.prompt_top_logprobs
            return lps[i], [] if ids is None else ids[i], [] if tops is None else tops[i]
    return None


class _Stream:
    """The actor's side of one stream: its assembler, pending frames, and the client's wake-up."""

    __slots__ = ("assembler", "closed", "error", "finished", "frames", "group", "lot", "max_frames", "member",
                 "request_id")

    def __init__(self, request_id: str, assembler: StreamAssembler | None, max_frames: int,
                 group: _ChoiceGroup | None = None, member: int = 0) -> None:
        self.request_id = request_id
        self.assembler = assembler
        self.max_frames = max_frames
        self.frames: deque[RequestOutput] = deque()
        self.lot = trio.lowlevel.ParkingLot() if group is None else group.lot
        self.group = group
        self.member = member
        """Its place in ``group.streams``."""
        self.finished = False
        """The final frame has been produced (it may still be pending)."""
        self.closed = False
        """The client closed the stream."""
        self.error: BaseException | None = None

    def push(self, frame: RequestOutput) -> None:
        frames = self.frames
        if len(frames) >= self.max_frames:
            frames[-1] = merge_frames(frames[-1], frame)
        else:
            frames.append(frame)
            if self.group is not None:
                self.group.order.append(self.member)
        if frame.finished:
            self.finished = True
        if self.lot:
            self.lot.unpark_all()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.frames.clear()
        self.lot.unpark_all()


class _ChoiceGroup:
    """The streams of one request's ``n`` parallel choices, read as one: a shared wake-up and the order in which
    their frames arrived (one entry per frame queued, so at most ``n * max_buffered_frames``)."""

    __slots__ = ("lot", "order", "streams")

    def __init__(self) -> None:
        self.lot = trio.lowlevel.ParkingLot()
        self.order: deque[int] = deque()
        self.streams: list[_Stream] = []


class _LeftOnExit:
    """``aclose`` and ``async with`` for a stream whose ``close_nowait`` leaves it."""

    def close_nowait(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        """``close_nowait``, then a checkpoint."""
        self.close_nowait()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class ClientStream(_LeftOnExit):
    """A client's stream of ``RequestOutput`` frames; an async iterator and an async context manager.

    Iteration ends after the frame with ``finished=True``. Leaving early (``aclose``, the ``async with`` exit,
    ``close_nowait``, or the stream being garbage-collected unfinished) reports ``ClientGone`` once, which the
    core treats as a cancel. After ``RetireActor.fail_all`` every unfinished stream raises the fatal error.
    """

    def __init__(self, actor: RetireActor, stream: _Stream) -> None:
        self.request_id = stream.request_id
        self._actor = actor
        self._stream = stream

    def __aiter__(self) -> ClientStream:
        return self

    async def __anext__(self) -> RequestOutput:
        stream = self._stream
        while True:
            if stream.error is not None:
                raise stream.error
            if stream.frames:
                return stream.frames.popleft()
            if stream.finished or stream.closed:
                raise StopAsyncIteration
            await stream.lot.park()

    def close_nowait(self) -> None:
        """Leave the stream; reports ``ClientGone`` if the request has not finished (once). Safe from ``__del__``
        and from code that cannot await."""
        self._actor._close(self._stream)

    def __del__(self) -> None:
        stream = self.__dict__.get("_stream")
        if stream is not None and not stream.closed and not stream.finished and stream.error is None:
            self.close_nowait()


class GroupStream(_LeftOnExit):
    """The frames of ``n`` choices of one request, in the order they arrived, each with its ``index``.

    Iteration ends once every choice has delivered its final frame. Leaving early closes every choice that has
    not finished (each reports ``ClientGone``). A fatal error raises as soon as any choice holds it.
    """

    def __init__(self, actor: RetireActor, request_id: str, group: _ChoiceGroup) -> None:
        self.request_id = request_id
        self._actor = actor
        self._group = group

    def __aiter__(self) -> GroupStream:
        return self

    async def __anext__(self) -> RequestOutput:
        group = self._group
        while True:
            for stream in group.streams:
                if stream.error is not None:
                    raise stream.error
            while group.order:
                frames = group.streams[group.order.popleft()].frames
                if frames:
                    return frames.popleft()
            if all(stream.finished or stream.closed for stream in group.streams):
                raise StopAsyncIteration
            await group.lot.park()

    def close_nowait(self) -> None:
        """Leave every choice; each unfinished one reports ``ClientGone`` (once)."""
        for stream in self._group.streams:
            self._actor._close(stream)
        self._group.order.clear()

    def __del__(self) -> None:
        group = self.__dict__.get("_group")
        if group is not None and any(not s.closed and not s.finished and s.error is None for s in group.streams):
            self.close_nowait()


class RetireActor:
    """Owns the client streams; see the module docstring."""

    def __init__(
        self,
        detokenizer: Detokenizer,
        report_nowait: Callable[[Input], None],
        max_buffered_frames: int = 1024,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        if max_buffered_frames < 1:
            raise ValueError(f"max_buffered_frames must be at least 1, got {max_buffered_frames}")
        self._detok = detokenizer
        self._report = report_nowait
        self._max_frames = max_buffered_frames
        self._clock = clock
        self._streams: dict[str, _Stream] = {}
        self._fatal: BaseException | None = None

    @property
    def open_streams(self) -> int:
        """Streams still waiting for their request's finish."""
        return len(self._streams)

    def open_stream(self, request_id: str, spec: SamplingSpec, prompt_len: int, submitted_at: float, *,
                    prompt_token_ids: Sequence[int] = ()) -> ClientStream:
        """Start assembling a request's stream; call before its arrival reaches the core. ``prompt_token_ids`` name
        the prompt's tokens in ``prompt_logprobs`` (give them when the spec asks for those)."""
        return ClientStream(self, self._open(request_id, spec, prompt_len, submitted_at, request_id, 0,
                                              prompt_token_ids, None))

    def open_group(self, request_id: str, choice_ids: Sequence[str], spec: SamplingSpec, prompt_len: int,
                   submitted_at: float, *, prompt_token_ids: Sequence[int] = ()) -> GroupStream:
        """Streams for the ``n`` choices of one request (the core requests ``choice_ids``), read as one: frames carry
        ``request_id`` and the choice's ``index``. Call before the arrivals reach the core."""
        taken = next((rid for rid in choice_ids if rid in self._streams), None)
        if taken is not None:
            raise ValueError(f"a stream for request {taken!r} is already open")
        group = _ChoiceGroup()
        for i, rid in enumerate(choice_ids):
            group.streams.append(self._open(rid, spec, prompt_len, submitted_at, request_id, i, prompt_token_ids,
                                            group))
        return GroupStream(self, request_id, group)

    def _open(self, request_id: str, spec: SamplingSpec, prompt_len: int, submitted_at: float, output_id: str,
              index: int, prompt_token_ids: Sequence[int], group: _ChoiceGroup | None) -> _Stream:
        if request_id in self._streams:
            raise ValueError(f"a stream for request {request_id!r} is already open")
        if self._fatal is not None:
            stream = _Stream(request_id, None, self._max_frames, group, index)
            stream.error = self._fatal
            return stream
        keep = prompt_token_ids if spec.prompt_logprobs is not None else ()
        assembler = StreamAssembler(request_id, spec, prompt_len, self._detok, submitted_at, output_id=output_id,
                                    index=index, prompt_token_ids=keep)
        stream = _Stream(request_id, assembler, self._max_frames, group, index)
        self._streams[request_id] = stream
        return stream

    def deliver_nowait(self, commands: Sequence[Command]) -> None:
        """Take one tick's ``EmitTokens`` and ``Finish`` commands (others are ignored); never blocks."""
        now = self._clock()
        for command in commands:
            if isinstance(command, EmitTokens):
                self._emit(command, now)
            elif isinstance(command, Finish):
                stream = self._streams.pop(command.request_id, None)
                if stream is not None:
                    assert stream.assembler is not None
                    stream.push(stream.assembler.on_finish(command, now))

    def _emit(self, command: EmitTokens, now: float) -> None:
        rids = command.request_ids
        n = len(rids)
        if n == 0:
            return
        # Group the columns by request, keeping each request's entries in order.
        groups: dict[str, list[int]] = {}
        for i, rid in enumerate(rids):
            rows = groups.get(rid)
            if rows is None:
                groups[rid] = [i]
            else:
                rows.append(i)
        tokens, indices, flags, logprobs = command.token_ids, command.token_indices, command.reasoning, command.logprobs
        top_ids, top_lps = command.top_token_ids, command.top_logprobs
        streams = self._streams
        for rid, rows in groups.items():
            stream = streams.get(rid)
            if stream is None:
                continue
            assembler = stream.assembler
            assert assembler is not None
            lp = logprobs
            top = None if top_ids is None or top_lps is None or not assembler.spec.logprobs else (top_ids, top_lps)
            prompt = _prompt_entry(command, rows) if assembler.spec.prompt_logprobs is not None else None
            if len(rows) == n:
                frames, match = assembler.on_tokens(tokens, indices, flags, lp, now, top, prompt)
            elif len(rows) == 1:
                i = rows[0]
                frames, match = assembler.on_tokens([tokens[i]], [indices[i]], [flags[i]],
                                                    None if lp is None else [lp[i]], now,
                                                    None if top is None else ([top[0][i]], [top[1][i]]), prompt)
            else:
                frames, match = assembler.on_tokens(
                    [tokens[i] for i in rows],
                    [indices[i] for i in rows],
                    [flags[i] for i in rows],
                    None if lp is None else [lp[i] for i in rows],
                    now,
                    None if top is None else ([top[0][i] for i in rows], [top[1][i] for i in rows]),
                    prompt,
                )
            for frame in frames:
                stream.push(frame)
            if match is not None:
                self._report(StopMatched(rid, match))

    def abandon(self, request_id: str) -> None:
        """Drop a stream whose arrival never reached the core (its submit was cancelled); nothing is reported."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.closed = True
            stream.frames.clear()
            stream.lot.unpark_all()

    def fail_all(self, error: BaseException) -> None:
        """A fatal engine error: every open stream (and every stream opened later) raises ``error``."""
        self._fatal = error
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream.fail(error)

    def _close(self, stream: _Stream) -> None:
        if stream.closed:
            return
        stream.closed = True
        stream.frames.clear()
        stream.lot.unpark_all()
        if stream.finished or stream.error is not None:
            return
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        self._report(ClientGone(stream.request_id))

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The actor's task. Delivery is synchronous and reports go through ``report_nowait``, so it only waits."""
        task_status.started()
        await trio.sleep_forever()
