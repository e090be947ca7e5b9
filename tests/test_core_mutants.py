"""Rules pinned at their edges, found by mutation testing (``scripts/mutate.sh``): each test asserts one rule of
DESIGN.md / SCENARIOS.md through the commands the core emits and its snapshot, at the boundary where a
slightly wrong rule (an off-by-one, a dropped term, a flipped condition) behaves differently.
"""

from __future__ import annotations

import pytest
from core_harness import arrival
from core_state import add_seq, hold_blocks, make_core

from engine.core import SchedulerCore
from engine.core.lifecycle import cache_full_blocks
from engine.core.snapshot import CoreSnapshot
from engine.core.state import Seq, Status
from events import (
    BindRequest,
    Command,
    Input,
    RunStep,
    TickInputs,
    TickOutputs,
)


def _tick(core: SchedulerCore, *inputs: Input) -> TickOutputs:
    out = core.tick(TickInputs(core.state.tick + 1, core.state.now_ns, list(inputs)))
    core.check_invariants()
    return out


def _of(out: TickOutputs, kind: type) -> list[Command]:
    return [c for c in out.commands if isinstance(c, kind)]


def _bound(out: TickOutputs) -> list[str]:
    return [c.request_id for c in _of(out, BindRequest)]


def _snap_seq(snap: CoreSnapshot, request_id: str) -> Seq:
    return next(seq for seq in snap.seqs[: snap.live] if seq.request_id == request_id)


def _waiting_ids(snap: CoreSnapshot) -> list[str]:
    return [snap.seqs[i].request_id for i in snap.waiting]


# -- C03: in-flight demand ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("head_prompt", "admitted"), [(100, True), (112, False)])
def test_c03_demand_counts_only_the_unallocated_part_of_a_reservation(head_prompt: int, admitted: bool) -> None:
    core = make_core(num_blocks=20, block_size=16, max_seq_len=128)
    state = core.state
    holder = add_seq(state, "holder", 40, outputs=1)
    hold_blocks(state, holder, 10)
    holder.reserve = 13  # admitted with a watermark: 3 of its 13 blocks are still promised to it
    state.reserving.append(holder)
    # 10 free - 3 promised = 7: blocks(100) = 7 fits, blocks(112) = 8 does not.
    out = _tick(core, arrival("head", head_prompt, 4))
    assert (_bound(out) == ["head"]) is admitted
    assert _waiting_ids(core.snapshot()) == ([] if admitted else ["head"])


@pytest.mark.parametrize(("free", "admitted"), [(11, True), (10, False)])
def test_c03_a_parked_sequence_counts_its_need_plus_one(free: int, admitted: bool) -> None:
    core = make_core(num_blocks=20, block_size=16, max_seq_len=128)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 100, outputs=1), 20 - free)
    add_seq(state, "parked", 20, outputs=13, status=Status.PREEMPTED)  # a 32-token history: 3 blocks, wants 4
    out = _tick(core, arrival("head", 100, 8))  # blocks(100) = 7
    assert (_bound(out) == ["head"]) is admitted, f"{free} free - 4 promised against 7"


@pytest.mark.parametrize(("head_prompt", "admitted"), [(150, True), (160, False)])
def test_c03_demand_adds_up_reservations_and_every_parked_sequence(head_prompt: int, admitted: bool) -> None:
    core = make_core(num_blocks=24, block_size=16, max_seq_len=192)
    state = core.state
    holder = add_seq(state, "holder", 40, outputs=1)
    hold_blocks(state, holder, 6)
    holder.reserve = 8  # 2 promised
    state.reserving.append(holder)
    add_seq(state, "p1", 20, outputs=13, status=Status.PREEMPTED)  # a 32-token history: 3 blocks, wants 4
    add_seq(state, "p2", 10, outputs=6, status=Status.PREEMPTED)  # a 15-token history: 1 block, wants 2
    # 18 free - (2 + 4 + 2) promised = 10: blocks(150) = 10 fits, blocks(160) = 11 does not.
    out = _tick(core, arrival("head", head_prompt, 4))
    assert (_bound(out) == ["head"]) is admitted


# -- C03 / C18: the prefix hits the gate discounts --------------------------------------------------------------


def _sharing_core(free: int) -> tuple[SchedulerCore, list[int]]:
    """``a`` runs a 64-token prompt whose 4 full blocks are registered in the cache; ``free`` blocks are free."""
    core = make_core(num_blocks=20, block_size=16, max_seq_len=128)
    state = core.state
    a = add_seq(state, "a", 64, outputs=1)
    hold_blocks(state, a, 5)
    assert len(cache_full_blocks(state, a, 64)) == 4
    hold_blocks(state, add_seq(state, "filler", 10, outputs=1), 15 - free)
    return core, list(a.prompt)


@pytest.mark.parametrize(("free", "admitted"), [(2, True), (1, False)])
def test_c03_c18_the_gate_discounts_hits_but_never_the_last_prompt_token(free: int, admitted: bool) -> None:
    # The same 64-token prompt: blocks(64) = 5. Its 4th full block holds the last prompt token, which is always
    # recomputed, so only 3 blocks hit (in use by ``a``, nothing to reclaim): the head needs 2 free blocks.
    core, prompt = _sharing_core(free)
    out = _tick(core, arrival("head", prompt, 4))
    assert (_bound(out) == ["head"]) is admitted
    if admitted:
        [step] = _of(out, RunStep)
        i = step.request_ids.index("head")
        assert step.positions[i] == 48 and step.num_tokens[i] == 16, "it computes from its 4th block on"
