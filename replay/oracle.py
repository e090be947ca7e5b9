"""A torch-free token oracle: the model that the simulator, the core's tests and ``tickloom bench core`` run against.

A token is a stable function of (request seed, output index), exactly like the real sampler's counter-based
noise, so a request's output is the same alone or batched, preempted, swapped or run ahead. Scripts add EOS at
chosen indices and failing steps. ``OracleExecutor`` plays the device executor: it takes the core's commands and
returns the inputs the device would send back (``StepDone`` / ``StepFailed``), checking on the way that every
row is well formed. It is a test double, so it lives with the simulator, not in the core; the token function itself
is ``events.oracle.oracle_token``, which the stub executor and the stub device share.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from tickloom.engine.model.tables import proposal_slots
from tickloom.events import (
    NO_SAMPLE,
    NOT_FED,
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
)
from tickloom.events.oracle import (
    OracleRow,
    oracle_accept_count,
    oracle_extra_count,
    oracle_fill_count,
    oracle_step,
    oracle_token,
)

__all__ = ["OracleExecutor", "oracle_token"]


@attrs.define(slots=True, eq=False)
class OracleExecutor:
    """Answers ``RunStep`` with oracle tokens, as the device executor would, and records the KV it writes."""

    vocab_size: int
    avoid: tuple[int, ...] = ()
    """Tokens never produced unless scripted (EOS, think markers)."""
    scripted: dict[str, dict[int, int]] = attrs.Factory(dict)
    """request id -> {output index: token}, e.g. an EOS at index 4."""
    fail_steps: frozenset[int] = frozenset()
    step_time_ns: int = 1_000_000
    seeds: dict[str, int] = attrs.Factory(dict)
    tables: dict[str, list[int]] = attrs.Factory(dict)
    written: dict[str, list[int]] = attrs.Factory(dict)
    """request id -> every KV position written, in order (for the no-over-run checks)."""
    sampled: dict[int, dict[str, int]] = attrs.Factory(dict)

    shaped: dict[str, SamplingSpec] = attrs.Factory(dict)
    """The params of bound requests with a ``logit_bias`` or ``allowed_token_ids``, which shape their tokens."""
    extras: int = 0
    """At most this many extra tokens per sampling row (``StepDone.extra_token_ids``), as a constraint's forced
    tokens come: how many is a stable function of (seed, output index), and they are the oracle's own next
    tokens, so a request's output is the same with or without them. 0: none (and no extra column)."""
    max_tokens: dict[str, int] = attrs.Factory(dict)
    block_size: int | None = None
    """Set to check the KV of rejected proposals: the slots that hold one (``garbage``) must be written again
    before any row attends to them, and never be spilled."""
    garbage: set[int] = attrs.Factory(set)
    """KV slots (``block * block_size + offset``) written with a rejected proposal and not written since."""
    spilled: dict[str, int] = attrs.Factory(dict)
    """request id -> how many blocks its ``SpillOut`` copied: its ``SwapIn`` must bring at least as many, as a real
    KV cache's ``copy_blocks_in`` requires."""

    def token(self, request_id: str, index: int) -> int:
        script = self.scripted.get(request_id)
        if script is not None and index in script:
            return script[index]
        spec = self.shaped.get(request_id)
        if spec is not None:  # as the stub device samples it (``events.oracle``)
            return oracle_step([OracleRow(self.seeds[request_id], index, spec, [])], self.vocab_size,
                               self.avoid).token_ids[0]
        return oracle_token(self.seeds[request_id], index, self.vocab_size, self.avoid)

    def handle(self, commands: Iterable[Command]) -> list[Input]:
        """Execute commands in order, like the device thread's FIFO; returns the resulting inputs."""
        results: list[Input] = []
        for command in commands:
            if isinstance(command, BindRequest):
                self.seeds[command.request_id] = command.seed
                self.max_tokens[command.request_id] = command.params.max_tokens
                if command.params.logit_bias or command.params.allowed_token_ids is not None:
                    self.shaped[command.request_id] = command.params
                self.tables[command.request_id] = []
            elif isinstance(command, RunStep):
                results.append(self.run_step(command))
            elif isinstance(command, SwapIn):
                spilled = self.spilled.pop(command.request_id, 0)
                if len(command.block_ids) < spilled:
                    raise AssertionError(f"swap-in of {command.request_id!r}: {spilled} blocks were spilled, only "
                                         f"{len(command.block_ids)} block ids given")
                self.tables[command.request_id] = list(command.block_ids)
                self.garbage.difference_update(self._slots(command.block_ids, 0, len(command.block_ids) * (
                    self.block_size or 0)))
            elif isinstance(command, SpillOut):
                self.spilled[command.request_id] = len(command.block_ids)
                if self.block_size:
                    self._check_clean(f"spill of {command.request_id!r}", command.block_ids, command.num_tokens)
            elif isinstance(command, ReleaseRequest):
                self.seeds.pop(command.request_id, None)
                self.max_tokens.pop(command.request_id, None)
                self.shaped.pop(command.request_id, None)
                self.tables.pop(command.request_id, None)
                self.spilled.pop(command.request_id, None)
        return results

    def run_step(self, step: RunStep) -> StepDone | StepFailed:
        offset = 0
        new_offset = 0
        ids: list[str] = []
        tokens: list[int] = []
        extras: list[list[int]] = []
        proposed: list[int] = []
        sampled: dict[str, int] = {}
        try:
            row_slots = proposal_slots(step)
        except ValueError as exc:
            raise AssertionError(f"step {step.step_id}: {exc}") from exc
        for i, request_id in enumerate(step.request_ids):
            table = self.tables[request_id]
            del table[step.block_starts[i] :]
            table.extend(step.new_block_ids[new_offset : new_offset + step.num_new_blocks[i]])
            new_offset += step.num_new_blocks[i]
            fed = step.fed_from[i]
            if fed != NOT_FED and request_id not in self.sampled.get(fed, {}) and fed not in self.fail_steps:
                raise AssertionError(f"step {step.step_id} row {i} is fed from step {fed}, which sampled nothing")
            start, count = step.positions[i], step.num_tokens[i]
            self.written.setdefault(request_id, []).extend(range(start, start + count))
            slots = row_slots[i]
            offset += count
            if self.block_size:
                self.garbage.difference_update(self._slots(table, start, start + count))
                self._check_clean(f"step {step.step_id} row {i}", table, start + count)
            index = step.sample_indices[i]
            if index != NO_SAMPLE:
                token = self.token(request_id, index)
                ids.append(request_id)
                tokens.append(token)
                sampled[request_id] = token
                proposed.append(oracle_fill_count(self.seeds[request_id], index, slots) if slots else 0)
                if slots:
                    accepted = oracle_accept_count(self.seeds[request_id], index, slots)
                    extras.append([self.token(request_id, index + 1 + j) for j in range(accepted)])
                    if self.block_size:
                        self.garbage.update(self._slots(table, start + 1 + accepted, start + count))
                elif self.extras:
                    count = min(oracle_extra_count(self.seeds[request_id], index, self.extras),
                                self.max_tokens[request_id] - index - 1)
                    extras.append([self.token(request_id, index + 1 + j) for j in range(count)])
                else:
                    extras.append([])
        if offset != len(step.token_ids):
            raise AssertionError(f"step {step.step_id}: rows cover {offset} tokens, not {len(step.token_ids)}")
        self.sampled[step.step_id] = sampled
        self.sampled.pop(step.step_id - 4, None)
        if step.step_id in self.fail_steps:
            return StepFailed(step.step_id, "scripted failure")
        return StepDone(step.step_id, ids, tokens, self.step_time_ns, extra_token_ids=extras if any(extras) else None,
                        proposed=proposed if any(row_slots) else None)

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        size = self.block_size or 1
        return [table[q // size] * size + q % size for q in range(start, end) if q // size < len(table)]

    def _check_clean(self, what: str, table: list[int], end: int) -> None:
        """Positions ``0..end-1`` of ``table`` hold no rejected proposal's KV."""
        dirty = self.garbage.intersection(self._slots(table, 0, end))
        if dirty:
            raise AssertionError(f"{what} reads KV slots {sorted(dirty)} written with rejected proposals")

