"""The core-level explorer's loop: run seeds, shrink the first violation, and hand it over (log, token, test).

``explore`` runs the seeds in order (each under ``replay.explore``'s checks) and stops at the first violation.
Every ``SAMPLE_EVERY``-th seed, and the shrunk violation, also writes its log and checks that it replays
``identical``: writing and replaying a log costs about as much as the run itself, so a sample keeps the exploration
fast while still proving, seed after seed, that what the explorer runs is what a log would replay.

``shrink_violation`` delta-debugs (``ddmin``) the violating run, re-checking that each candidate still violates with
the same kind: first the moved events (each reset to the prompt default), then the client script (its shortest
prefix, then a 1-minimal subset of that), then the moved events again. The result re-plays from the seed (or the
log it came from), the kept actions and the kept edits, which is what a replay token holds (``tickloom explore
--replay TOKEN``), and what the printed regression test re-runs.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import msgspec

from tickloom.replay.explore import (
    LEVEL,
    STRAND_TICKS,
    STRATEGIES,
    Workload,
    default_run,
    describe_action,
    log_workload,
    random_workload,
    run_workload,
    seed_workload,
    strategy_policy,
)
from tickloom.replay.explore_checks import StrandCheck, Violation, check_log
from tickloom.replay.policy import Decision
from tickloom.replay.variants import VARIANTS, enabled
from tickloom.replay.verify import bisect, verify

SAMPLE_EVERY = 100
"""Every this many seeds (seed % SAMPLE_EVERY == 0), the run also writes its log and replays it."""
TOKEN_PREFIX = "tlc1-"
CLIENT_KINDS = frozenset({"ending", "order", "overrun", "stop", "deadline"})


# -- replay tokens ---------------------------------------------------------------------------------------------------
class Edit(msgspec.Struct, frozen=True, array_like=True):
    """One moved event: a ``replay.policy.Decision`` in a token."""

    tick: int
    what: str
    key: tuple[str | int, ...]
    value: int | bool | tuple[tuple[str | int, ...], ...] | None


class Token(msgspec.Struct, frozen=True, array_like=True):
    """What ``tickloom explore --replay`` needs to re-run a shrunk violation."""

    level: str
    seed: int
    strategy: str
    faults: bool
    variant: str | None
    log: str | None
    """The log whose workload was explored (None: the seed's random clients)."""
    keep: list[int] | None
    """Indices of the kept script actions; None keeps all."""
    edits: list[Edit]


def encode_token(token: Token) -> str:
    return TOKEN_PREFIX + base64.urlsafe_b64encode(msgspec.msgpack.encode(token)).decode().rstrip("=")


def decode_token(text: str) -> Token:
    """Raises ``ValueError`` for anything that is not a token ``encode_token`` wrote."""
    if not text.startswith(TOKEN_PREFIX):
        raise ValueError(f"a core-level replay token starts with {TOKEN_PREFIX!r}")
    body = text[len(TOKEN_PREFIX):]
    try:
        token = msgspec.msgpack.decode(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)), type=Token)
    except (binascii.Error, ValueError, msgspec.DecodeError) as exc:
        raise ValueError(f"not a replay token: {exc}") from None
    if token.level != LEVEL or token.strategy not in STRATEGIES:
        raise ValueError(f"not a core-level token (level {token.level!r}, strategy {token.strategy!r})")
    if token.variant is not None and token.variant not in VARIANTS:
        raise ValueError(f"the token names an unknown variant {token.variant!r}")
    return token


def token_workload(token: Token) -> Workload:
    workload = seed_workload(token.seed, token.log)
    if token.keep is None:
        return workload
    if any(not 0 <= i < len(workload.actions) for i in token.keep):
        raise ValueError(f"the workload has {len(workload.actions)} actions; cannot keep {token.keep}")
    return workload.subset(token.keep)


def replay_token(text: str) -> Violation | None:
    """Re-run a token's shrunk run on the code as built now (a variant only if the caller enabled one)."""
    token = decode_token(text)
    edits = [Decision(e.tick, e.what, e.key, e.value) for e in token.edits]
    return default_run(token_workload(token), edits).violation


