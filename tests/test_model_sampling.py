"""Unit tests of the counter-based sampler."""

from __future__ import annotations

import math
from collections import Counter

import torch
from model_fixtures import Spec

from tickloom.engine.model.sampling import Sampler, SampleRow, apply_penalties, gumbel_noise, row_key, token_hashes
from tickloom.events import SamplingSpec

torch.set_num_threads(1)
CPU = torch.device("cpu")
V = 64


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    p = torch.tensor(probs + [1e-6] * (V - len(probs)), dtype=torch.float32)
    return (p / p.sum()).log().unsqueeze(0)


def draw(logits: torch.Tensor, spec: SamplingSpec, seeds: range, output_index: int = 0) -> Counter[int]:
    s = Sampler(V, CPU)
    rows = [SampleRow(spec, seed, output_index) for seed in seeds]
    out = s.sample(logits.expand(len(rows), -1).contiguous(), rows)
    return Counter(out.token_ids)


def test_greedy_is_argmax() -> None:
    lg = torch.randn(5, V)
    out = Sampler(V, CPU).sample(lg, [SampleRow(Spec(), i, 0) for i in range(5)])
    assert out.token_ids == lg.argmax(-1).tolist()
    assert out.logprobs is None


def test_noise_is_pure_and_batch_independent() -> None:
    vh = token_hashes(V, CPU)
    keys = torch.tensor([row_key(s, i) for s, i in [(1, 0), (1, 1), (2, 0), (2**63 + 5, 7)]])
    batch = gumbel_noise(keys, vh)
    for j in range(4):
        assert torch.equal(gumbel_noise(keys[j : j + 1], vh)[0], batch[j])
    assert row_key(1, 0) == row_key(1, 0) != row_key(1, 1)
    assert not torch.equal(batch[0], batch[1])


def test_temperature_sampling_follows_distribution() -> None:
    probs = [0.5, 0.3, 0.2]
    c = draw(logits_from_probs(probs), Spec(temperature=1.0), range(4000))
    for tok, p in enumerate(probs):
        assert abs(c[tok] / 4000 - p) < 0.04
    assert sum(c[t] for t in range(3)) >= 3990


def test_top_k() -> None:
    lg = torch.linspace(0, 1, V).unsqueeze(0)  # nearly flat; top 3 are the last ids
    c = draw(lg, Spec(temperature=1.0, top_k=3), range(600))
    assert set(c) == {V - 1, V - 2, V - 3}
    assert set(draw(lg, Spec(temperature=1.0, top_k=1), range(50))) == {V - 1}


def test_top_p() -> None:
    lg = logits_from_probs([0.6, 0.3, 0.1])
    assert set(draw(lg, Spec(temperature=1.0, top_p=0.5), range(300))) == {0}
    assert set(draw(lg, Spec(temperature=1.0, top_p=0.8), range(300))) == {0, 1}
    assert set(draw(lg, Spec(temperature=1.0, top_p=0.95), range(600))) == {0, 1, 2}


def test_min_p() -> None:
    lg = logits_from_probs([0.5, 0.3, 0.2])
    # floor 0.5 * 0.5 = 0.25 keeps tokens 0 and 1 only
    assert set(draw(lg, Spec(temperature=1.0, min_p=0.5), range(400))) == {0, 1}


def test_penalties() -> None:
    lg = torch.tensor([[2.0, -2.0, 1.0, 1.0, 0.5]])
    spec = Spec(repetition_penalty=2.0)
    out = apply_penalties(lg, [SampleRow(spec, 0, 0, prompt_tokens=[0], output_tokens=[1])])
    assert out.tolist() == [[1.0, -4.0, 1.0, 1.0, 0.5]]
    spec = Spec(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(lg, [SampleRow(spec, 0, 0, prompt_tokens=[4], output_tokens=[2, 2, 3])])
    assert out.tolist() == [[2.0, -2.0, 1.0 - 0.5 - 0.5, 1.0 - 0.5 - 0.25, 0.5]]
    assert apply_penalties(lg, [SampleRow(Spec(), 0, 0, output_tokens=[0])]) is lg


def test_repetition_penalty_changes_greedy_choice() -> None:
    lg = torch.zeros(1, V)
    lg[0, 5], lg[0, 6] = 3.0, 2.0
    s = Sampler(V, CPU)
    out = s.sample(lg, [SampleRow(Spec(repetition_penalty=2.0), 0, 1, prompt_tokens=[1], output_tokens=[5])])
    assert out.token_ids == [6]


def test_min_tokens_mask() -> None:
    lg = torch.zeros(2, V)
    lg[:, 2] = 10.0  # the "eos"
    s = Sampler(V, CPU)
    spec = Spec(min_tokens=3)
    out = s.sample(lg, [SampleRow(spec, 0, 2, masked_token_ids=[2]), SampleRow(spec, 0, 3, masked_token_ids=[2])])
    assert out.token_ids[0] != 2
    assert out.token_ids[1] == 2
    # also under temperature sampling
    c = draw(lg[:1], Spec(temperature=1.0, min_tokens=1), range(50))
    assert c[2] == 50
    rows = [SampleRow(Spec(temperature=1.0, min_tokens=1), i, 0, masked_token_ids=[2]) for i in range(50)]
    assert 2 not in s.sample(lg[:1].expand(50, -1).contiguous(), rows).token_ids


def test_logprobs_and_top_logprobs() -> None:
    lg = torch.randn(3, V)
    s = Sampler(V, CPU)
    rows = [
        SampleRow(Spec(logprobs=True, top_logprobs=4), 0, 0),
        SampleRow(Spec(temperature=0.7, logprobs=True), 1, 0),
        SampleRow(Spec(top_logprobs=2), 2, 0),
    ]
    out = s.sample(lg, rows)
    lp = torch.log_softmax(lg, -1)
    assert out.logprobs is not None and out.top_token_ids is not None and out.top_logprobs is not None
    for i, t in enumerate(out.token_ids):
        assert math.isclose(out.logprobs[i], float(lp[i, t]), abs_tol=1e-6)
    assert [len(x) for x in out.top_token_ids] == [4, 0, 2]
    assert out.top_token_ids[0] == lp[0].topk(4).indices.tolist()
    assert out.top_logprobs[0] == sorted(out.top_logprobs[0], reverse=True)
    assert out.top_token_ids[0][0] == out.token_ids[0]  # greedy picks the top token


def test_mixed_greedy_and_random_rows() -> None:
    lg = torch.randn(4, V)
    s = Sampler(V, CPU)
    rows = [SampleRow(Spec(temperature=t), 9, 0) for t in (0.0, 1.0, 0.0, 1.0)]
    out = s.sample(lg, rows)
    assert out.token_ids[0] == int(lg[0].argmax()) and out.token_ids[2] == int(lg[2].argmax())
    alone = s.sample(lg[1:2], rows[1:2]).token_ids
    assert alone == out.token_ids[1:2]
