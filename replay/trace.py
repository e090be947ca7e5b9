"""Read a log as a per-tick trace: the dense table of ``tickloom inspect``, a Perfetto trace and a plot.

Nothing here runs the core: it reads what the log says each tick decided.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

from tickloom.events import (
    NO_SAMPLE,
    LogReader,
    Preempted,
    PrefetchSpill,
    RequestArrived,
    RunStep,
    SpillDone,
    SpillOut,
    StepDone,
    StepFailed,
    SwapIn,
    SwapInFailed,
    SwapInReady,
    TickRecord,
)
from tickloom.events import Finish as FinishCmd


@dataclasses.dataclass(frozen=True, slots=True)
class TickRow:
    """One line of the trace. Prefill tokens: tokens of rows that are not single-token sampling (decode) rows."""

    tick: int
    now_ns: int
    rows: int
    prefill_tokens: int
    decode_tokens: int
    free_blocks: int
    cached_blocks: int
    waiting: int
    running: int
    swapped: int
    preempted: int
    finishes: int
    preemptions: int


COLUMNS = ("tick", "time_ms", "rows", "prefill", "decode", "free", "cached", "waiting", "running", "swapped",
           "preempted", "finishes", "preemptions")
_FMT = "{:>7} {:>10} {:>5} {:>7} {:>6} {:>6} {:>6} {:>7} {:>7} {:>7} {:>9} {:>8} {:>11}"


def header_line() -> str:
    return _FMT.format(*COLUMNS)


def tick_row(record: TickRecord) -> TickRow:
    rows = prefill = decode = finishes = preemptions = 0
    for command in record.outputs.commands:
        if isinstance(command, RunStep):
            rows += len(command.request_ids)
            for n, k in zip(command.num_tokens, command.sample_indices, strict=True):
                if n == 1 and k != NO_SAMPLE:
                    decode += 1
                else:
                    prefill += n
        elif isinstance(command, FinishCmd):
            finishes += 1
        elif isinstance(command, Preempted):
            preemptions += 1
    g = record.outputs.gauges
    return TickRow(record.inputs.tick, record.inputs.now_ns, rows, prefill, decode, g.free_blocks, g.cached_blocks,
                   g.waiting, g.running, g.swapped, g.preempted, finishes, preemptions)


def format_row(row: TickRow, t0_ns: int) -> str:
    return _FMT.format(row.tick, f"{(row.now_ns - t0_ns) / 1e6:.3f}", row.rows, row.prefill_tokens,
                       row.decode_tokens, row.free_blocks, row.cached_blocks, row.waiting, row.running, row.swapped,
                       row.preempted, row.finishes, row.preemptions)


def involves(record: TickRecord, request_id: str) -> list[str]:
    """What happened to ``request_id`` in this tick, briefly (empty if nothing)."""
    events: list[str] = []
    for item in record.inputs.inputs:
        rid = getattr(item, "request_id", None)
        if rid == request_id:
            events.append(f"<{type(item).__name__}")
        elif isinstance(item, StepDone) and request_id in item.request_ids:
            events.append(f"<StepDone({item.step_id}) token {item.token_ids[item.request_ids.index(request_id)]}")
    for command in record.outputs.commands:
        if getattr(command, "request_id", None) == request_id:
            extra = f" {command.reason}" if isinstance(command, FinishCmd) else ""
            events.append(f">{type(command).__name__}{extra}")
        elif isinstance(command, RunStep) and request_id in command.request_ids:
            i = command.request_ids.index(request_id)
            events.append(f">RunStep({command.step_id}) pos {command.positions[i]} n {command.num_tokens[i]}")
        elif request_id in getattr(command, "request_ids", ()):
            events.append(f">{type(command).__name__}")
    return events


def iter_ticks(path: str | os.PathLike[str], first: int | None = None, last: int | None = None
               ) -> Iterator[TickRecord]:
    """Tick records in ``[first, last)``; starts at the nearest snapshot before ``first`` by walking headers."""
    with LogReader(path) as reader:
        ticks = reader.seek(first)[1] if first else reader.ticks()
        for record in ticks:
            tick = record.inputs.tick
            if first is not None and tick < first:
                continue
            if last is not None and tick >= last:
                break
            yield record


def _lanes(slices: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Split slices into lanes so that no two slices on one lane overlap (touching is fine): the Trace Event Format
    requires the complete ("X") slices of one thread track to be disjoint or nested, and running ahead a step starts
    before the previous one ends. Greedy by start time onto the lowest free lane, which uses the fewest lanes."""
    lanes: list[list[dict[str, Any]]] = []
    ends: list[float] = []
    for event in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
        lane = next((i for i, end in enumerate(ends) if end <= event["ts"]), len(lanes))
        if lane == len(lanes):
            lanes.append([])
            ends.append(0.0)
        lanes[lane].append(event)
        ends[lane] = event["ts"] + event["dur"]
    return lanes


