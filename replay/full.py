"""Full replay: re-run a model on the logged steps and compare its sampled tokens with the logged ``StepDone``s.

The executor is anything with ``handle(commands) -> inputs`` that runs device commands in order (``OracleExecutor``
or ``ModelDevice`` around ``engine.model.executor.ModelExecutor``). Sampling is counter-based, so the same weights
give the same tokens whatever the batch; the first differing (step, row) names a model or numerics difference.
Only ``ModelDevice`` and ``load_device`` import torch, and only when called.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from tickloom.events import (
    BindRequest,
    Command,
    DropSpill,
    Input,
    LogError,
    LogReader,
    ReleaseRequest,
    RunStep,
    SpillOut,
    StepDone,
    StepFailed,
    SwapIn,
)
from tickloom.replay.record import DEVICE_COMMANDS, Device

if TYPE_CHECKING:
    from tickloom.engine.model.executor import ModelExecutor


@dataclasses.dataclass(slots=True)
class FullReport:
    """What a full replay found."""

    status: Literal["identical", "divergent", "unreadable"]
    path: str
    steps: int = 0
    """Steps whose tokens were compared."""
    rows: int = 0
    """Sampled rows compared."""
    failed_steps: int = 0
    """Steps that failed in the log (not compared)."""
    seconds: float = 0.0
    tick: int | None = None
    """The tick whose inputs hold the first differing ``StepDone``."""
    step_id: int | None = None
    row: int | None = None
    request_id: str | None = None
    expected_token: int | None = None
    got_token: int | None = None
    error: str | None = None
    note: str | None = None

    @property
    def exit_code(self) -> int:
        return {"identical": 0, "divergent": 1, "unreadable": 2}[self.status]

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def format_text(self) -> str:
        note = f"\n  note: {self.note}" if self.note else ""
        if self.status == "identical":
            return (f"identical (full): {self.steps} steps, {self.rows} sampled rows, "
                    f"{self.failed_steps} failed steps skipped, {self.seconds:.2f} s{note}")
        if self.status == "unreadable":
            return f"unreadable: {self.error}"
        if self.expected_token is not None:
            return (f"divergent (full): step {self.step_id} (settled at tick {self.tick}) row {self.row} "
                    f"request {self.request_id!r}: expected token {self.expected_token}, got {self.got_token}"
                    f" (after {self.rows} identical rows){note}")
        return f"divergent (full): step {self.step_id} (tick {self.tick}): {self.error}{note}"


def verify_full(path: str | os.PathLike[str], executor: Device, *, note: str | None = None) -> FullReport:
    """Feed every logged device command to ``executor`` in order; compare each step's tokens with the log's.

    A speculating row (``RunStep``'s proposal slots) is re-run with the proposals its logged result shows were
    right (``LoggedProposals``), handed to an executor that takes them (``replay_proposals``): a full replay checks
    the model's tokens, not the proposer's guesses, so it needs neither the draft model nor the same arithmetic in
    it, and each speculating row must accept exactly as many as the log says."""
    report = FullReport("identical", os.fspath(path), note=note)
    produced: dict[int, Input] = {}
    start = time.perf_counter()
    try:
        take = getattr(executor, "replay_proposals", None)
        if callable(take):
            take(logged_proposals(path))
        with LogReader(path) as reader:
            for record in reader.ticks():
                tick = record.inputs.tick
                for item in record.inputs.inputs:
                    if isinstance(item, StepFailed):
                        produced.pop(item.step_id, None)
                        report.failed_steps += 1
                    elif isinstance(item, StepDone) and not _compare(report, tick, item, produced.pop(item.step_id,
                                                                                                    None)):
                        return report
                for command in record.outputs.commands:
                    if isinstance(command, DEVICE_COMMANDS):
                        try:
                            results = executor.handle([command])
                        except Exception as exc:
                            report.status = "divergent"
                            report.tick = tick
                            report.step_id = getattr(command, "step_id", None)
                            report.error = f"the executor raised on {type(command).__name__}: {exc!r}"
                            return report
                        for result in results:
                            if isinstance(result, StepDone | StepFailed):
                                produced[result.step_id] = result
    except LogError as exc:
        report.status = "unreadable"
        report.error = str(exc)
    finally:
        report.seconds = time.perf_counter() - start
    return report


def logged_proposals(path: str | os.PathLike[str]) -> dict[tuple[int, str], list[int]]:
    """(step id, request id) -> the proposals that a row's logged result shows were right: its sampled token and
    its extra tokens but the last (proposal j stood because it equalled the token sampled before it)."""
    right: dict[tuple[int, str], list[int]] = {}
    with LogReader(path) as reader:
        for record in reader.ticks():
            for item in record.inputs.inputs:
                if isinstance(item, StepDone) and item.extra_token_ids:
                    for rid, token, extras in zip(item.request_ids, item.token_ids, item.extra_token_ids,
                                                  strict=True):
                        if extras:
                            right[(item.step_id, rid)] = [token, *extras[:-1]]
    return right


class LoggedProposals:
    """The proposer of a full replay: a speculating row of step ``step_id`` proposes what the log shows was right
    (``logged_proposals``); a row whose logged proposals were all wrong, none."""

    name = "logged"

    def __init__(self, right: dict[tuple[int, str], list[int]]) -> None:
        self.right = right
        self.step_id = -1

    def propose(self, request_id: str, tokens: Sequence[int], most: int) -> list[int]:
        return self.right.get((self.step_id, request_id), [])[:most]

    def release(self, request_id: str) -> None:
        pass


def _compare(report: FullReport, tick: int, logged: StepDone, ours: Input | None) -> bool:
    report.tick = tick
    report.step_id = logged.step_id
    if not isinstance(ours, StepDone):
        report.status = "divergent"
        report.error = "the re-run step failed" if isinstance(ours, StepFailed) else "the step was never run"
        return False
    if ours.request_ids != logged.request_ids:
        report.status = "divergent"
        report.error = f"rows differ: logged {logged.request_ids}, re-run {ours.request_ids}"
        return False
    for row, (rid, expected, got) in enumerate(zip(logged.request_ids, logged.token_ids, ours.token_ids,
                                                   strict=True)):
        if expected != got:
            report.status = "divergent"
            report.row, report.request_id = row, rid
            report.expected_token, report.got_token = expected, got
            return False
    if logged.extra_token_ids != ours.extra_token_ids:
        row = next(i for i in range(len(logged.request_ids)) if _extras(logged, i) != _extras(ours, i))
        report.status = "divergent"
        report.row, report.request_id = row, logged.request_ids[row]
        report.error = f"extra tokens differ: logged {_extras(logged, row)}, re-run {_extras(ours, row)}"
        return False
    report.steps += 1
    report.rows += len(logged.token_ids)
    return True


class ModelDevice:
    """Plays the device thread around a ``ModelExecutor``: runs device commands in order, answers ``RunStep``."""

    def __init__(self, executor: ModelExecutor) -> None:
        self.executor = executor
        self.spilled: dict[str, Any] = {}
        self._proposals: LoggedProposals | None = None

    def replay_proposals(self, right: dict[tuple[int, str], list[int]]) -> None:
        """Speculating rows propose what the log shows was right (``verify_full``)."""
        self._proposals = LoggedProposals(right)
        self.executor.proposer = self._proposals

    def handle(self, commands: Iterable[Command]) -> list[Input]:
        results: list[Input] = []
        ex = self.executor
        for command in commands:
            if isinstance(command, BindRequest):
                ex.bind(command)
            elif isinstance(command, RunStep):
                results.append(self.run_step(command))
            elif isinstance(command, SpillOut):
                host = ex.copy_out(command.request_id, list(command.block_ids), command.num_tokens)
                host.wait()
                self.spilled[command.request_id] = host
            elif isinstance(command, SwapIn):
                host = self.spilled.pop(command.request_id)
                ex.copy_in(command.request_id, list(command.block_ids), host)
            elif isinstance(command, DropSpill):
                self.spilled.pop(command.request_id, None)
            elif isinstance(command, ReleaseRequest):
                ex.release(command.request_id)
                self.spilled.pop(command.request_id, None)
        return results

    def run_step(self, step: RunStep) -> StepDone | StepFailed:
        if self._proposals is not None:
            self._proposals.step_id = step.step_id
        try:
            result = self.executor.run_step(step)
        except Exception as exc:
            return StepFailed(step.step_id, f"{type(exc).__name__}: {exc}")
        ids = [rid for rid, k in zip(step.request_ids, step.sample_indices, strict=True) if k >= 0]
        return StepDone(step.step_id, ids, list(result.token_ids), extra_token_ids=result.extra_token_ids)


def load_device(model: str, num_blocks: int, block_size: int, *, dtype: str | None = None,
                device: str | None = None) -> tuple[ModelDevice, str]:
    """Load ``model`` (a name or path ``engine.model.loaders.load_model`` knows) as a ``ModelDevice``; returns it
    and the model's fingerprint. (A speculative log's proposer is not needed: ``verify_full`` replays its rows with
    the proposals the log shows were right.)"""
    from tickloom.engine.model.executor import ModelExecutor
    from tickloom.engine.model.loaders import load_model
    from tickloom.engine.model.structured import Constraints

    loaded = load_model(model, dtype=dtype or None, device=device or None)
    cfg = loaded.config
    constraints = Constraints(loaded.tokenizer, cfg.vocab_size, tuple(cfg.eos_token_ids))
    executor = ModelExecutor(loaded.model, num_blocks=num_blocks, block_size=block_size, constraints=constraints)
    return ModelDevice(executor), loaded.fingerprint


def _extras(done: StepDone, row: int) -> list[int]:
    return [] if done.extra_token_ids is None else done.extra_token_ids[row]