# -- exploring and shrinking -----------------------------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class Found:
    """A violation, shrunk to ``keep`` (of ``actions`` script actions) and ``edits`` (of ``moved`` moved events)."""

    seed: int
    strategy: str
    faults: bool
    variant: str | None
    source: str | None
    """The log whose workload was explored, or None."""
    original: Violation
    violation: Violation
    actions: int
    keep: list[int]
    moved: int
    edits: list[Decision]
    shrink_runs: int
    shrink_s: float
    log: Path | None = None
    reproduced: str = ""
    """What the kept log shows when checked again (``keep_log``)."""

    @property
    def token(self) -> str:
        edits = [Edit(d.tick, d.what, d.key, d.value) for d in self.edits]
        return encode_token(Token(LEVEL, self.seed, self.strategy, self.faults, self.variant, self.source,
                                  self.keep, edits))

    def workload(self) -> Workload:
        return seed_workload(self.seed, self.source).subset(self.keep)


@dataclasses.dataclass(slots=True)
class Exploration:
    seeds: int
    elapsed_s: float
    found: Found | None
    logs: int = 0
    """Seeds whose log was written and replayed (the sample)."""

    def summary(self) -> str:
        rate = self.seeds / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return (f"explored {self.seeds} seeds ({LEVEL}) in {self.elapsed_s:.1f} s: {rate:.1f} seeds/s, "
                f"{int(self.found is not None)} violations")


def explore(seeds: Sequence[int], strategy: str = "random", faults: bool = False, variant: str | None = None, *,
            log: str | None = None, shrink: bool = True, out: Path | None = None, sample_every: int = SAMPLE_EVERY,
            progress: Callable[[int, Violation | None, int], None] | None = None) -> Exploration:
    """Run the seeds in order under ``variant`` (None: the real code), stop at the first violation and shrink it.

    ``log``: explore that log's workload (every seed the same workload, another schedule). ``elapsed_s`` counts the
    seeds' runs only, not the shrinking. With ``out``, the shrunk run's log is kept there.
    """
    base = log_workload(log) if log is not None else None
    with tempfile.TemporaryDirectory(prefix="tickloom-explore-") as work, enabled(variant):
        started = time.perf_counter()
        logs = 0
        for ran, seed in enumerate(seeds, 1):
            workload = base if base is not None else random_workload(seed)
            path = Path(work) / f"seed{seed}.tlog" if sample_every and seed % sample_every == 0 else None
            result = run_workload(workload, strategy_policy(seed, strategy, faults, workload.config), log=path)
            if path is not None:
                logs += 1
                path.unlink()
            if progress is not None:
                progress(seed, result.violation, result.ticks)
            if result.violation is not None:
                elapsed = time.perf_counter() - started
                found = shrink_violation(seed, strategy, faults, variant, log, workload, result.violation,
                                         result.edits, shrink=shrink)
                if out is not None:
                    keep_log(found, out)
                return Exploration(ran, elapsed, found, logs)
        return Exploration(len(seeds), time.perf_counter() - started, None, logs)


def shrink_violation(seed: int, strategy: str, faults: bool, variant: str | None, source: str | None,
                     workload: Workload, violation: Violation, edits: list[Decision], *,
                     shrink: bool = True) -> Found:
    """Delta-debug the run's moved events and script (see the module docstring), keeping the violation's kind."""
    started = time.perf_counter()
    kind = violation.kind
    seen: dict[tuple[tuple[int, ...], tuple[int, ...]], Violation | None] = {}

    def check(keep: list[int], kept: list[int]) -> Violation | None:
        key = (tuple(keep), tuple(kept))
        if key not in seen:
            seen[key] = default_run(workload.subset(keep), [edits[i] for i in kept]).violation
        got = seen[key]
        return got if got is not None and got.kind == kind else None

    keep = list(range(len(workload.actions)))
    kept = list(range(len(edits)))
    if check(keep, kept) is None:
        raise RuntimeError(f"seed {seed}: the run's moved events do not re-play its violation ({violation}): "
                           f"got {seen[(tuple(keep), tuple(kept))]}")
    if shrink:
        kept = ddmin(kept, lambda k: check(keep, k) is not None)
        keep = next(keep[:n] for n in range(len(keep) + 1) if check(keep[:n], kept) is not None)
        keep = ddmin(keep, lambda k: check(k, kept) is not None)
        kept = ddmin(kept, lambda k: check(keep, k) is not None)
    shrunk = check(keep, kept)
    assert shrunk is not None
    return Found(seed, strategy, faults, variant, source, violation, shrunk, len(workload.actions), keep,
                 len(edits), [edits[i] for i in kept], len(seen), time.perf_counter() - started)


