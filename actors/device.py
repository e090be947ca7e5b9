"""The device side of the step actor: executes commands strictly in order and reports results.

``ThreadDevice`` runs a real executor on **one dedicated thread fed by a FIFO queue**, so run step, spill out
(device to host) and swap in (host to device) execute in command order, and with ``pipeline_depth = 2`` the
next step is already queued when the current one ends. ``StubDevice`` is its trio-native twin for tests under
``MockClock``: a step takes ``await trio.sleep(step_time)``, so virtual time never jumps while a thread
computes, and tokens come from the oracle (``events.oracle``).

A ``RunStep`` row fed from step t takes the token that t sampled for its request.

When step t fails, every request it carried is dead: ``StepFailed(t)`` ends them all in the core. But step t+1
was queued before the core heard, and it may carry rows of those requests. Their executor state is wherever the
failure left it: the blocks t appended may be missing, the token t should have sampled was never sampled. Run
as they are, such rows would make the executor reject step t+1 as a whole, and fail requests that had nothing to
do with t. So the device *poisons* the requests of a failed step until their ``ReleaseRequest``: their rows are
cut out of later steps before the executor sees them, and the step reports a placeholder token for each, which
the core discards (the request has already ended).

A failed ``SwapIn`` poisons its request the same way. The core plans rows for a request as soon as it sends its
SwapIn, over the blocks the copy is to fill, so without the copy the executor's table for it is stale. The copy
can go missing for a reason outside the device: a ``DropSpill`` (the request was cancelled or timed out) goes to
the spill actor, which does not wait behind the device's queue, so it can delete the host copy while the SwapIn
still waits in that queue. ``SwapInFailed`` is reported before the step that follows it, so the core has ended
the request before it sees the placeholder.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from tickloom.actors.mailbox import ChannelOverflow, Outbox
from tickloom.actors.spill import SpillActor
from tickloom.engine.model.tables import BoundRequests, proposal_slots
from tickloom.engine.model.types import HostKV, StepResult
from tickloom.events import (
    NO_SAMPLE,
    BindRequest,
    Command,
    Input,
    ReleaseRequest,
    RunStep,
    SamplingSpec,
    SpillOut,
    StepDone,
    StepFailed,
    SwapIn,
    SwapInFailed,
)
from tickloom.events.oracle import (
    OracleRow,
    oracle_accept_count,
    oracle_extra_count,
    oracle_fill_count,
    oracle_step,
)


class Executor(Protocol):
    """What ``engine.model.ModelExecutor`` offers (and ``StubExecutor``)."""

    def bind(self, command: BindRequest) -> None: ...

    def release(self, request_id: str) -> None: ...

    def run_step(self, step: RunStep) -> StepResult: ...

    def copy_out(self, request_id: str, block_ids: list[int], num_tokens: int) -> HostKV: ...

    def copy_in(self, request_id: str, block_ids: list[int], host_kv: HostKV) -> None: ...


def without_requests(step: RunStep, dead: set[str]) -> RunStep:
    """The step with every row of the ``dead`` requests cut out (each column sliced alike)."""
    keep = [rid not in dead for rid in step.request_ids]
    tokens: list[int] = []
    blocks: list[int] = []
    t_off = b_off = 0
    for i, kept in enumerate(keep):
        n, b = step.num_tokens[i], step.num_new_blocks[i]
        if kept:
            tokens += step.token_ids[t_off : t_off + n]
            blocks += step.new_block_ids[b_off : b_off + b]
        t_off += n
        b_off += b

    def rows(column: list[int] | list[str]) -> list[Any]:
        return [v for v, kept in zip(column, keep, strict=True) if kept]

    return RunStep(step.step_id, rows(step.request_ids), rows(step.positions), rows(step.num_tokens), tokens,
                   rows(step.fed_from), rows(step.sample_indices), rows(step.block_starts), rows(step.num_new_blocks),
                   blocks)


def with_placeholders(step: RunStep, dead: set[str], result: StepResult | None) -> StepResult:
    """``result`` (for ``without_requests(step, dead)``) widened back to every sampling row of ``step``: a dead
    request's row gets token 0 and empty logprobs, which the core discards."""
    rows = [rid for rid, s in zip(step.request_ids, step.sample_indices, strict=True) if s != NO_SAMPLE]
    live = iter(range(len(result.token_ids) if result is not None else 0))
    picks = [None if rid in dead else next(live) for rid in rows]

    def widen(column: list[Any] | None, blank: Any) -> list[Any] | None:
        if column is None:
            return None
        return [blank if k is None else column[k] for k in picks]

    tokens = widen(result.token_ids if result is not None else [], 0)
    assert tokens is not None
    if result is None:
        return StepResult(tokens, None, None, None)
    return StepResult(tokens, widen(result.logprobs, 0.0), widen(result.top_token_ids, []),
                      widen(result.top_logprobs, []), widen(result.prompt_logprobs, []),
                      widen(result.prompt_top_token_ids, []), widen(result.prompt_top_logprobs, []),
                      widen(result.extra_token_ids, []), widen(result.proposed, 0))


