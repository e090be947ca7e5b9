"""Behavioural tests that kill mutants of replay's field-level diffs (scripts/mutate.sh --area replay): a divergence
report is what a person reads to find a bug, so its lines are pinned exactly: which command, which field, which index,
expected (logged) against got (replayed)."""

from __future__ import annotations

import attrs
import msgspec

from tests.replay_helpers import everything_log, rid_of, state_at_tick_20, step  # noqa: F401 (the log and state fixtures)
from tickloom.engine.core.snapshot import CoreSnapshot
from tickloom.events import (
    CoreGauges,
    DropSpill,
    EmitTokens,
    Finish,
    Preempted,
    ReleaseRequest,
    StepDone,
)
from tickloom.events.types import Usage
from tickloom.replay import diff
from tickloom.replay.diff import (
    MAX_ITEMS,
    describe,
    diff_commands,
    diff_gauges,
    diff_state,
    summarise_inputs,
    value_diff,
)

# --- describe and value_diff -------------------------------------------------------------------------------------


def test_describe_names_a_command_by_request_or_step() -> None:
    assert describe(step(4, ["a", "b", "c"])) == "RunStep(step 4, 3 rows)"
    assert describe(ReleaseRequest("r1")) == "ReleaseRequest(r1)"
    assert describe(Preempted("r2", "swap")) == "Preempted(r2)"
    assert describe(EmitTokens(["a"], [1], [0], [False])) == "EmitTokens"
    assert diff._key(step(0, [])) == ("RunStep", "step 0")
    assert diff._key(DropSpill("x")) == ("DropSpill", "x")
    assert diff._key(EmitTokens([], [], [], [])) == ("EmitTokens", "")


def test_value_diff_names_each_differing_leaf() -> None:
    out: list[str] = []
    value_diff("x", 1, 1, out)
    assert out == []
    value_diff("x", 1, 2, out)
    assert out == ["x: expected 1, got 2"]
    out = []
    value_diff("c", ReleaseRequest("a"), ReleaseRequest("b"), out)
    assert out == ["c.request_id: expected 'a', got 'b'"]
    out = []
    value_diff("c", ReleaseRequest("a"), Preempted("a", "swap"), out)
    assert out == ["c: expected ReleaseRequest, got Preempted"]
    out = []
    value_diff("l", [1, 2, 3], [1, 5, 3, 4], out)
    assert out == ["l: expected 3 items, got 4", "l[1]: expected 2, got 5"]
    out = []
    value_diff("t", (1, 2), [1, 3], out)
    assert out == ["t[1]: expected 2, got 3"]
    out = []
    value_diff("s", "ab", ["a", "b"], out)
    assert out == ["s: expected 'ab', got ['a', 'b']"]


def test_value_diff_lists_at_most_max_items_differences() -> None:
    n = MAX_ITEMS + 5
    out: list[str] = []
    value_diff("v", list(range(n)), [i + 1 for i in range(n)], out)
    assert out == [f"v[{i}]: expected {i}, got {i + 1}" for i in range(MAX_ITEMS)] + ["v: ... more differences"]
    out = []
    value_diff("v", list(range(MAX_ITEMS)), [i + 1 for i in range(MAX_ITEMS)], out)
    assert len(out) == MAX_ITEMS and "more" not in out[-1]
    out = []  # equal elements do not count towards the limit
    expected = [0] * (2 * MAX_ITEMS)
    actual = [0] * (2 * MAX_ITEMS - 1) + [1]
    value_diff("w", expected, actual, out)
    assert out == [f"w[{2 * MAX_ITEMS - 1}]: expected 0, got 1"]


# --- diff_commands -------------------------------------------------------------------------------------------------


