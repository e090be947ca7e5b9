"""The accuracy bench's metrics (tools/bench/accuracy.py), and its drivers on a tiny random model."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tickloom.engine.model.loaders import load_model
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.tools.bench.accuracy import (
    F32_ACT,
    PROMPTS,
    PathTally,
    agrees,
    chat_prompts,
    exact_activations,
    kl_per_position,
    measure,
    paired_difference,
    print_table,
    tickloom_greedy,
    tickloom_greedy_batch,
    tickloom_logits,
    tokens_kept,
)


def top1_agreement(ref: torch.Tensor, other: torch.Tensor) -> float:
    """The share of positions ``agrees`` marks (what a path's top-1 figure is)."""
    return float(agrees(ref, other).float().mean())


def mean_kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    """The mean of ``kl_per_position`` (what a path's KL figure is)."""
    return float(kl_per_position(ref, other).mean())


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


def test_a_path_tally_averages_positions_across_prompts_and_kept_over_prompts() -> None:
    t = PathTally()
    t.add(torch.eye(3), torch.eye(3))
    other = torch.eye(3)
    other[0] = torch.tensor([0.0, 2.0, 0.0])  # one of the second prompt's three positions moves
    t.add(torch.eye(3), other)
    t.kept += [3, 1]
    r = t.result()
    assert r["positions"] == 6 and r["top1"] == pytest.approx(5 / 6)
    assert r["kl"] == pytest.approx(mean_kl(torch.cat([torch.eye(3)] * 2), torch.cat([torch.eye(3), other])))
    assert (r["kept"], r["kept_prompts"]) == (2.0, 2)


def test_teacher_forced_logits_match_greedy_decoding(tmp_path: Path) -> None:
    """The all-position forward and the step-by-step greedy driver see the same model: forcing the greedy tokens
    gives logits whose argmax at each continuation position is the next greedy token."""
    lm = load_model(write_tiny_model(tmp_path / "tiny", "tiny-bench", seed=0), dtype="float32")
    prompt = [5, 9, 14, 3, 22, 7]
    cont = tickloom_greedy(lm, prompt, 20)
    full = tickloom_logits(lm)(prompt + cont)
    assert full.shape[0] == len(prompt) + len(cont)
    assert full[len(prompt) - 1 : -1].argmax(-1).tolist() == cont


def test_chat_prompts_start_with_the_hand_written_ones_and_are_all_different() -> None:
    every = chat_prompts(320)
    assert every[: len(PROMPTS)] == PROMPTS
    assert len(set(every)) == 320
    assert chat_prompts(25) == every[:25]  # a prefix, so a smaller run measures a subset of a larger one
    # the first generated prompts mix templates and topics rather than running through one template
    made = every[len(PROMPTS) : len(PROMPTS) + 10]
    assert len({m.split()[0] for m in made}) > 3 and len({m.split()[-1] for m in made}) == 10
    for bad in (0, 321):
        with pytest.raises(ValueError, match=f"{bad} asked, 1 to 320"):
            chat_prompts(bad)


def test_paired_difference_counts_only_positions_where_the_paths_differ() -> None:
    a = np.array([True] * 90 + [False] * 10)
    b = np.array([True] * 88 + [False] * 12)
    diff, half = paired_difference(a, b)
    assert diff == pytest.approx(0.02)
    d = np.array([0.0] * 88 + [1.0] * 2 + [0.0] * 10)
    assert half == pytest.approx(1.96 * np.sqrt(d.var(ddof=1) / 100))
    # four times the positions halve the interval
    _, quarter = paired_difference(np.tile(a, 4), np.tile(b, 4))
    assert quarter == pytest.approx(half / 2, rel=0.02)
    # the same positions flipped both ways: no difference, but an interval that says the measure moves
    diff, spread = paired_difference(np.array([True, False] * 50), np.array([False, True] * 50))
    assert diff == 0.0 and spread > 0.15
    # paths that agree everywhere: the difference is known exactly
    assert paired_difference(a, a.copy()) == (0.0, 0.0)


def test_batched_greedy_is_each_prompts_own_greedy(tmp_path: Path) -> None:
    """Prompts of different lengths decoding side by side, across more than one batch of rows, give the tokens each
    gives alone."""
    lm = load_model(write_tiny_model(tmp_path / "tiny", "tiny-bench", seed=0), dtype="float32")
    prompts = [[5, 9, 14], [3, 22, 7, 8, 1, 30, 2], [11], [40, 41, 42, 43, 44]]
    together = tickloom_greedy_batch(lm, prompts, 6, rows=3)
    assert together == [tickloom_greedy(lm, p, 6) for p in prompts]


def test_measure_scores_every_position_and_keeps_greedy_to_the_first_prompts(tmp_path: Path) -> None:
    model = str(write_tiny_model(tmp_path / "tiny", "tiny-bench", seed=0))
    result = measure(model, new_tokens=4, prompts=chat_prompts(3), kept_prompts=2)
    assert result["prompts"] == 3 and result["new_tokens"] == 4
    rows = result["paths"]
    ref = rows["tickloom default (float32+none) = reference"]  # a float32 checkpoint's default is the reference
    assert (ref["top1"], ref["kl"], ref["positions"]) == (1.0, 0.0, 12)
    (name,) = [n for n in rows if n.startswith(F32_ACT)]
    f32 = rows[name]
    assert f32["positions"] == 12 and f32["kept_prompts"] == 2
    assert 0.0 <= f32["top1"] <= 1.0 and f32["kl"] >= 0.0
    assert "vs_f32_act" not in f32  # the base of the comparison is not compared with itself
    assert any("llama.cpp skipped" in note for note in result["notes"])


@pytest.mark.parametrize("n", ["0", "321"])
def test_cli_refuses_a_prompt_count_it_cannot_give(n: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tickloom.tools.cli import main

    assert main(["bench", "model", "--accuracy", "--accuracy-prompts", n]) != 0
    assert f"--accuracy-prompts: accuracy prompts: {n} asked, 1 to 320 available" in capsys.readouterr().err


def test_exact_activations_is_the_files_float32_model_and_the_kernels_are_not(tmp_path: Path) -> None:
    """The float32-activation path multiplies the weights the layers hold, unrounded: on a Q4_0 file with a Q5_0
    v projection and a Q8_0 head (whose scales the tiles keep exactly) its logits are the reference's (the file
    dequantized) but for the order of float operations, while the same layers on the integer kernels (8-bit
    activations) are further off."""
    from test_model_gguf_sources import write_k_gguf

    from tickloom.engine.model.quant import DenseLinear
    from tickloom.engine.model.quant_grouped import SplitLinear

    tiny = write_tiny_model(tmp_path / "tiny", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                            seed=3)
    types = {"token_embd.weight": "Q8_0", "output.weight": "Q8_0", "attn_v.weight": "Q5_0"}
    gguf = write_k_gguf(tiny, tmp_path / "m.gguf", types, default="Q4_0")
    ids = [5, 9, 14, 3, 22, 7, 8, 1, 30, 2, 40, 41, 42, 43, 44, 45, 46, 47]
    ref = tickloom_logits(load_model(gguf, dtype="float32", quant="none"))(ids)
    kernels = load_model(gguf, dtype="float32", quant="int4")
    assert isinstance(kernels.model.layers[0].qkv, SplitLinear)  # q and k 4-bit, v 5-bit: two kernels' layers
    on_kernels = tickloom_logits(kernels)(ids)
    exact = exact_activations(kernels)
    assert all(isinstance(getattr(layer, name), DenseLinear) and getattr(layer, name).weight.dtype == torch.float32
               for layer in exact.model.layers for name in ("qkv", "wo", "w13", "w2"))
    got = tickloom_logits(exact)(ids)
    off, kernel_off = (got - ref).abs().max().item(), (on_kernels - ref).abs().max().item()
    assert off < 1e-4 < kernel_off and off < kernel_off / 100
    with pytest.raises(ValueError, match=r"a float32 model, not torch\.bfloat16"):
        exact_activations(load_model(gguf, dtype="bfloat16", quant="int4"))


def test_the_table_keeps_its_columns_under_long_path_names(capsys: pytest.CaptureFixture[str]) -> None:
    row = {"top1": 0.5, "kl": 0.001, "kept": 3.0, "kept_prompts": 2, "positions": 8}
    names = ["short", "a path name much longer than forty-two characters (float32, int4 dequantized)"]
    print_table({"model": "m", "prompts": 2, "new_tokens": 4, "notes": [],
                 "paths": {names[0]: row, names[1]: row | {"vs_f32_act": 0.01, "vs_f32_act_95": 0.02}}})
    header, *lines = capsys.readouterr().out.splitlines()[1:]
    end = header.index("top-1 agreement") + len("top-1 agreement")
    assert [line[end - 6 : end] for line in lines] == ["0.5000", "0.5000"]
    assert lines[1].endswith("+0.0100 +- 0.0200") and len(lines[1]) == len(header)


def test_exact_activations_widens_dense_layers_and_refuses_what_cannot_give_its_weight() -> None:
    from tickloom.engine.model.quant import DenseLinear
    from tickloom.tools.bench import accuracy

    half = DenseLinear(torch.ones(2, 3, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16))
    wide = accuracy._dense(half)
    assert wide.weight.dtype == torch.float32 and wide.bias is not None and wide.bias.dtype == torch.float32

    class Opaque:
        in_features, out_features = 3, 2

    with pytest.raises(TypeError, match="Opaque cannot give its weight back"):
        accuracy._dense(Opaque())  # type: ignore[arg-type]
    from tickloom.engine.model.quant_grouped import SplitLinear

    with pytest.raises(TypeError, match="its Opaque part cannot give its weight back"):
        SplitLinear([Opaque()], None).dequantize()  # type: ignore[list-item]