def step_done(command: RunStep, result: StepResult, elapsed_ns: int) -> StepDone:
    """The ``StepDone`` reporting ``result`` for ``command``'s sampling rows."""
    return StepDone(command.step_id, sampled_ids(command), result.token_ids, elapsed_ns, result.logprobs,
                    result.top_token_ids, result.top_logprobs, result.prompt_logprobs, result.prompt_top_token_ids,
                    result.prompt_top_logprobs, result.extra_token_ids, result.proposed)


def sampled_ids(step: RunStep) -> list[str]:
    return [rid for rid, s in zip(step.request_ids, step.sample_indices, strict=True) if s != NO_SAMPLE]


class ThreadDevice:
    """Runs an ``Executor`` on one dedicated thread; commands queue in order (``submit_nowait``)."""

    def __init__(self, executor: Executor, outbox: Outbox, spill: SpillActor | None, limit: int,
                 fail_steps: frozenset[int] = frozenset()) -> None:
        self.executor = executor
        self.fail_steps = fail_steps
        """Step ids that raise before reaching the executor (``FaultPlan.fail_steps``)."""
        self._outbox = outbox
        self._spill = spill
        self._queue: queue.Queue[Command | None] = queue.Queue(maxsize=limit)
        self._limit = limit
        self._poisoned: set[str] = set()
        """Requests of a failed step, until released (see the module docstring)."""
        self._token: trio.lowlevel.TrioToken | None = None
        self.busy_ns = 0

    def submit_nowait(self, command: Command) -> None:
        try:
            self._queue.put_nowait(command)
        except queue.Full:
            raise ChannelOverflow(f"device queue overflowed its bound of {self._limit} commands") from None

    def stop_nowait(self) -> None:
        """Let the thread exit after the command it is running (idempotent)."""
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            raise ChannelOverflow("device queue is full; cannot stop it") from None

    async def run(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._stop_on_cancel)
                await trio.to_thread.run_sync(self._thread_main)
                nursery.cancel_scope.cancel()
        finally:
            self._token = None

    async def _stop_on_cancel(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self.stop_nowait()

    def _report(self, msg: Input) -> None:
        assert self._token is not None
        trio.from_thread.run(self._outbox.send, msg, trio_token=self._token)

    def _thread_main(self) -> None:
        while True:
            command = self._queue.get()
            if command is None:
                return
            self._execute(command)

    def _execute(self, command: Command) -> None:
        ex = self.executor
        if isinstance(command, RunStep):
            start = time.perf_counter_ns()
            try:
                if command.step_id in self.fail_steps:
                    raise RuntimeError("injected device fault")
                dead = self._poisoned.intersection(command.request_ids) if self._poisoned else set()
                step = without_requests(command, dead) if dead else command
                result = None
                if step.request_ids:
                    result = ex.run_step(step)
                if dead or result is None:
                    result = with_placeholders(command, dead, result)
            except Exception as exc:  # a fault reported as an input: only this step's requests fail
                self._poisoned.update(command.request_ids)
                self._report(StepFailed(command.step_id, f"{type(exc).__name__}: {exc}"))
                return
            elapsed = time.perf_counter_ns() - start
            self.busy_ns += elapsed
            self._report(step_done(command, result, elapsed))
        elif isinstance(command, BindRequest):
            ex.bind(command)
        elif isinstance(command, ReleaseRequest):
            self._poisoned.discard(command.request_id)
            ex.release(command.request_id)
        elif isinstance(command, SpillOut):
            assert self._spill is not None, "SpillOut without a spill store"
            try:
                kv = ex.copy_out(command.request_id, list(command.block_ids), command.num_tokens)
            except Exception as exc:  # reported as SpillDone(error): the core falls back to requeue
                self._to_spill(command.request_id, None, f"copy out failed: {type(exc).__name__}: {exc}")
                return
            self._to_spill(command.request_id, kv, "")
        elif isinstance(command, SwapIn):
            assert self._spill is not None, "SwapIn without a spill store"
            try:
                ex.copy_in(command.request_id, list(command.block_ids), self._spill.store.take(command.request_id))
            except Exception as exc:  # reported as SwapInFailed: that request alone ends with an error
                self._poisoned.add(command.request_id)
                self._report(SwapInFailed(command.request_id, f"{type(exc).__name__}: {exc}"))

    def _to_spill(self, request_id: str, kv: HostKV | None, error: str) -> None:
        assert self._token is not None and self._spill is not None
        trio.from_thread.run_sync(self._spill.accept_nowait, request_id, kv, error, trio_token=self._token)


@dataclass(slots=True)
class _BlockTable:
    block_table: list[int] = field(default_factory=list)


class BlockTables(BoundRequests[_BlockTable]):
    """Block tables alone, for a device with no executor: the stub device checks its steps against them."""

    def bind(self, request_id: str) -> None:
        self._requests[request_id] = _BlockTable()

    def swap_in(self, request_id: str, block_ids: list[int]) -> None:
        self._requests[request_id].block_table[:] = block_ids


class StubDevice:
    """A trio-native device for tests: oracle tokens, ``trio.sleep(step_time)`` per step, scripted faults.

    It keeps block tables and poisons requests as ``ThreadDevice`` does, so a step whose table deltas do not
    cover its rows fails here as it would on a model, and the explorer can find the race that causes it."""

    def __init__(self, outbox: Outbox, spill: SpillActor | None, limit: int, *, vocab_size: int,
                 step_time: Callable[[RunStep], float], avoid: tuple[int, ...] = (),
                 fail_steps: frozenset[int] = frozenset(),
                 script: dict[str, dict[int, int]] | None = None, block_size: int = 16, extras: int = 0) -> None:
        self._outbox = outbox
        self._spill = spill
        self._send, self._receive = trio.open_memory_channel[Command](limit)
        self._limit = limit
        self.vocab_size = vocab_size
        self.step_time = step_time
        self.avoid = avoid
        self.fail_steps = fail_steps
        self.script = script or {}
        self.extras = extras
        """Up to this many extra tokens per sampling row (``StepDone.extra_token_ids``), as a constraint's forced
        tokens come; they are the oracle's own next tokens, so a request's output does not change. 0: none."""
        self.seeds: dict[str, int] = {}
        self.specs: dict[str, tuple[SamplingSpec, list[int]]] = {}
        self.released: list[str] = []
        self.tables = BlockTables(block_size)
        """Each bound request's block table, kept from the commands as an executor keeps it."""
        self._poisoned: set[str] = set()
        self.busy_ns = 0

    def submit_nowait(self, command: Command) -> None:
        try:
            self._send.send_nowait(command)
        except trio.WouldBlock:
            raise ChannelOverflow(f"device queue overflowed its bound of {self._limit} commands") from None

    def stop_nowait(self) -> None:
        self._send.close()

    async def run(self) -> None:
        async for command in self._receive:
            if isinstance(command, RunStep):
                await self._run_step(command)
            elif isinstance(command, BindRequest):
                self.seeds[command.request_id] = command.seed
                self.specs[command.request_id] = (command.params, command.prompt_token_ids)
                self.tables.bind(command.request_id)
            elif isinstance(command, ReleaseRequest):
                self.released.append(command.request_id)
                self.specs.pop(command.request_id, None)
                self.tables.release(command.request_id)
                self._poisoned.discard(command.request_id)
            elif isinstance(command, SpillOut):
                assert self._spill is not None
                self._spill.accept_nowait(command.request_id, HostKV(None, None, command.num_tokens), "")
            elif isinstance(command, SwapIn):
                assert self._spill is not None
                try:
                    self._spill.store.take(command.request_id)
                except KeyError as exc:
                    self._poisoned.add(command.request_id)
                    await self._outbox.send(SwapInFailed(command.request_id, f"no host copy: {exc}"))
                else:
                    self.tables.swap_in(command.request_id, list(command.block_ids))

    async def _run_step(self, command: RunStep) -> None:
        """``ThreadDevice``'s rules in virtual time: poisoned rows cut, tables checked as an executor does."""
        seconds = self.step_time(command)
        await trio.sleep(seconds)
        self.busy_ns += int(seconds * 1e9)
        dead = self._poisoned.intersection(command.request_ids) if self._poisoned else set()
        step = without_requests(command, dead) if dead else command
        try:
            if command.step_id in self.fail_steps:
                raise RuntimeError("scripted device fault")
            self.tables.start_step(step)
        except (RuntimeError, ValueError) as exc:
            self._poisoned.update(command.request_ids)
            await self._outbox.send(StepFailed(command.step_id, f"{type(exc).__name__}: {exc}"))
            return
        rows = [self.row(rid, index) for rid, index in zip(step.request_ids, step.sample_indices, strict=True)
                if index != NO_SAMPLE]
        out = oracle_step(rows, self.vocab_size, self.avoid)
        result = StepResult(out.token_ids, *out.columns)
        slots = [n for n, k in zip(proposal_slots(step), step.sample_indices, strict=True) if k != NO_SAMPLE]
        if self.extras or any(slots):
            extras = [self._extras(row.seed, rid, row.output_index, n) for rid, row, n in zip(
                (r for r, k in zip(step.request_ids, step.sample_indices, strict=True) if k != NO_SAMPLE), rows,
                slots, strict=True)]
            result.extra_token_ids = extras if any(extras) else None
        if any(slots):
            result.proposed = [oracle_fill_count(row.seed, row.output_index, n) if n else 0
                               for row, n in zip(rows, slots, strict=True)]
        if dead:
            result = with_placeholders(command, dead, result)
        await self._outbox.send(step_done(command, result, int(seconds * 1e9)))

    def _extras(self, seed: int, request_id: str, index: int, slots: int) -> list[int]:
        """The oracle's own next tokens, so that a request's output does not change: on a row with proposal slots,
        as many as the oracle's proposer got right (``oracle_accept_count``); on another row, 0 to ``extras`` of
        them, within max_tokens. Both counts are stable per (seed, index)."""
        if slots:
            count = oracle_accept_count(seed, index, slots)
        elif not self.extras:
            return []
        else:
            spec = self.specs.get(request_id, (None, []))[0]
            room = (spec.max_tokens if spec is not None else 16) - index - 1
            count = min(oracle_extra_count(seed, index, self.extras), room)
        return [self.token(request_id, index + 1 + j) for j in range(count)]

    def row(self, request_id: str, index: int) -> OracleRow:
        """A sampling row for the oracle: the request's seed, params and prompt, and a scripted token if any."""
        spec, prompt = self.specs.get(request_id, (None, []))
        return OracleRow(self.seeds[request_id], index, spec, prompt, self.script.get(request_id, {}).get(index))

    def token(self, request_id: str, index: int) -> int:
        return oracle_step([self.row(request_id, index)], self.vocab_size, self.avoid).token_ids[0]


__all__ = ["Executor", "StubDevice", "ThreadDevice"]
