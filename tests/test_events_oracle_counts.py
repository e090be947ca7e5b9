"""The oracle devices' speculative counts (``events.oracle``): how many proposal slots their proposer fills and how
many of those it gets right. The stub device, the stub executor and the replay oracle all report these, so the core's
adaptive k meets every case a real proposer produces: all right, some right, all wrong, and nothing proposed."""

from __future__ import annotations

import pytest

from tickloom.events.oracle import oracle_accept_count, oracle_fill_count

CASES = [(seed, index, slots) for seed in range(12) for index in range(40) for slots in (1, 2, 4, 8)]


@pytest.mark.parametrize("slots", [1, 2, 4, 8])
def test_a_row_fills_at_least_what_it_accepts_and_at_most_its_slots(slots: int) -> None:
    for seed in range(12):
        for index in range(40):
            accepted = oracle_accept_count(seed, index, slots)
            assert 0 <= accepted <= oracle_fill_count(seed, index, slots) <= slots


def test_the_counts_are_pure_functions_of_seed_index_and_slots() -> None:
    assert [oracle_fill_count(*c) for c in CASES] == [oracle_fill_count(*c) for c in CASES]


def test_every_case_occurs_nothing_filled_included() -> None:
    kinds = set()
    for seed, index, slots in CASES:
        accepted, filled = oracle_accept_count(seed, index, slots), oracle_fill_count(seed, index, slots)
        kinds.add("none filled" if filled == 0 else "all right" if accepted == slots
                  else "all wrong" if accepted == 0 else "some right")
    assert kinds == {"none filled", "all right", "all wrong", "some right"}