def _place(slices: list[dict[str, Any]], pid: int, first_tid: int, label: str,
           names: dict[int, str]) -> list[dict[str, Any]]:
    """Give each slice a ``pid`` and a ``tid`` from ``first_tid`` on, one per lane, named ``label`` (numbered when
    there is more than one lane); returns the slices in lane order."""
    lanes = _lanes(slices) or [[]]
    placed: list[dict[str, Any]] = []
    for i, lane in enumerate(lanes):
        names[first_tid + i] = label if len(lanes) == 1 else f"{label} {i + 1}"
        for event in lane:
            event["pid"], event["tid"] = pid, first_tid + i
            placed.append(event)
    return placed


def perfetto_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A Trace Event Format object: steps (X), request lifetimes (X), spill and swap-in I/O (X), preemptions (i)
    and gauges (C). Timestamps are the log's ``now_ns`` in microseconds. Steps, spills and prefetches that overlap
    (running ahead, concurrent I/O) go on separate tracks of their process, so every track nests."""
    events: list[dict[str, Any]] = []
    device, requests, io = 1, 2, 3
    steps: list[dict[str, Any]] = []
    spills: list[dict[str, Any]] = []
    fetches: list[dict[str, Any]] = []
    swap_ins: list[dict[str, Any]] = []
    step_start: dict[int, tuple[float, int]] = {}
    spill_start: dict[str, float] = {}
    fetch_start: dict[str, float] = {}
    alive: dict[str, float] = {}
    tids: dict[str, int] = {}
    last_ts = 0.0

    def tid(rid: str) -> int:
        return tids.setdefault(rid, len(tids) + 1)

    for record in iter_ticks(path):
        ts = record.inputs.now_ns / 1000.0
        last_ts = ts
        for item in record.inputs.inputs:
            if isinstance(item, StepDone | StepFailed) and item.step_id in step_start:
                start, rows = step_start.pop(item.step_id)
                steps.append({"ph": "X", "name": f"step {item.step_id}", "ts": start, "dur": max(ts - start, 0.0),
                              "cat": "step", "args": {"rows": rows, "failed": isinstance(item, StepFailed)}})
            elif isinstance(item, RequestArrived):
                alive[item.request_id] = ts
                tid(item.request_id)
            elif isinstance(item, SpillDone) and item.request_id in spill_start:
                start = spill_start.pop(item.request_id)
                spills.append({"ph": "X", "name": f"spill {item.request_id}", "ts": start, "dur": ts - start,
                               "cat": "io", "args": {"ok": item.ok, "nbytes": item.nbytes}})
            elif isinstance(item, SwapInReady | SwapInFailed) and item.request_id in fetch_start:
                start = fetch_start.pop(item.request_id)
                fetches.append({"ph": "X", "name": f"prefetch {item.request_id}", "ts": start, "dur": ts - start,
                                "cat": "io", "args": {"ok": isinstance(item, SwapInReady)}})
        for command in record.outputs.commands:
            if isinstance(command, RunStep):
                step_start[command.step_id] = (ts, len(command.request_ids))
            elif isinstance(command, SpillOut):
                spill_start[command.request_id] = ts
            elif isinstance(command, PrefetchSpill):
                fetch_start[command.request_id] = ts
            elif isinstance(command, SwapIn):
                swap_ins.append({"ph": "i", "s": "t", "name": f"swap in {command.request_id}", "ts": ts,
                                 "cat": "io"})
            elif isinstance(command, Preempted):
                events.append({"ph": "i", "s": "t", "name": f"preempt ({command.mode})", "ts": ts,
                               "pid": requests, "tid": tid(command.request_id), "cat": "preempt"})
            elif isinstance(command, FinishCmd):
                start = alive.pop(command.request_id, ts)
                events.append({"ph": "X", "name": f"{command.request_id} ({command.reason})", "ts": start,
                               "dur": ts - start, "pid": requests, "tid": tid(command.request_id), "cat": "request",
                               "args": {"reason": command.reason,
                                        "completion_tokens": command.usage.completion_tokens}})
        g = record.outputs.gauges
        events.append({"ph": "C", "name": "queues", "ts": ts, "pid": device, "tid": 0,
                       "args": {"waiting": g.waiting, "running": g.running, "preempted": g.preempted,
                                "swapped": g.swapped}})
        events.append({"ph": "C", "name": "blocks", "ts": ts, "pid": device, "tid": 0,
                       "args": {"free": g.free_blocks, "cached": g.cached_blocks}})
    for rid, start in alive.items():
        events.append({"ph": "X", "name": f"{rid} (open)", "ts": start, "dur": last_ts - start, "pid": requests,
                       "tid": tid(rid), "cat": "request"})
    for step_id, (start, rows) in step_start.items():  # never settled in the log (it ends first)
        steps.append({"ph": "X", "name": f"step {step_id} (open)", "ts": start, "dur": last_ts - start,
                      "cat": "step", "args": {"rows": rows, "failed": False}})
    device_names: dict[int, str] = {}
    io_names: dict[int, str] = {}
    events += _place(steps, device, 1, "steps", device_names)
    events += _place(spills, io, 1, "spill out", io_names)
    swap_in_tid = len(io_names) + 1
    events += _place(fetches, io, swap_in_tid, "swap-in", io_names)
    events += [{**event, "pid": io, "tid": swap_in_tid} for event in swap_ins]
    meta = [(device, "device", device_names), (io, "spill and swap-in I/O", io_names),
            (requests, "requests", {t: r for r, t in tids.items()})]
    for pid, pname, names in meta:
        events.append({"ph": "M", "name": "process_name", "ts": 0, "pid": pid, "tid": 0, "args": {"name": pname}})
        for t, tname in names.items():
            events.append({"ph": "M", "name": "thread_name", "ts": 0, "pid": pid, "tid": t, "args": {"name": tname}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> int:
    """Write the Perfetto trace of ``path`` to ``out``; returns the number of events."""
    trace = perfetto_trace(path)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(trace, f)
    return len(trace["traceEvents"])


def write_plot(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> None:
    """Plot batch size, free blocks and queue lengths over ticks to a PNG (matplotlib, Agg backend; matplotlib is
    the optional extra ``tickloom[plot]``: without it, ``ImportError`` saying so)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plots need matplotlib: install tickloom[plot]") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [tick_row(r) for r in iter_ticks(path)]
    ticks = [r.tick for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    try:
        axes[0].step(ticks, [r.rows for r in rows], where="post", label="batch rows")
        axes[0].set_ylabel("batch")
        axes[1].step(ticks, [r.free_blocks for r in rows], where="post", label="free")
        axes[1].step(ticks, [r.cached_blocks for r in rows], where="post", label="cached")
        axes[1].set_ylabel("blocks")
        for name in ("waiting", "running", "preempted", "swapped"):
            axes[2].step(ticks, [getattr(r, name) for r in rows], where="post", label=name)
        axes[2].set_ylabel("requests")
        axes[2].set_xlabel("tick")
        for ax in axes:
            ax.legend(loc="upper right", fontsize="small")
            ax.grid(True, alpha=0.3)
        fig.suptitle(os.path.basename(os.fspath(path)))
        fig.tight_layout()
        fig.savefig(out, dpi=80)
    finally:
        plt.close(fig)
