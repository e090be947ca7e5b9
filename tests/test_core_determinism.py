"""C22: determinism. The same ``TickInputs`` give byte-identical ``TickOutputs``: in one process, across processes
with different ``PYTHONHASHSEED``, and after a snapshot is taken, restored and continued.

The workload is a C26 blast run (``test_core_blast.run_blast``): arrivals with shared prompts and cache salts,
priorities, deadlines, cancels, stop matches, preemption in a small pool, spill with delayed ``SpillDone`` and
``SwapInReady``, step failures, and ``pipeline_depth`` 2 with the device sometimes holding two steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from test_core_blast import BlastHarness, blast_config, run_blast

from tickloom.engine.core import SchedulerCore
from tickloom.engine.core.snapshot import CoreSnapshot, decode_snapshot, encode_snapshot
from tickloom.engine.core.status import Status
from tickloom.events import (
    Finish,
    RequestArrived,
    RunStep,
    TickInputs,
    TickOutputs,
    TickRecord,
    decode_frame,
    encode,
    encode_tick,
)

REPO = Path(__file__).resolve().parent.parent
SEED = 2222
TICKS = 1500

_SCRIPT = """
import sys
sys.path[:0] = [{tests!r}, {repo!r}]
from test_core_blast import blast_config, run_blast
from tickloom.events import encode_tick
h = run_blast({seed}, {ticks}, blast_config(2, True, True, 24))
with open(sys.argv[1], "wb") as f:
    for inputs, outputs in zip(h.inputs, h.outputs, strict=True):
        frame = encode_tick(inputs, outputs)
        f.write(len(frame).to_bytes(4, "little") + frame)
"""


def workload() -> BlastHarness:
    """The C22 workload: depth 2, spill, prefix caching, 24 blocks."""
    return run_blast(SEED, TICKS, blast_config(2, True, True, 24))


def replay(inputs: list[TickInputs], core: SchedulerCore | None = None) -> list[bytes]:
    """Feed ``inputs`` to ``core`` (a fresh one of the workload's config by default); the encoded outputs."""
    core = core or SchedulerCore(blast_config(2, True, True, 24))
    return [encode(core.tick(tick_inputs)) for tick_inputs in inputs]


def test_c22_workload_covers_the_hard_cases() -> None:
    h = workload()
    kinds = {type(c).__name__ for out in h.outputs for c in out.commands}
    assert {"Preempted", "SpillOut", "SwapIn", "WatchDeadline", "DropSpill"} <= kinds
    reasons = {f.reason for f in h.finishes.values()}
    assert reasons == {"stop", "length", "timeout", "cancelled", "error"}
    assert any(f.usage.cached_prompt_tokens for f in h.finishes.values()), "prefix-cache hits"
    assert any(any(step.fed_from[i] >= 0 for i in range(len(step.fed_from)))
               for _, step in h.commands(RunStep) if isinstance(step, RunStep)), "rows fed from a step in flight"


def test_c22_same_inputs_same_output_bytes() -> None:
    h = workload()
    original = [encode(out) for out in h.outputs]
    first = replay(h.inputs)
    second = replay(h.inputs)
    assert first == original
    assert second == original
    # The inputs themselves round-trip through the log encoding and still give the same bytes.
    decoded = [msgspec.msgpack.decode(encode(i), type=TickInputs) for i in h.inputs]
    assert replay(decoded) == original


def _run_script(tmp_path: Path, hashseed: str) -> bytes:
    out = tmp_path / f"frames-{hashseed}.bin"
    script = _SCRIPT.format(tests=str(REPO / "tests"), repo=str(REPO), seed=SEED, ticks=TICKS)
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, env=env, cwd=REPO, timeout=300)
    return out.read_bytes()


def _frames(data: bytes) -> list[bytes]:
    frames, offset = [], 0
    while offset < len(data):
        length = int.from_bytes(data[offset : offset + 4], "little")
        frames.append(data[offset + 4 : offset + 4 + length])
        offset += 4 + length
    return frames


def test_c22_identical_bytes_across_hash_seeds(tmp_path: Path) -> None:
    a = _run_script(tmp_path, "0")
    b = _run_script(tmp_path, "12345")
    frames_a, frames_b = _frames(a), _frames(b)
    for k, (fa, fb) in enumerate(zip(frames_a, frames_b, strict=True)):
        assert fa == fb, f"tick {k}: frames differ between PYTHONHASHSEED=0 and 12345"
    records = [decode_frame(f) for f in frames_a]
    assert all(isinstance(r, TickRecord) for r in records)
    ticks = [r for r in records if isinstance(r, TickRecord)]
    # The frames hold the whole workload: every request that arrived ended exactly once, and the core drained.
    arrived = [m.request_id for r in ticks for m in r.inputs.inputs if isinstance(m, RequestArrived)]
    ended = [c.request_id for r in ticks for c in r.outputs.commands if isinstance(c, Finish)]
    assert arrived and sorted(ended) == sorted(arrived)
    gauges = ticks[-1].outputs.gauges
    assert (gauges.waiting, gauges.running, gauges.preempted, gauges.swapped) == (0, 0, 0, 0)
    assert gauges.free_blocks + gauges.cached_blocks == blast_config(2, True, True, 24).num_blocks
    # And this process (another hash seed again) replays the logged inputs to the logged outputs.
    core = SchedulerCore(blast_config(2, True, True, 24))
    for frame, record in zip(frames_a, ticks, strict=True):
        outputs = core.tick(record.inputs)
        assert encode_tick(record.inputs, outputs, core.last_encoded_commands) == frame


