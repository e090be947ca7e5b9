"""The race explorer's driver, one for both levels: run seeds, shrink the first violation, and hand it over (its log,
a replay token, a regression test).

A level (``Level``) is what one seed's run means: ``tools.explore.core`` runs the real ``SchedulerCore`` in the
simulator, each completion moved by a seeded strategy; ``tools.explore.actors`` runs the real trio actors and
``Engine`` on the stub device, trio's scheduler seeded. Either draws a seed's *subject* (the clients' script, or a
recorded log's workload: a list of actions a run can keep a subset of), runs it under a *schedule* (seed, strategy,
faults), re-runs it with a subset kept, and writes its log.

``explore`` runs the seeds in order (each under the level's checks) and stops at the first violation. Every
``level.sample_every``-th seed, and the shrunk violation, also writes its log and checks that it replays
``identical``. At the core level writing and replaying a log costs about as much as the run itself, so a sample
(every 100th seed) keeps the exploration fast while still proving, seed after seed, that what the explorer runs is
what a log would replay; the actor level's engine writes its log anyway, and every seed's is replayed.

``shrink_violation`` delta-debugs (``ddmin``) the violating run, re-checking that each candidate still violates with
the same kind: first the run's moved events (each reset to the prompt default; only the core level moves events:
the actor level's schedule is trio's, seeded), then the subject (a 1-minimal subset of its actions; where they come
in time order, as the core level's do, of its shortest violating prefix), then the moved events again. The result
re-plays from the seed (or the log it came from), the kept actions and the kept moved events, which is what a replay
token holds (``tickloom explore --replay TOKEN``), and what the printed regression test re-runs.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import shutil
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec

from tickloom.replay.policy import Decision
from tickloom.tools.cli import plural
from tickloom.tools.explore.checks import Violation
from tickloom.tools.explore.variants import check_variant, enabled

STRATEGIES = ("random", "pct", "delay")
"""The scheduling strategies, by the same names at both levels (each level reads them its own way)."""
TOKEN_PREFIXES = {"core": "tlc1-", "actors": "tla1-"}
"""A replay token's prefix says its level."""


# -- what a level provides -------------------------------------------------------------------------------------------
class Subject(Protocol):
    """What a seed explores: a list of actions (clients arriving, leaving, faults striking) that a run can keep a
    subset of."""

    @property
    def actions(self) -> Sequence[Any]: ...

    def subset(self, keep: Sequence[int]) -> Subject: ...


S = TypeVar("S", bound=Subject)


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    """What a seed's schedule is drawn from."""

    seed: int
    strategy: str
    faults: bool


@dataclasses.dataclass(slots=True)
class Run:
    """One run's outcome."""

    violation: Violation | None
    ticks: int
    edits: list[Decision] = dataclasses.field(default_factory=list)
    """The run's moved events: its decisions that differ from the prompt default's (the core level's)."""
    virtual_s: float | None = None
    """The virtual seconds the run took (the actor level's, under ``MockClock``)."""
    fatal: str | None = None
    """The engine's fatal error, if it had one (the actor level's: a planned crash, or a violation)."""


class Level(Protocol[S]):
    """One level of the explorer, as the driver calls it."""

    name: str
    """``core`` or ``actors``: the level's name in reports, tokens, log names and regression tests."""
    sample_every: int
    """Every this many seeds (seed % sample_every == 0), the run also writes its log and replays it."""
    moves_events: bool
    """Whether its runs record moved events (``Run.edits``) that shrinking can reset."""
    ordered_actions: bool
    """Whether its subjects' actions come in time order, so that none after a violation can matter: shrinking then
    first cuts the subject to its shortest violating prefix."""

    def subject(self, seed: int, faults: bool, source: str | None) -> S:
        """The subject a seed explores: the log ``source``'s workload (every seed the same), or the seed's own.
        Raises ``ValueError`` for a source the level cannot explore."""
        ...

    def run(self, subject: S, schedule: Schedule, log: Path, *, check_replay: bool) -> Run:
        """The seed's own run, its schedule drawn from ``schedule``; with ``check_replay``, the run's log is written
        at ``log`` (a file the level may replace) and must replay ``identical``."""
        ...

    def rerun(self, subject: S, schedule: Schedule, edits: Sequence[Decision], log: Path, *,
              check_replay: bool) -> Run:
        """The run that ``edits`` (a subset of the run's moved events) describe, the default answering the rest."""
        ...

    def check_kept_log(self, path: Path, kind: str) -> str:
        """How the kept log at ``path`` shows a violation of ``kind`` on the code as built now (one line; "" if the
        level has nothing to add to its replay)."""
        ...

    def describe_action(self, action: Any) -> str:
        """One of the subject's actions, in one line."""
        ...

    def describe_edit(self, edit: Decision) -> str:
        """One moved event, in words."""
        ...


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
    """The log whose workload was explored (None: the seed's own subject)."""
    keep: list[int] | None
    """Indices of the kept actions; None keeps all."""
    edits: list[Edit]


