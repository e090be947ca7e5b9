"""The router with its log: inputs gathered, one tick, one frame handed to the OS, then the decisions leave.

``LoggedRouter`` is what the front end holds. Load reports and finished requests wait in ``pending`` (a report
replaces the same replica's older one, so at most one per replica waits, and finishes are bounded by the open
requests) and go in with the next tick: an arrival's, a replica going down or up, or ``flush``. A tick's frame is
written (``write(2)``) before its decisions are returned, so a request never leaves before the decision that sent
it is in the log.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from tickloom.engine.core.blocks import ROOT_HASH, chain_hashes, pack_tokens
from tickloom.events import SnapshotRecord
from tickloom.fleet.router import Router, encode_router_snapshot
from tickloom.fleet.router_events import (
    Arrival,
    Finished,
    LoadReport,
    ReplicaDown,
    ReplicaUp,
    RouterCommand,
    RouterConfig,
    RouterInput,
    RouterTickInputs,
    RouterTickRecord,
)
from tickloom.fleet.router_log import RouterLogWriter


def prompt_block_hashes(prompt: Sequence[int], block_size: int, salt: str, limit: int) -> list[bytes]:
    """The core's prefix-cache keys of the prompt's first ``limit`` full blocks (``engine.core.blocks``): the
    router's affinity key is exactly what a replica's prefix cache is indexed by."""
    head = prompt[: block_size * limit]
    return chain_hashes(ROOT_HASH, pack_tokens(head), block_size, salt)


class LoggedRouter:
    """A ``Router`` whose every tick is logged to ``log_path`` (None: not logged, e.g. a what-if)."""

    def __init__(self, config: RouterConfig, log_path: str | os.PathLike[str] | None, clock: Callable[[], int], *,
                 snapshot_every: int = 0) -> None:
        self.router = Router(config)
        self.config = config
        self.clock = clock
        self.snapshot_every = snapshot_every
        self.writer = RouterLogWriter(log_path, config, snapshot_every) if log_path is not None else None
        self._reports: dict[int, LoadReport] = {}
        self._finished: list[Finished] = []

    def arrival(self, request_id: str, prompt: Sequence[int], salt: str = "") -> Arrival:
        cfg = self.config
        return Arrival(request_id, prompt_block_hashes(prompt, cfg.block_size, salt, cfg.affinity_blocks),
                       len(prompt))

    def report(self, report: LoadReport) -> None:
        self._reports[report.replica] = report

    def finished(self, request_id: str) -> None:
        self._finished.append(Finished(request_id))

    def route(self, arrival: Arrival) -> list[RouterCommand]:
        return self.tick([arrival])

    def down(self, replica: int, reason: str) -> list[RouterCommand]:
        return self.tick([ReplicaDown(replica, reason)])

    def up(self, replica: int, incarnation: int) -> list[RouterCommand]:
        return self.tick([ReplicaUp(replica, incarnation)])

    def flush(self) -> list[RouterCommand]:
        """Tick with what is pending, if anything is."""
        return self.tick([]) if self._reports or self._finished else []

    def tick(self, events: list[RouterInput]) -> list[RouterCommand]:
        inputs: list[RouterInput] = [*self._finished, *(self._reports[i] for i in sorted(self._reports)), *events]
        self._finished = []
        self._reports = {}
        tick_inputs = RouterTickInputs(self.router.tick_no + 1, self.clock(), inputs)
        outputs = self.router.tick(tick_inputs)
        if self.writer is not None:
            self.writer.append_router_tick(RouterTickRecord(tick_inputs, outputs))
            if self.snapshot_every and (outputs.tick + 1) % self.snapshot_every == 0:
                self.writer.append_snapshot(SnapshotRecord(outputs.tick, outputs.digest,
                                                           encode_router_snapshot(self.router.snapshot())))
            self.writer.flush()
        return outputs.commands

    def close(self) -> None:
        """Log what is pending, then close the log."""
        self.flush()
        if self.writer is not None:
            self.writer.close()
