"""Field-level diffs: commands (``commands[3].token_ids[5]: expected 17, got 18``), gauges and core state."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import attrs
import msgspec

from tickloom.engine.core.snapshot import CoreSnapshot
from tickloom.engine.core.status import QUEUE_OF
from tickloom.events import Command, CoreGauges, Input, RunStep

MAX_ITEMS = 20
"""At most this many element differences are listed per field."""


def _key(command: Command) -> tuple[str, str]:
    rid = getattr(command, "request_id", None)
    if rid is None:
        step = getattr(command, "step_id", None)
        rid = "" if step is None else f"step {step}"
    return type(command).__name__, str(rid)


def describe(command: Command) -> str:
    """One short line naming a command."""
    name, key = _key(command)
    if isinstance(command, RunStep):
        return f"RunStep(step {command.step_id}, {len(command.request_ids)} rows)"
    return f"{name}({key})" if key else name


def value_diff(path: str, expected: Any, actual: Any, out: list[str]) -> None:
    """Append ``path: expected X, got Y`` lines for every differing leaf."""
    if expected == actual:
        return
    if isinstance(expected, msgspec.Struct) and type(expected) is type(actual):
        for field in expected.__struct_fields__:
            value_diff(f"{path}.{field}", getattr(expected, field), getattr(actual, field), out)
        return
    if isinstance(expected, list | tuple) and isinstance(actual, list | tuple):
        if len(expected) != len(actual):
            out.append(f"{path}: expected {len(expected)} items, got {len(actual)}")
        shown = 0
        for i, (e, a) in enumerate(zip(expected, actual, strict=False)):
            if e != a:
                if shown == MAX_ITEMS:
                    out.append(f"{path}: ... more differences")
                    break
                value_diff(f"{path}[{i}]", e, a, out)
                shown += 1
        return
    if isinstance(expected, msgspec.Struct) and isinstance(actual, msgspec.Struct):
        out.append(f"{path}: expected {type(expected).__name__}, got {type(actual).__name__}")
        return
    out.append(f"{path}: expected {expected!r}, got {actual!r}")


def diff_commands(expected: Sequence[Command], actual: Sequence[Command]) -> list[str]:
    """Field-level differences between two command lists; commands are aligned by (type, request or step)."""
    out: list[str] = []
    matcher = difflib.SequenceMatcher(a=[_key(c) for c in expected], b=[_key(c) for c in actual], autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal" or (op == "replace" and i2 - i1 == j2 - j1):
            for i, j in zip(range(i1, i2), range(j1, j2), strict=True):
                if type(expected[i]) is not type(actual[j]):
                    out.append(f"commands[{i}]: expected {describe(expected[i])}, got {describe(actual[j])}")
                else:
                    value_diff(f"commands[{i}]", expected[i], actual[j], out)
            continue
        for i in range(i1, i2):
            out.append(f"commands[{i}]: missing {describe(expected[i])}")
        for j in range(j1, j2):
            out.append(f"commands[+{j}]: added {describe(actual[j])}")
    return out


def diff_gauges(expected: CoreGauges, actual: CoreGauges) -> list[str]:
    out: list[str] = []
    value_diff("gauges", expected, actual, out)
    return out


def summarise_inputs(inputs: Sequence[Input]) -> list[str]:
    """One line per input, short."""
    lines = []
    for item in inputs:
        fields = []
        for field in item.__struct_fields__:
            value = getattr(item, field)
            if isinstance(value, list) and len(value) > 8:
                value = f"[{', '.join(map(repr, value[:8]))}, ... {len(value)} items]"
            elif isinstance(value, msgspec.Struct) or value in (None, "") or (value == 0 and field != "step_id"):
                continue
            fields.append(f"{field}={value}")
        lines.append(f"{type(item).__name__}({', '.join(fields)})")
    return lines


_SEQ_FIELDS = ("status", "outputs", "block_ids", "num_computed", "kv_settled", "inflight", "admitted",
               "cached_prompt_tokens", "finish_reason")


def _seq_view(seq: object) -> dict[str, Any]:
    cls = type(seq)
    if attrs.has(cls):
        return {f.name: getattr(seq, f.name) for f in attrs.fields(cls)}
    return {}


def diff_state(expected: CoreSnapshot, actual: CoreSnapshot) -> list[str]:
    """Which requests and blocks differ between two snapshots of the core."""
    out: list[str] = []
    if expected.tick != actual.tick:
        out.append(f"tick: expected {expected.tick}, got {actual.tick}")
    exp = {getattr(s, "request_id", str(i)): s for i, s in enumerate(expected.seqs[: expected.live])}
    act = {getattr(s, "request_id", str(i)): s for i, s in enumerate(actual.seqs[: actual.live])}
    for rid in exp.keys() - act.keys():
        out.append(f"request {rid!r}: live in the log, gone in replay")
    for rid in act.keys() - exp.keys():
        out.append(f"request {rid!r}: live in replay, not in the log")
    for rid in sorted(exp.keys() & act.keys()):
        e, a = _seq_view(exp[rid]), _seq_view(act[rid])
        for field in sorted(e.keys() | a.keys()):
            if e.get(field) != a.get(field):
                value_diff(f"request {rid!r}.{field}", e.get(field), a.get(field), out)
    for queue in dict.fromkeys(QUEUE_OF.values()):
        e_ids = [getattr(expected.seqs[i], "request_id", i) for i in getattr(expected, queue)]
        a_ids = [getattr(actual.seqs[i], "request_id", i) for i in getattr(actual, queue)]
        if e_ids != a_ids:
            out.append(f"queue {queue}: expected {e_ids}, got {a_ids}")
    ep, ap = expected.pool, actual.pool
    if ep.free != ap.free or ep.cached != ap.cached or ep.ref != ap.ref:
        refs = [b for b, (x, y) in enumerate(zip(ep.ref, ap.ref, strict=False)) if x != y]
        out.append(
            f"blocks: free {len(ep.free)} vs {len(ap.free)}, cached {len(ep.cached)} vs {len(ap.cached)}; "
            f"refcounts differ for blocks {refs[:MAX_ITEMS]}{' ...' if len(refs) > MAX_ITEMS else ''}"
        )
        only_free = sorted(set(ep.free) ^ set(ap.free))
        if only_free:
            out.append(f"blocks free in one side only: {only_free[:MAX_ITEMS]}")
    if [s.step_id for s in expected.steps] != [s.step_id for s in actual.steps]:
        out.append(
            f"steps in flight: expected {[s.step_id for s in expected.steps]}, got {[s.step_id for s in actual.steps]}"
        )
    return out