def encode_token(token: Token) -> str:
    return TOKEN_PREFIXES[token.level] + base64.urlsafe_b64encode(msgspec.msgpack.encode(token)).decode().rstrip("=")


def decode_token(text: str) -> Token:
    """Raises ``ValueError`` for anything that is not a token ``encode_token`` wrote."""
    level = next((name for name, prefix in TOKEN_PREFIXES.items() if text.startswith(prefix)), None)
    if level is None:
        raise ValueError(f"a replay token starts with {' or '.join(map(repr, TOKEN_PREFIXES.values()))}")
    body = text[len(TOKEN_PREFIXES[level]):]
    try:
        token = msgspec.msgpack.decode(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)), type=Token)
    except (binascii.Error, ValueError, msgspec.DecodeError) as exc:
        raise ValueError(f"not a replay token: {exc}") from None
    if token.level != level or token.strategy not in STRATEGIES:
        raise ValueError(f"not a {level}-level token (level {token.level!r}, strategy {token.strategy!r})")
    check_variant(level, token.variant)
    return token


def token_subject(level: Level[Any], token: Token) -> Subject:
    """The subject a token re-runs: the seed's (or the log's), kept to the token's actions."""
    if token.edits and not level.moves_events:
        raise ValueError(f"a {level.name}-level token holds no moved events")
    subject: Subject = level.subject(token.seed, token.faults, token.log)
    if token.keep is None:
        return subject
    if any(not 0 <= i < len(subject.actions) for i in token.keep):
        raise ValueError(f"seed {token.seed} has {len(subject.actions)} actions; cannot keep {token.keep}")
    return subject.subset(token.keep)


def replay(level: Level[Any], token: Token) -> tuple[Subject, Run]:
    """Re-run a token's shrunk run on the code as built now (its variant only if the caller enabled it): the subject
    it ran and the run. Raises ``ValueError`` for a token that does not fit the level."""
    subject = token_subject(level, token)
    edits = [Decision(e.tick, e.what, e.key, e.value) for e in token.edits]
    with tempfile.TemporaryDirectory(prefix="tickloom-explore-") as work:
        run = level.rerun(subject, Schedule(token.seed, token.strategy, token.faults), edits,
                          Path(work) / "run.tlog", check_replay=True)
    return subject, run


# -- exploring and shrinking -----------------------------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class Found:
    """A violation, shrunk to ``keep`` (of ``actions`` actions) and ``edits`` (of ``moved`` moved events)."""

    level: Level[Any]
    seed: int
    strategy: str
    faults: bool
    variant: str | None
    source: str | None
    """The log whose workload was explored, or None."""
    original: Violation
    violation: Violation
    """The shrunk run's violation."""
    actions: int
    keep: list[int]
    moved: int
    edits: list[Decision]
    shrink_runs: int
    shrink_s: float
    log: Path | None = None
    """The shrunk run's log, when kept (``keep_log``)."""
    reproduced: str = ""
    """What the kept log shows when checked again (``keep_log``)."""

    @property
    def schedule(self) -> Schedule:
        return Schedule(self.seed, self.strategy, self.faults)

    @property
    def token(self) -> str:
        edits = [Edit(d.tick, d.what, d.key, d.value) for d in self.edits]
        return encode_token(Token(self.level.name, self.seed, self.strategy, self.faults, self.variant, self.source,
                                  self.keep, edits))

    def subject(self) -> Subject:
        """The shrunk subject: the seed's (or the log's), kept to ``keep``."""
        subject: Subject = self.level.subject(self.seed, self.faults, self.source)
        return subject.subset(self.keep)