def ddmin(items: list[int], test: Callable[[list[int]], bool]) -> list[int]:
    """Zeller's delta debugging: a 1-minimal sublist of ``items`` for which ``test`` holds (it holds for all)."""
    if test([]):
        return []
    n = 2
    while len(items) >= 2:
        size = math.ceil(len(items) / n)
        chunks = [items[i:i + size] for i in range(0, len(items), size)]
        for chunk in chunks:
            if test(chunk):
                items, n = chunk, 2
                break
        else:
            for chunk in chunks:
                rest = [x for x in items if x not in chunk]
                if test(rest):
                    items, n = rest, max(n - 1, 2)
                    break
            else:
                if n >= len(items):
                    break
                n = min(len(items), 2 * n)
    return items


def keep_log(found: Found, out: Path) -> Path:
    """Write the shrunk run's log in ``out`` (never over a file) and check what it reproduces, on the code as built
    now: it replays ``identical``; ``replay.bisect`` names the violating tick (invariants; with ``StrandCheck``,
    stranding); ``check_log`` finds a client-visible violation."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"explore-{LEVEL}-seed{found.seed}.tlog"
    n = 0
    while target.exists() or target.is_symlink():
        n += 1
        target = out / f"explore-{LEVEL}-seed{found.seed}-{n}.tlog"
    again = default_run(found.workload(), found.edits, log=target).violation
    if again is None or again.kind != found.violation.kind:
        raise RuntimeError(f"seed {found.seed}: the shrunk run did not violate again ({again}); the explorer is "
                           "not deterministic")
    found.log = target
    found.reproduced = reproduce(target, found.violation.kind)
    return target


def reproduce(path: Path, kind: str) -> str:
    """How the log at ``path`` shows a violation of ``kind`` on the code as built now (one line)."""
    report = verify(path)
    replays = f"replay: {report.status}"
    if kind == "invariant" or kind == "stranded":
        if kind == "stranded":
            how, bisected = "replay.bisect(log, StrandCheck)", bisect(path, StrandCheck(STRAND_TICKS))
        else:
            how, bisected = "replay --bisect", bisect(path)
        return f"{replays}; {how}: {bisected.status} at tick {bisected.first_divergent_tick}: {bisected.error}"
    if kind in CLIENT_KINDS:
        return f"{replays}; the clients' check on the log: {check_log(path)}"
    return f"{replays} (the {kind} check reads the run's end state)"


# -- what a violation leaves behind ----------------------------------------------------------------------------------
def describe_edit(edit: Decision) -> str:
    """One moved event, in words (the default answer is the prompt one: see ``replay.explore.default_policy``)."""
    what, key, value = edit.what, edit.key, edit.value
    if what == "device_steps":
        return f"tick {key[0]}: the device completes {value} steps (default 1)"
    if what == "delay":
        return f"{'/'.join(map(str, key))} delivered {value} ticks late"
    if what == "step_fails":
        return f"step {key[1]} fails"
    if what in ("spill_ok", "swap_in"):
        return f"{'/'.join(map(str, key))} fails"
    if what == "deadline_due":
        return f"tick {key[1]}: the deadline of {key[0]} is {'reported early' if value else 'not reported yet'}"
    return f"tick {key[0]}: {what} order {value!r}"


def regression_test(found: Found) -> str:
    """A pytest test (source text) that fails while the violation is present and passes once it is fixed."""
    detail = textwrap.wrap(" ".join(str(found.violation).split()), 110)
    lines = [f"    # {line}" for line in detail[:4]]
    lines.append(f"    # shrunk to {len(found.keep)} of {found.actions} actions, {len(found.edits)} of {found.moved} "
                 "moved events:")
    lines += [f"    #   {describe_action(action)}"[:118] for action in found.workload().actions]
    lines += [f"    #   moved: {describe_edit(d)}"[:118] for d in found.edits]
    if found.source is not None:
        lines.append(f"    # the workload is read from {found.source}"[:118])
    token = found.token
    chunks = "\n".join(f'        "{token[i:i + 100]}"' for i in range(0, len(token), 100))
    variant = f", variant {found.variant}" if found.variant else ""
    body = "\n".join(lines)
    return f'''def test_explore_{LEVEL}_seed_{found.seed}_{found.strategy}() -> None:
    """Found by the race explorer ({LEVEL} level, seed {found.seed}, strategy {found.strategy}{variant})."""
{body}
    from tickloom.replay.shrink import replay_token

    violation = replay_token(
{chunks}
    )
    assert violation is None, str(violation)
'''


def describe(found: Found) -> str:
    """The report printed for a violation."""
    faults = "on" if found.faults else "off"
    lines = [
        f"VIOLATION at seed {found.seed} ({LEVEL}, strategy {found.strategy}, faults {faults}"
        f"{', variant ' + found.variant if found.variant else ''}): {found.original}",
        f"shrunk from {found.actions} to {len(found.keep)} actions and from {found.moved} to {len(found.edits)} "
        f"moved events in {found.shrink_runs} runs ({found.shrink_s:.1f} s): {found.violation}",
    ]
    lines += [f"  {describe_action(action)}" for action in found.workload().actions]
    lines += [f"  moved: {describe_edit(d)}" for d in found.edits]
    if found.log is not None:
        lines.append(f"log: {found.log}  (tickloom replay --bisect {found.log})")
        lines.append(f"  checked again: {found.reproduced}")
    else:
        lines.append("log: not kept (pass --out DIR to keep the failing run's log)")
    lines.append(f"replay: tickloom explore --replay {found.token}")
    lines.append("regression test (pytest):")
    lines.append(regression_test(found))
    return "\n".join(lines)


# -- the command line ------------------------------------------------------------------------------------------------
class UsageError(ValueError):
    """A bad argument (variant, token): the command line reports it as a usage error."""


class UnreadableLog(ValueError):
    """The log to explore around cannot be read: the command line exits 2, as every log reader does."""


@contextmanager
def _usage() -> Iterator[None]:
    try:
        yield
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def run_cli(*, log: str | None, seeds: Sequence[int], strategy: str, faults: bool, variant: str | None,
            out: Path | None, shrink: bool, verbose: bool, replay: str | None) -> int:
    """``tickloom explore [LOG]`` at the core level (and ``--replay`` of a core-level token): prints the report and
    the summary line; 0 no violation, 1 a violation. Raises ``UsageError`` for bad arguments and ``UnreadableLog``
    for a log that cannot be read."""
    from tickloom.events import LogError

    if replay is not None:
        with _usage():
            token = decode_token(replay)
            workload = token_workload(token)
        edits = [Decision(e.tick, e.what, e.key, e.value) for e in token.edits]
        started = time.perf_counter()
        with enabled(token.variant):
            violation = default_run(workload, edits).violation
        elapsed = time.perf_counter() - started
        print(f"replayed seed {token.seed} ({LEVEL}, strategy {token.strategy}, faults "
              f"{'on' if token.faults else 'off'}{', variant ' + token.variant if token.variant else ''}; "
              f"{len(workload.actions)} actions, {len(edits)} moved events): {violation or 'no violation'}")
        print(f"explored 1 seeds ({LEVEL}) in {elapsed:.1f} s: {1 / max(elapsed, 1e-9):.1f} seeds/s, "
              f"{int(violation is not None)} violations")
        return 1 if violation is not None else 0
    if variant is not None and variant not in VARIANTS:
        raise UsageError(f"unknown core variant {variant!r}")
    if log is not None:
        try:
            log_workload(log)
        except (LogError, OSError, ValueError) as exc:
            raise UnreadableLog(f"cannot explore {log}: {exc}") from exc

    def progress(seed: int, violation: Violation | None, ticks: int) -> None:
        print(f"seed {seed}: {ticks} ticks: {violation or 'ok'}", flush=True)

    exploration = explore(seeds, strategy, faults, variant, log=log, shrink=shrink, out=out,
                          progress=progress if verbose else None)
    if exploration.found is not None:
        print(describe(exploration.found))
    print(exploration.summary())
    return 1 if exploration.found is not None else 0
