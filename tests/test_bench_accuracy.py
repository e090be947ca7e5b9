"""The accuracy bench's metrics (tools/bench/accuracy.py), and its drivers on a tiny random model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tickloom.engine.model.loaders import load_model
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.tools.bench.accuracy import mean_kl, score, tickloom_greedy, tickloom_logits, tokens_kept, top1_agreement


def test_identical_logits_agree_fully_with_zero_kl() -> None:
    logits = torch.randn(48, 100, generator=torch.Generator().manual_seed(0))
    assert top1_agreement(logits, logits.clone()) == 1.0
    assert mean_kl(logits, logits.clone()) == pytest.approx(0.0, abs=1e-12)


def test_agreement_counts_positions_whose_argmax_differs() -> None:
    ref = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    other = ref.clone()
    other[1] = torch.tensor([0.0, 1.0, 4.0])  # argmax moves from 1 to 2
    assert top1_agreement(ref, other) == 0.75


def test_kl_of_two_known_distributions() -> None:
    p, q = [0.5, 0.5], [0.25, 0.75]
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    ref, other = torch.tensor([p]).log(), torch.tensor([q]).log()
    assert mean_kl(ref, other) == pytest.approx(expected, rel=1e-6)
    # KL(ref || path), not the reverse: the other direction has a different value
    reverse = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert mean_kl(other, ref) == pytest.approx(reverse, rel=1e-6)
    # the mean over positions: a second, identical position halves it
    assert mean_kl(torch.cat([ref, ref]), torch.cat([other, ref])) == pytest.approx(expected / 2, rel=1e-6)


def test_tokens_kept_stops_at_the_first_difference() -> None:
    assert tokens_kept([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert tokens_kept([1, 2, 3, 4], [1, 2, 9, 4]) == 2  # the later match does not count
    assert tokens_kept([1, 2, 3, 4], [7, 2, 3, 4]) == 0


def test_score_averages_kept_over_prompts() -> None:
    ref = [torch.eye(3), torch.eye(3)]
    s = score(ref, [[1, 2, 3], [1, 2, 3]], ref, [[1, 2, 3], [1, 0, 3]])
    assert s["top1"] == 1.0 and s["positions"] == 6
    assert s["kept"] == 2.0


def test_teacher_forced_logits_match_greedy_decoding(tmp_path: Path) -> None:
    """The all-position forward and the step-by-step greedy driver see the same model: forcing the greedy tokens
    gives logits whose argmax at each continuation position is the next greedy token."""
    lm = load_model(write_tiny_model(tmp_path / "tiny", "tiny-bench", seed=0), dtype="float32")
    prompt = [5, 9, 14, 3, 22, 7]
    cont = tickloom_greedy(lm, prompt, 20)
    full = tickloom_logits(lm)(prompt + cont)
    assert full.shape[0] == len(prompt) + len(cont)
    assert full[len(prompt) - 1 : -1].argmax(-1).tolist() == cont