@dataclasses.dataclass(slots=True)
class Exploration:
    level: str
    seeds: int
    elapsed_s: float
    found: Found | None
    logs: int = 0
    """Seeds whose log was written and replayed (the sample)."""

    def summary(self) -> str:
        rate = self.seeds / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return (f"explored {plural(self.seeds, 'seed')} ({self.level}) in {self.elapsed_s:.1f} s: {rate:.1f} seeds/s, "
                f"{plural(int(self.found is not None), 'violation')}")


def explore(level: Level[Any], seeds: Sequence[int], strategy: str = "random", faults: bool = False,
            variant: str | None = None, *, source: str | None = None, shrink: bool = True, out: Path | None = None,
            progress: Callable[[int, Run], None] | None = None) -> Exploration:
    """Run the seeds in order under ``variant`` (None: the real code), stop at the first violation and shrink it.

    ``source``: explore that log's workload (every seed the same workload, another schedule). ``elapsed_s`` counts
    the seeds' runs only, not the shrinking. With ``out``, the shrunk run's log is kept there.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    check_variant(level.name, variant)
    fixed = level.subject(0, faults, source) if source is not None else None
    with tempfile.TemporaryDirectory(prefix="tickloom-explore-") as work, enabled(variant):
        log = Path(work) / "run.tlog"
        started = time.perf_counter()
        logs = 0
        for ran, seed in enumerate(seeds, 1):
            subject = fixed if fixed is not None else level.subject(seed, faults, None)
            sampled = seed % level.sample_every == 0
            schedule = Schedule(seed, strategy, faults)
            run = level.run(subject, schedule, log, check_replay=sampled)
            logs += int(sampled)
            log.unlink(missing_ok=True)
            if progress is not None:
                progress(seed, run)
            if run.violation is not None:
                elapsed = time.perf_counter() - started
                found = shrink_violation(level, schedule, variant, source, subject, run, log, shrink=shrink)
                if out is not None:
                    keep_log(found, out)
                return Exploration(level.name, ran, elapsed, found, logs)
        return Exploration(level.name, len(seeds), time.perf_counter() - started, None, logs)


def shrink_violation(level: Level[Any], schedule: Schedule, variant: str | None, source: str | None,
                     subject: Subject, run: Run, log: Path, *, shrink: bool = True) -> Found:
    """Delta-debug the run's moved events and subject (see the module docstring), keeping the violation's kind;
    the re-runs write their logs at ``log`` where they write one."""
    started = time.perf_counter()
    violation, edits = run.violation, run.edits
    assert violation is not None
    kind = violation.kind
    seen: dict[tuple[tuple[int, ...], tuple[int, ...]], Violation | None] = {}

    def check(keep: list[int], kept: list[int]) -> Violation | None:
        key = (tuple(keep), tuple(kept))
        if key not in seen:
            seen[key] = level.rerun(subject.subset(keep), schedule, [edits[i] for i in kept], log,
                                    check_replay=kind == "replay").violation
        got = seen[key]
        return got if got is not None and got.kind == kind else None

    keep = list(range(len(subject.actions)))
    kept = list(range(len(edits)))
    if check(keep, kept) is None:
        raise RuntimeError(f"seed {schedule.seed}: re-run from its seed and moved events, the run does not violate "
                           f"again ({violation}): got {seen[(tuple(keep), tuple(kept))]}; the explorer is not "
                           "deterministic")
    if shrink:
        kept = ddmin(kept, lambda k: check(keep, k) is not None)
        if level.ordered_actions:
            keep = next(keep[:n] for n in range(len(keep) + 1) if check(keep[:n], kept) is not None)
        keep = ddmin(keep, lambda k: check(k, kept) is not None)
        kept = ddmin(kept, lambda k: check(keep, k) is not None)
    shrunk = check(keep, kept)
    assert shrunk is not None
    return Found(level, schedule.seed, schedule.strategy, schedule.faults, variant, source, violation, shrunk,
                 len(subject.actions), keep, len(edits), [edits[i] for i in kept], len(seen),
                 time.perf_counter() - started)


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
    """Re-run the shrunk run with its log, keep the log in ``out`` (never over a file) and check what it reproduces
    on the code as built now (``Level.check_kept_log``)."""
    level = found.level
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"explore-{level.name}-seed{found.seed}.tlog"
    n = 0
    while target.exists() or target.is_symlink():
        n += 1
        target = out / f"explore-{level.name}-seed{found.seed}-{n}.tlog"
    with tempfile.TemporaryDirectory(prefix="tickloom-explore-") as work:
        log = Path(work) / "run.tlog"
        again = level.rerun(found.subject(), found.schedule, found.edits, log, check_replay=True).violation
        shutil.move(log, target)
    if again is None or again.kind != found.violation.kind:
        raise RuntimeError(f"seed {found.seed}: the shrunk run did not violate again ({again}); the explorer is "
                           "not deterministic")
    found.log = target
    found.reproduced = level.check_kept_log(target, found.violation.kind)
    return target


# -- what a violation leaves behind ----------------------------------------------------------------------------------
def _shrunk_to(found: Found) -> str:
    moved = f" and from {found.moved} to {len(found.edits)} moved events" if found.level.moves_events else ""
    return f"from {found.actions} to {len(found.keep)} actions{moved}"


def regression_test(found: Found) -> str:
    """A pytest test (source text) that fails while the violation is present and passes once it is fixed."""
    level = found.level
    detail = textwrap.wrap(" ".join(str(found.violation).split()), 110)
    lines = [f"    # {line}" for line in detail[:4]]
    lines.append(f"    # shrunk {_shrunk_to(found)}:")
    lines += [f"    #   {level.describe_action(action)}"[:118] for action in found.subject().actions]
    lines += [f"    #   moved: {level.describe_edit(d)}"[:118] for d in found.edits]
    if found.source is not None:
        lines.append(f"    # the workload is read from {found.source}"[:118])
    token = found.token
    chunks = "\n".join(f'        "{token[i:i + 100]}"' for i in range(0, len(token), 100))
    variant = f", variant {found.variant}" if found.variant else ""
    body = "\n".join(lines)
    return f'''def test_explore_{level.name}_seed_{found.seed}_{found.strategy}() -> None:
    """Found by the race explorer ({level.name} level, seed {found.seed}, strategy {found.strategy}{variant})."""
{body}
    from tickloom.tools.explore.levels import replay_token

    violation = replay_token(
{chunks}
    )
    assert violation is None, str(violation)
'''


def describe(found: Found) -> str:
    """The report printed for a violation."""
    level = found.level
    faults = "on" if found.faults else "off"
    lines = [
        f"VIOLATION at seed {found.seed} ({level.name}, strategy {found.strategy}, faults {faults}"
        f"{', variant ' + found.variant if found.variant else ''}): {found.original}",
        f"shrunk {_shrunk_to(found)} in {found.shrink_runs} runs ({found.shrink_s:.1f} s): {found.violation}",
    ]
    lines += [f"  {level.describe_action(action)}" for action in found.subject().actions]
    lines += [f"  moved: {level.describe_edit(d)}" for d in found.edits]
    if found.log is not None:
        lines.append(f"log: {found.log}  (tickloom replay --bisect {found.log})")
        if found.reproduced:
            lines.append(f"  checked again: {found.reproduced}")
    else:
        lines.append("log: not kept (pass --out DIR to keep the failing run's log)")
    lines.append(f"replay: tickloom explore --replay {found.token}")
    lines.append("regression test (pytest):")
    lines.append(regression_test(found))
    return "\n".join(lines)