def test_diff_commands_aligns_by_type_and_request() -> None:
    a = [ReleaseRequest("a"), step(1, ["a", "b"], [5, 6]), ReleaseRequest("b")]
    assert diff_commands(a, a) == []
    b = [ReleaseRequest("a"), step(1, ["a", "b"], [5, 9]), ReleaseRequest("b")]
    assert diff_commands(a, b) == ["commands[1].token_ids[1]: expected 6, got 9"]
    # a missing command and an added one
    assert diff_commands(a, [a[0], a[2]]) == ["commands[1]: missing RunStep(step 1, 2 rows)"]
    assert diff_commands([a[0], a[2]], a) == ["commands[+1]: added RunStep(step 1, 2 rows)"]
    # one replaced by another of the same length: compared field by field, or named when the types differ
    c = [ReleaseRequest("a"), Preempted("x", "swap"), ReleaseRequest("b")]
    assert diff_commands(a, c) == ["commands[1]: expected RunStep(step 1, 2 rows), got Preempted(x)"]
    d = [ReleaseRequest("a"), ReleaseRequest("z"), ReleaseRequest("b")]
    assert diff_commands([ReleaseRequest("a"), ReleaseRequest("y"), ReleaseRequest("b")], d) == [
        "commands[1].request_id: expected 'y', got 'z'"]
    # a replace of unequal lengths lists what is missing and what is added
    e = [ReleaseRequest("a"), Preempted("p", "requeue"), Preempted("q", "swap"), ReleaseRequest("b")]
    assert diff_commands(a, e) == ["commands[1]: missing RunStep(step 1, 2 rows)", "commands[+1]: added Preempted(p)",
                                   "commands[+2]: added Preempted(q)"]


def test_diff_commands_same_key_other_fields() -> None:
    a = [Finish("r", "stop", Usage(5, 0, 3))]
    b = [Finish("r", "length", Usage(5, 0, 4))]
    lines = diff_commands(a, b)
    assert "commands[0].reason: expected 'stop', got 'length'" in lines
    assert lines == ["commands[0].reason: expected 'stop', got 'length'",
                     "commands[0].usage.completion_tokens: expected 3, got 4"]


def test_diff_gauges() -> None:
    g = CoreGauges(1, 2, 3, 4, 5, 6)
    assert diff_gauges(g, g) == []
    assert diff_gauges(g, CoreGauges(1, 2, 3, 4, 9, 6)) == ["gauges.free_blocks: expected 5, got 9"]


# --- summarise_inputs ----------------------------------------------------------------------------------------------


