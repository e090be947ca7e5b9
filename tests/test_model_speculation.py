"""Speculation in the executor: proposals are verified position by position, and never change a token.

``ModelExecutor`` is driven by hand on a tiny random float64 model. A proposer that knows the answer (the tokens plain
decoding produced) must have every proposal accepted, whatever the temperature, penalties and ``min_tokens``: that
fails if any proposed position is sampled with the wrong output index, the wrong penalty history or the wrong KV.
One that errs at a chosen position must have exactly the proposals before it accepted, and the token sampled there
must be plain decoding's. The prompt lookup proposer's rules are tested on their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from model_fixtures import Driver, Spec, make_executor, prompts

from tickloom.engine.model.draft import DraftProposer
from tickloom.engine.model.executor import ModelExecutor
from tickloom.engine.model.speculate import PromptLookup, accepted, make_proposer
from tickloom.engine.model.tables import step_of
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.events import PROPOSE, SamplingSpec
from tickloom.events.commands import BindRequest

torch.set_num_threads(1)
BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=11, dtype="float64", vocab_size=320)


class AnswerKey:
    """Proposes the plain run's next tokens, wrong from output ``wrong_at`` on (a fixed wrong token)."""

    name = "answer-key"

    def __init__(self, answer: list[int], prompt_len: int, wrong_at: int | None = None) -> None:
        self.answer, self.prompt_len, self.wrong_at = answer, prompt_len, wrong_at
        self.asked: list[tuple[int, int]] = []

    def propose(self, request_id: str, tokens: Sequence[int], most: int) -> list[int]:
        start = len(tokens) - self.prompt_len  # the output index the first proposal stands for
        self.asked.append((start, most))
        out = list(self.answer[start : start + most])
        if self.wrong_at is not None:
            out = [t if start + j < self.wrong_at else (t + 1) % 300 for j, t in enumerate(out)]
        return out

    def release(self, request_id: str) -> None:
        pass


def plain(model: Path, prompt: list[int], spec: SamplingSpec, n: int) -> list[int]:
    drv = Driver(make_executor(model, dtype="float64", num_blocks=64, block_size=BLOCK), seed=3)
    drv.add("x", prompt, spec, 42)
    return drv.generate(["x"], n)["x"]


