"""The status transition table (``engine/core/status.py``): every legal move, every illegal one refused, the core
taking every row, and no status changed anywhere but through ``change_status``."""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterator
from itertools import product

import pytest
from core_state import add_seq, make_core
from purity import REPO
from test_core_blast import blast_config, run_blast

from tickloom.engine.core import InvariantViolation
from tickloom.engine.core import status as status_module
from tickloom.engine.core.state import Seq
from tickloom.engine.core.status import (
    PARKED,
    QUEUE_OF,
    TRANSITIONS,
    Status,
    StatusEvent,
    change_status,
)

LEGAL = sorted(TRANSITIONS.items(), key=lambda item: (item[0][0], item[0][1].value))
ILLEGAL_PAIRS = [pair for pair in product(Status, StatusEvent) if pair not in TRANSITIONS]


def _name(source: Status, event: StatusEvent, to: Status) -> str:
    return f"{source.name}-{event.name}-{to.name}"


def _seq_in(status: Status) -> Seq:
    core = make_core(num_blocks=8, max_seq_len=64)
    return add_seq(core.state, "r", 4, outputs=1, status=status)


@pytest.mark.parametrize(("move", "to"), LEGAL, ids=[_name(*move, to) for move, to in LEGAL])
def test_every_legal_transition_goes_through_change_status(move: tuple[Status, StatusEvent], to: Status) -> None:
    source, event = move
    seq = _seq_in(source)
    change_status(seq, event, to)
    assert seq.status is to


def _plausible_target(event: StatusEvent) -> Status:
    """The status ``event`` leads to somewhere in the table: the move a confused phase would ask for."""
    return next(to for (_, e), to in TRANSITIONS.items() if e is event)


ILLEGAL = [(source, event, _plausible_target(event)) for source, event in ILLEGAL_PAIRS] + [
    (source, event, wrong) for (source, event), to in LEGAL for wrong in Status if wrong is not to
]


@pytest.mark.parametrize(("source", "event", "to"), ILLEGAL, ids=[_name(*move) for move in ILLEGAL])
def test_an_illegal_transition_is_refused_naming_from_event_and_to(
    source: Status, event: StatusEvent, to: Status
) -> None:
    seq = _seq_in(source)
    with pytest.raises(InvariantViolation) as raised:
        change_status(seq, event, to)
    assert raised.value.invariant == "status transitions"
    assert raised.value.detail == f"'r': {source.name} --{event.value}--> {to.name} is not a legal transition"
    assert seq.status is source, "a refused move leaves the status as it was"


def test_a_finished_sequence_moves_no_more() -> None:
    assert not [event for (source, event) in TRANSITIONS if source is Status.FINISHED]
    assert {to for (_, event), to in TRANSITIONS.items() if event is StatusEvent.FINISH} == {Status.FINISHED}
    assert {source for (source, event) in TRANSITIONS if event is StatusEvent.FINISH} == set(Status) - {
        Status.FINISHED}


def test_every_live_status_names_its_queue() -> None:
    live = {source for source, _ in TRANSITIONS}
    assert set(QUEUE_OF) == live
    state = make_core(num_blocks=8, max_seq_len=64).state
    for queue in QUEUE_OF.values():
        assert hasattr(state, queue)


def test_parked_is_what_a_preemption_reaches_before_running_again() -> None:
    """``PARKED``: the statuses a running sequence reaches by table moves other than finishing, until it runs."""
    reached: set[Status] = set()
    frontier = [Status.RUNNING]
    while frontier:
        current = frontier.pop()
        for (source, event), to in TRANSITIONS.items():
            if source is current and event is not StatusEvent.FINISH and to is not Status.RUNNING and to not in reached:
                reached.add(to)
                frontier.append(to)
    assert reached == PARKED


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[tuple[Status, StatusEvent, Status]]]:
    """Records every move the core makes: ``change_status`` wrapped in every core module that calls it."""
    moves: set[tuple[Status, StatusEvent, Status]] = set()

    def recording(seq: Seq, event: StatusEvent, to: Status) -> None:
        source = seq.status
        change_status(seq, event, to)
        moves.add((source, event, to))

    callers = [module for name, module in sys.modules.items()
               if name.startswith("tickloom.engine.core.") and getattr(module, "change_status", None) is change_status]
    assert status_module in callers and len(callers) > 1
    for module in callers:
        if module is not status_module:
            monkeypatch.setattr(module, "change_status", recording)
    yield moves


def test_the_core_takes_every_row_of_the_table(taken: set[tuple[Status, StatusEvent, Status]]) -> None:
    """A random blast with spills (some failing), preemption, cancels, deadlines and shutdown: no row is dead."""
    run_blast(0, 1200, blast_config(2, True, True, 24), shutdown=True)
    assert taken == {(source, event, to) for (source, event), to in TRANSITIONS.items()}


# -- No status changes outside change_status -------------------------------------------------------------------

PRODUCTION = ("engine", "actors", "events", "replay", "tools", "fleet")


def _status_assignments(tree: ast.AST) -> Iterator[int]:
    """Lines that assign an attribute named ``status``."""
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr == "status":
                yield node.lineno


def _mentions_status(tree: ast.AST, line: int) -> bool:
    """Whether the statement at ``line`` names ``Status``: a sequence's status, not a report's."""
    return any(isinstance(node, ast.Name) and node.id == "Status" and node.lineno == line for node in ast.walk(tree))


def _sources() -> Iterator[tuple[str, ast.AST]]:
    for room in PRODUCTION:
        for path in sorted((REPO / room).rglob("*.py")):
            yield str(path.relative_to(REPO)), ast.parse(path.read_text(), str(path))


def _offenders(keep: Callable[[str, ast.AST, int], bool]) -> list[str]:
    """``file:line`` of each status assignment that ``keep(file, tree, line)`` accepts."""
    return [f"{name}:{line}" for name, tree in _sources() for line in _status_assignments(tree)
            if keep(name, tree, line)]


def test_only_change_status_assigns_a_status_in_the_core() -> None:
    assert _offenders(lambda name, _, __: name.startswith("engine/core/") and name != "engine/core/status.py") == []


def test_no_module_outside_the_core_changes_a_sequence_status() -> None:
    outside = _offenders(lambda name, tree, line: not name.startswith("engine/core/") and _mentions_status(tree, line))
    assert outside == []


def test_no_module_outside_the_core_calls_change_status() -> None:
    found = [
        f"{name}:{node.lineno}" for name, tree in _sources() if not name.startswith("engine/core/")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and any(alias.name == "change_status" for alias in node.names)
    ]
    assert found == []