WANTED = (("two_steps", "fences"), ("two_steps", "swapping"), ("fences", "preempted"),
          ("swapping", "waiting", "cached"), ("two_steps", "preempted", "cached"))
"""States to snapshot in: two steps in flight with fences held, swaps pending, and so on."""


def _has(s: CoreSnapshot, what: tuple[str, ...]) -> bool:
    live = s.seqs[: s.live]
    checks = {
        "two_steps": len(s.steps) == 2,
        "fences": bool(s.fences),
        "swapping": any(live[i].status in (Status.SWAPPING, Status.SWAPPED) for i in s.swapping_or_swapped),
        "preempted": bool(s.preempted),
        "waiting": bool(s.waiting),
        "cached": bool(s.pool.cached),
    }
    return all(checks[w] for w in what)


def test_c22_snapshot_restore_continues_identically() -> None:
    # Some states are rare (fences held while a sequence is preempted): the workloads of a few seeds, from SEED
    # on, are searched until every state in WANTED has been snapshotted and continued from.
    missing = list(WANTED)
    for seed in range(SEED, SEED + 5):
        if not missing:
            break
        h = run_blast(seed, TICKS, blast_config(2, True, True, 24))
        inputs = h.inputs
        original = [encode(out) for out in h.outputs]
        core = SchedulerCore(blast_config(2, True, True, 24))
        snaps: list[CoreSnapshot] = []
        for tick_inputs in inputs:
            core.tick(tick_inputs)
            snaps.append(core.snapshot())
        picks: list[int] = []
        for wanted in list(missing):
            k = next((k for k, snap in enumerate(snaps) if _has(snap, wanted) and k not in picks), None)
            if k is not None:
                picks.append(k)
                missing.remove(wanted)
        for k in picks:
            snap = snaps[k]
            restored = SchedulerCore.from_snapshot(snap)
            assert encode_snapshot(restored.snapshot()) == encode_snapshot(snap), f"tick {k}: restore is lossy"
            from_bytes = SchedulerCore.from_snapshot(decode_snapshot(encode_snapshot(snap)))
            for core_k in (restored, from_bytes):
                for t in range(k + 1, len(inputs)):
                    out: TickOutputs = core_k.tick(inputs[t])
                    assert encode(out) == original[t], f"seed {seed}, snapshot at tick {k}: tick {t} diverges"
                    core_k.check_invariants()
    assert not missing, f"the workloads never had {missing} in flight"


def test_c22_snapshot_is_a_copy() -> None:
    """A snapshot does not change as its core (or a core restored from it) runs on."""
    h = workload()
    core = SchedulerCore(blast_config(2, True, True, 24))
    for tick_inputs in h.inputs[:200]:
        core.tick(tick_inputs)
    snap = core.snapshot()
    before = encode_snapshot(snap)
    restored = SchedulerCore.from_snapshot(snap)
    for tick_inputs in h.inputs[200:400]:
        core.tick(tick_inputs)
        restored.tick(tick_inputs)
    assert encode_snapshot(snap) == before
    assert encode_snapshot(core.snapshot()) == encode_snapshot(restored.snapshot())


def test_c22_a_snapshot_keeps_the_encoded_name_of_its_swapped_out_queue() -> None:
    """``CoreSnapshot.swapping_or_swapped`` is encoded as ``swapped``, its name before the rename, so snapshots
    logged before it still decode, and ones written now decode in the same place."""
    h = workload()
    core = SchedulerCore(blast_config(2, True, True, 24))
    for tick_inputs in h.inputs:
        core.tick(tick_inputs)
        snap = core.snapshot()
        if snap.swapping_or_swapped:
            break
    else:
        raise AssertionError("the workload never swapped a sequence out")
    fields = msgspec.msgpack.decode(encode_snapshot(snap))
    assert "swapping_or_swapped" not in fields
    assert fields["swapped"] == snap.swapping_or_swapped
    assert decode_snapshot(msgspec.msgpack.encode(fields)).swapping_or_swapped == snap.swapping_or_swapped


def test_c22_the_tick_keeps_the_encoding_of_its_commands_for_the_log() -> None:
    """The log writer and the verifier reuse ``last_encoded_commands`` instead of encoding the commands again: it
    must be exactly this tick's commands, encoded."""
    from tickloom.events import encode_commands

    h = run_blast(5, 40, blast_config(2, True, True, 64))
    core = h.core
    out = core.tick(TickInputs(core.state.tick + 1, core.state.now_ns, []))
    assert core.last_encoded_commands == encode_commands(out.commands)


def test_c22_a_finished_sequence_missing_from_running_is_named() -> None:
    from core_state import add_seq, make_core

    from tickloom.engine.core import InvariantViolation

    state = make_core(num_blocks=16, block_size=16, max_seq_len=128).state
    for i in range(9):
        add_seq(state, f"r{i}", 4)
    ghost = add_seq(state, "ghost", 4)
    state.running.remove(ghost)
    ghost.status = Status.FINISHED
    state.finished_in_running.append(ghost)
    with pytest.raises(InvariantViolation) as raised:
        state.prune_running()
    assert str(raised.value) == ("finished sequences leave running once: 'ghost' is listed as finished in running but "
                                 "is not in it")