def speculate(ex: ModelExecutor, prompt: list[int], spec: SamplingSpec, n: int, k: int,
              filled: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Prefill, then rows of one input and ``k`` proposal slots until ``n`` outputs; (outputs, accepted per row).
    ``filled`` gets each decode row's ``StepResult.proposed`` entry (-1 for a step that reports none)."""
    ex.bind(BindRequest("x", spec, 42, len(prompt), []))
    table: list[int] = []
    free = list(range(ex.num_blocks))

    def run(position: int, tokens: list[int], index: int) -> tuple[int, list[int]]:
        need = -(-(position + len(tokens)) // BLOCK) - len(table)
        new = [free.pop(0) for _ in range(max(need, 0))]
        start = len(table)
        table.extend(new)
        res = ex.run_step(step_of(["x"], [position], [len(tokens)], tokens, [index], [start], [len(new)], new))
        if filled is not None and index > 0:
            filled.append(-1 if res.proposed is None else res.proposed[0])
        return res.token_ids[0], (res.extra_token_ids or [[]])[0]

    token, _ = run(0, prompt, 0)
    out, rows = [token], []
    while len(out) < n:
        slots = min(k, n - len(out) - 1)
        token, extras = run(len(prompt) + len(out) - 1, [out[-1]] + [PROPOSE] * slots, len(out))
        assert len(extras) <= slots
        out += [token, *extras]
        rows.append(len(extras))
    return out, rows


SPECS = [Spec(), Spec(temperature=1.0), Spec(temperature=0.9, top_p=0.9, repetition_penalty=1.3),
         Spec(temperature=0.8, frequency_penalty=0.8, presence_penalty=0.5, min_tokens=12)]


@pytest.mark.parametrize("spec", SPECS, ids=["greedy", "t1", "top_p+repetition", "penalties+min_tokens"])
def test_a_proposer_that_knows_the_answer_has_every_proposal_accepted(tiny: Path, spec: SamplingSpec) -> None:
    prompt = prompts(1, 9, vocab=300, seed=5)[0]
    want = plain(tiny, prompt, spec, 20)
    ex = make_executor(tiny, dtype="float64", num_blocks=64, block_size=BLOCK)
    ex.proposer = AnswerKey(want, len(prompt))
    filled: list[int] = []
    got, rows = speculate(ex, prompt, spec, 20, k=3, filled=filled)
    assert got == want
    assert rows == [min(3, 20 - 2 - 4 * i) for i in range(len(rows))]  # every slot accepted, every row
    assert filled == [n if n else -1 for n in rows]  # each row reports its slots filled; a row without slots, none


@pytest.mark.parametrize("wrong_at", [2, 3, 7])
def test_proposals_stand_until_the_first_wrong_one_and_its_position_samples_the_plain_token(
        tiny: Path, wrong_at: int) -> None:
    spec = Spec(temperature=1.0)
    prompt = prompts(1, 7, vocab=300, seed=8)[0]
    want = plain(tiny, prompt, spec, 14)
    ex = make_executor(tiny, dtype="float64", num_blocks=64, block_size=BLOCK)
    key = AnswerKey(want, len(prompt), wrong_at=wrong_at)
    ex.proposer = key
    got, rows = speculate(ex, prompt, spec, 14, k=4)
    assert got == want
    # The row whose proposals reach output ``wrong_at`` accepts exactly those before it.
    for (start, most), n in zip(key.asked, rows, strict=False):  # a last row without slots asks nothing
        if start <= wrong_at < start + most:
            assert n == wrong_at - start


def test_without_a_proposer_slots_stay_empty_and_the_row_decodes_plainly(tiny: Path) -> None:
    spec = Spec(temperature=1.0)
    prompt = prompts(1, 6, vocab=300, seed=1)[0]
    ex = make_executor(tiny, dtype="float64", num_blocks=64, block_size=BLOCK)
    filled: list[int] = []
    got, rows = speculate(ex, prompt, spec, 10, k=3, filled=filled)
    assert got == plain(tiny, prompt, spec, 10) and not any(rows)
    # every row with slots reports that none was filled (the core then keeps its k); the last row has no slots
    assert filled == [0] * (len(rows) - 1) + [-1]


def test_a_draft_that_is_the_target_itself_proposes_what_greedy_decoding_samples(tiny: Path) -> None:
    """The draft runs the request's unseen tokens as one chunk, then one token at a time; with the target's own
    weights its greedy proposals are the target's greedy tokens, so nearly every slot is accepted."""
    prompt = prompts(1, 9, vocab=300, seed=5)[0]
    want = plain(tiny, prompt, Spec(), 24)
    ex = make_executor(tiny, dtype="float64", num_blocks=64, block_size=BLOCK)
    ex.proposer = DraftProposer(make_executor(tiny, dtype="float64", num_blocks=1).model, 32, BLOCK)
    got, rows = speculate(ex, prompt, Spec(), 24, k=3)
    assert got == want
    assert sum(rows) >= 0.8 * sum(min(3, 24 - 2 - 4 * i) for i in range(len(rows)))


def test_a_draft_keeps_the_kv_of_the_common_prefix_and_recomputes_the_rest(tiny: Path) -> None:
    draft = DraftProposer(make_executor(tiny, dtype="float64", num_blocks=1).model, 16, BLOCK)
    tokens = prompts(1, 10, vocab=300, seed=3)[0]
    first = draft.propose("r", tokens, 3)
    assert len(first) == 3 and draft._drafts["r"].tokens == tokens + first[:2]
    changed = [*tokens[:6], 7, 8]  # the history after position 5 was rewritten
    again = draft.propose("r", changed, 2)
    fresh = DraftProposer(make_executor(tiny, dtype="float64", num_blocks=1).model, 16, BLOCK)
    assert again == fresh.propose("r", changed, 2), "stale KV after the common prefix was used"


def test_a_draft_whose_pool_is_full_proposes_nothing_and_release_frees_it(tiny: Path) -> None:
    draft = DraftProposer(make_executor(tiny, dtype="float64", num_blocks=1).model, 4, BLOCK)
    assert len(draft.propose("a", list(range(3, 15)), 3)) == 3  # 14 positions: all 4 blocks
    assert draft.propose("b", [5, 6, 7], 2) == []
    draft.release("a")
    assert len(draft.propose("b", [5, 6, 7], 2)) == 2


def _counting(draft: DraftProposer) -> list[int]:
    """Records how many tokens each of the draft's forward passes runs."""
    ran: list[int] = []
    forward = draft._forward

    def counted(d: object, start: int, tokens: list[int]) -> torch.Tensor:
        ran.append(len(tokens))
        return forward(d, start, tokens)  # type: ignore[arg-type]

    draft._forward = counted  # type: ignore[method-assign]
    return ran


def test_a_new_request_starts_from_a_copy_of_a_released_ones_kv_for_their_common_blocks(tiny: Path) -> None:
    draft = DraftProposer(make_executor(tiny, dtype="float64", num_blocks=1).model, 16, BLOCK)
    shared = prompts(1, 10, vocab=300, seed=4)[0]
    draft.propose("a", [*shared, 5, 6], 2)
    draft.release("a")
    ran = _counting(draft)
    got = draft.propose("b", [*shared, 7, 8, 9], 2)
    assert ran[0] == 5  # the 10 shared tokens' two whole blocks (8 tokens) copied; the rest run
    fresh = DraftProposer(make_executor(tiny, dtype="float64", num_blocks=1).model, 16, BLOCK)
    assert got == fresh.propose("b", [*shared, 7, 8, 9], 2), "the copied KV differs from a fresh run's"


def test_a_request_sharing_part_of_a_released_prompt_leaves_the_rest_for_a_later_one(tiny: Path) -> None:
    draft = DraftProposer(make_executor(tiny, dtype="float64", num_blocks=1).model, 16, BLOCK)
    system, first, second = [3, 4, 5, 6], list(range(20, 32)), list(range(40, 52))
    draft.propose("a", [*system, *first], 1)
    draft.release("a")
    draft.propose("b", [*system, *second], 1)  # shares the first block only
    draft.release("b")
    ran = _counting(draft)
    draft.propose("c", [*system, *first, 60], 1)  # a's prompt again, one token further
    assert ran[0] == 1


def test_a_released_draft_sharing_less_than_a_block_is_not_taken_over(tiny: Path) -> None:
    draft = DraftProposer(make_executor(tiny, dtype="float64", num_blocks=1).model, 16, BLOCK)
    draft.propose("a", [1, 2, 3, 9, 9, 9], 1)
    draft.release("a")
    ran = _counting(draft)
    draft.propose("b", [1, 2, 3, 4, 5, 6], 1)  # 3 tokens shared: under a block of 4
    assert ran[0] == 6 and len(draft._released) == 1


def test_released_drafts_give_their_blocks_back_oldest_first_when_the_pool_needs_them(tiny: Path) -> None:
    draft = DraftProposer(make_executor(tiny, dtype="float64", num_blocks=1).model, 4, BLOCK)
    draft.propose("a", [10, 11, 12, 13], 1)  # 4 positions: 1 block
    draft.propose("b", [20, 21, 22, 23], 1)
    draft.release("a")
    draft.release("b")
    assert len(draft.propose("c", [30, 31, 32, 33, 34, 35], 3)) == 3  # 8 positions: 2 blocks, 2 free
    assert [d.tokens[0] for d in draft._released] == [10, 20]
    assert len(draft.propose("d", [40, 41, 42, 43], 1)) == 1  # needs 1 more: the oldest, a's, goes
    assert [d.tokens[0] for d in draft._released] == [20]


def test_at_most_max_released_drafts_are_kept(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tickloom.engine.model.draft.MAX_RELEASED", 2)
    draft = DraftProposer(make_executor(tiny, dtype="float64", num_blocks=1).model, 8, BLOCK)
    for n, rid in enumerate("abc"):
        draft.propose(rid, [10 * n + 3, 10 * n + 4, 10 * n + 5, 10 * n + 6], 1)
        draft.release(rid)
    assert [d.tokens[0] for d in draft._released] == [13, 23]  # a's blocks went back to the free list
    assert len(draft._free) == 8 - 2


def test_accepted_counts_the_proposals_that_equal_the_token_sampled_before_them() -> None:
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted([5], [4, 5]) == 0
    assert accepted([], [4]) == 0


def test_prompt_lookup_proposes_what_followed_the_last_tokens_latest_earlier_occurrence() -> None:
    p = PromptLookup(max_n=3, min_n=2)
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 0, 2, 3]
    assert p.propose("r", tokens, 2) == [5, 6]  # "2 3" occurred twice: the latest, at 6..7, was followed by 5 6


def test_prompt_lookup_prefers_the_longest_matching_n_gram() -> None:
    p = PromptLookup(max_n=3, min_n=2)
    tokens = [7, 2, 3, 4, 1, 2, 3, 8, 7, 2, 3]  # "2 3" latest before 8; "7 2 3" before 4
    assert p.propose("r", tokens, 1) == [4]


def test_prompt_lookup_proposes_nothing_without_a_match_and_at_most_most() -> None:
    p = PromptLookup()
    assert p.propose("r", [1, 2, 3, 4, 5], 3) == []
    assert p.propose("s", [1, 2, 3, 4, 1, 2], 1) == [3]
    assert p.propose("s", [1, 2, 3, 4, 1, 2], 0) == []


def test_prompt_lookup_after_a_one_token_match_proposes_short_most_tokens() -> None:
    tokens = [4, 7, 8, 9, 6, 5, 4]  # only "4" recurs: it was followed by 7 8 9
    assert PromptLookup().propose("r", tokens, 3) == [7]
    assert PromptLookup(short_most=2).propose("r", tokens, 3) == [7, 8]
    assert PromptLookup(short_most=0).propose("r", tokens, 3) == []
    assert PromptLookup(min_n=2).propose("r", tokens, 3) == []  # one-token matches off
    assert PromptLookup().propose("s", [4, 7, 8, 9, 6, 4, 7], 3) == [8, 9, 6]  # a longer match: up to most


def test_prompt_lookup_refuses_settings_that_name_no_match() -> None:
    with pytest.raises(ValueError, match="min_n"):
        PromptLookup(max_n=2, min_n=3)
    with pytest.raises(ValueError, match="short_most"):
        PromptLookup(short_most=-1)


def test_prompt_lookup_indexes_again_when_a_requests_tokens_change_behind_it() -> None:
    p = PromptLookup()
    assert p.propose("r", [1, 2, 3, 4, 1, 2], 2) == [3, 4]
    # The history was rewritten (a requeue re-prefilled another continuation): no stale n-gram may answer.
    assert p.propose("r", [1, 2, 5, 6, 1, 2], 2) == [5, 6]


def test_make_proposer_names_the_unknown_one() -> None:
    assert make_proposer("prompt_lookup").name == "prompt_lookup"
    with pytest.raises(ValueError, match="needs a draft model"):
        make_proposer("draft")
    with pytest.raises(ValueError, match="'medusa'"):
        make_proposer("medusa")