def test_summarise_inputs_shows_the_fields_that_say_something() -> None:
    done = StepDone(0, [], [], step_time_ns=0)  # a step id of 0 is shown; other zeros, None and "" are not
    assert summarise_inputs([done]) == ["StepDone(step_id=0, request_ids=[], token_ids=[])"]
    timed = StepDone(2, ["a"], [0], step_time_ns=5)
    assert summarise_inputs([timed, done]) == ["StepDone(step_id=2, request_ids=['a'], token_ids=[0], step_time_ns=5)",
                                               "StepDone(step_id=0, request_ids=[], token_ids=[])"]
    ten = StepDone(3, ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"], list(range(10)))
    assert summarise_inputs([ten]) == [
        "StepDone(step_id=3, request_ids=['a', 'b', 'c', 'd', 'e', 'f', 'g', 'h', ... 10 items], "
        "token_ids=[0, 1, 2, 3, 4, 5, 6, 7, ... 10 items])"]
    eight = StepDone(1, list("abcdefgh"), [0, 1, 2, 3, 4, 5, 6, 7])
    assert summarise_inputs([eight]) == [
        "StepDone(step_id=1, request_ids=['a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'], token_ids=[0, 1, 2, 3, 4, 5, 6, 7])"]
    assert summarise_inputs([]) == []


# --- diff_state ----------------------------------------------------------------------------------------------------


def test_diff_state_of_equal_states_is_empty(state: CoreSnapshot) -> None:
    assert diff_state(state, state) == []


def test_diff_state_names_the_tick(state: CoreSnapshot) -> None:
    later = msgspec.structs.replace(state, tick=state.tick + 3)
    assert diff_state(state, later) == [f"tick: expected {state.tick}, got {state.tick + 3}"]


def test_diff_state_names_a_request_field(state: CoreSnapshot) -> None:
    i = state.running[0]
    seqs = list(state.seqs)
    seqs[i] = attrs.evolve(seqs[i], num_computed=seqs[i].num_computed + 5)
    changed = msgspec.structs.replace(state, seqs=seqs)
    rid = rid_of(state, i)
    assert diff_state(state, changed) == [
        f"request {rid!r}.num_computed: expected {state.seqs[i].num_computed}, got {state.seqs[i].num_computed + 5}"]
    outputs = list(state.seqs[i].outputs)
    outputs[0] += 1
    seqs[i] = attrs.evolve(state.seqs[i], outputs=outputs)
    assert diff_state(state, msgspec.structs.replace(state, seqs=seqs)) == [
        f"request {rid!r}.outputs[0]: expected {state.seqs[i].outputs[0]}, got {outputs[0]}"]


def test_diff_state_names_requests_live_on_one_side_only(state: CoreSnapshot) -> None:
    # the last live sequence is gone from the replayed state (and from its queue)
    last = state.live - 1
    rid = rid_of(state, last)
    queue = next(q for q in ("waiting", "running", "preempted", "swapping_or_swapped") if last in getattr(state, q))
    fewer = msgspec.structs.replace(state, live=state.live - 1,
                                    **{queue: [i for i in getattr(state, queue) if i != last]})
    name = {"swapping_or_swapped": "swapping_or_swapped"}.get(queue, queue)
    lines = diff_state(state, fewer)
    e_ids = [rid_of(state, i) for i in getattr(state, queue)]
    a_ids = [rid_of(state, i) for i in getattr(fewer, queue)]
    assert lines == [f"request {rid!r}: live in the log, gone in replay",
                     f"queue {name}: expected {e_ids}, got {a_ids}"]
    assert diff_state(fewer, state) == [f"request {rid!r}: live in replay, not in the log",
                                        f"queue {name}: expected {a_ids}, got {e_ids}"]


def test_diff_state_names_a_reordered_queue(state: CoreSnapshot) -> None:
    running = list(reversed(state.running))
    changed = msgspec.structs.replace(state, running=running)
    assert diff_state(state, changed) == [
        f"queue running: expected {[rid_of(state, i) for i in state.running]}, "
        f"got {[rid_of(state, i) for i in running]}"]
    preempted = list(reversed(state.preempted))
    assert diff_state(state, msgspec.structs.replace(state, preempted=preempted)) == [
        f"queue preempted: expected {[rid_of(state, i) for i in state.preempted]}, "
        f"got {[rid_of(state, i) for i in preempted]}"]


def test_diff_state_names_the_blocks(state: CoreSnapshot) -> None:
    pool = state.pool
    # one block freed on the replayed side only, its refcount dropped
    used = next(b for b, r in enumerate(pool.ref) if r == 1)
    ref = list(pool.ref)
    ref[used] = 0
    changed = msgspec.structs.replace(state, pool=msgspec.structs.replace(pool, free=[*pool.free, used], ref=ref))
    assert diff_state(state, changed) == [
        f"blocks: free {len(pool.free)} vs {len(pool.free) + 1}, cached {len(pool.cached)} vs {len(pool.cached)}; "
        f"refcounts differ for blocks {[used]}",
        f"blocks free in one side only: {[used]}"]
    # only the cached list differs
    cached = msgspec.structs.replace(state, pool=msgspec.structs.replace(pool, cached=[*pool.cached, 999]))
    assert diff_state(state, cached) == [
        f"blocks: free {len(pool.free)} vs {len(pool.free)}, cached {len(pool.cached)} vs {len(pool.cached) + 1}; "
        "refcounts differ for blocks []"]
    # only refcounts differ, more of them than are listed
    many = [r + 1 for r in pool.ref]
    assert len(many) > MAX_ITEMS
    lines = diff_state(state, msgspec.structs.replace(state, pool=msgspec.structs.replace(pool, ref=many)))
    assert lines == [f"blocks: free {len(pool.free)} vs {len(pool.free)}, cached {len(pool.cached)} vs "
                     f"{len(pool.cached)}; refcounts differ for blocks {list(range(MAX_ITEMS))} ..."]
    exactly = [r + 1 if b < MAX_ITEMS else r for b, r in enumerate(pool.ref)]
    lines = diff_state(state, msgspec.structs.replace(state, pool=msgspec.structs.replace(pool, ref=exactly)))
    assert lines[0].endswith(f"refcounts differ for blocks {list(range(MAX_ITEMS))}")
    shorter = msgspec.structs.replace(state, pool=msgspec.structs.replace(pool, ref=pool.ref[:-1]))
    assert diff_state(state, shorter) == [
        f"blocks: free {len(pool.free)} vs {len(pool.free)}, cached {len(pool.cached)} vs {len(pool.cached)}; "
        "refcounts differ for blocks []"]


def test_diff_state_names_the_steps_in_flight(state: CoreSnapshot) -> None:
    ids = [s.step_id for s in state.steps]
    changed = msgspec.structs.replace(state, steps=state.steps[:1])
    assert diff_state(state, changed) == [f"steps in flight: expected {ids}, got {ids[:1]}"]


def test_seq_view_of_a_non_attrs_value_is_empty() -> None:
    assert diff._seq_view(object()) == {}
    assert diff._seq_view(3) == {}
