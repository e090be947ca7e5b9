"""A bfloat16 model's projections on tickloom's kernels (``native.bf16_matmul``, ``HalfLinear`` in bfloat16): the
sums are the float32 sums of the bfloat16 products, a row's result does not depend on its batch, and so speculative
decoding on a bfloat16 model gives exactly the tokens of decoding without it (torch's bfloat16 matmul did not:
one row and five differ in the last bits)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from model_fixtures import Driver, Spec, make_executor, prompts
from test_model_speculation import AnswerKey, speculate

from tickloom.engine.model import native, packing
from tickloom.engine.model.quant import DenseLinear, quantize_linear
from tickloom.engine.model.quant_grouped import HalfLinear
from tickloom.engine.model.tiny import write_tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")


def _tiles(w: torch.Tensor) -> np.ndarray:
    return packing.pack_half_tiles(w.view(torch.int16).numpy().view(np.uint16))


@pytest.mark.parametrize(("n", "k"), [(64, 576), (50, 64), (7, 32), (1, 16)])
def test_the_sums_are_the_bfloat16_products_summed_in_float32(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(9, k, generator=g).bfloat16()
    y = native.bf16_matmul(x, _tiles(w), n)
    exact = x.double() @ w.double().t()  # bfloat16 products are exact in float64 (and float32)
    # float32 sums of k exact products: within k float32 roundings of the largest partial sum
    bound = k * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    assert y.dtype == torch.float32 and y.shape == (9, n)
    assert bool(((y.double() - exact).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_does_not_depend_on_its_batch(threads: int) -> None:
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(40, 96, generator=g).bfloat16(), torch.randn(11, 96, generator=g).bfloat16()
    tiles = _tiles(w)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = native.bf16_matmul(x, tiles, 40)
        for m in range(1, 12):  # every tail of the 8-row passes, and more than one pass
            part = native.bf16_matmul(x[:m].contiguous(), tiles, 40)
            assert torch.equal(part, whole[:m]), m
    finally:
        torch.set_num_threads(old)


def test_it_refuses_activations_that_are_not_bfloat16() -> None:
    tiles = _tiles(torch.zeros(16, 32).bfloat16())
    with pytest.raises(ValueError, match="bf16_matmul"):
        native.bf16_matmul(torch.zeros(2, 32), tiles, 16)


def test_a_bfloat16_models_weights_go_on_the_kernel_and_a_float32_models_do_not() -> None:
    w = torch.randn(32, 64)
    layer = quantize_linear(w, None, "none", torch.bfloat16)
    assert isinstance(layer, HalfLinear)
    x = torch.randn(3, 64).bfloat16()
    assert layer(x).dtype == torch.bfloat16
    assert torch.equal(layer(x), layer.forward_f32(x).bfloat16())  # rounded once, from the float32 sums
    assert isinstance(quantize_linear(w, None, "none", torch.float32), DenseLinear)


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with head_dim 32, so that its bfloat16 form runs attention on the kernels too."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny32"), seed=5, vocab_size=320, hidden_size=128,
                            intermediate_size=256, num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("wrong_at", [2, 5, None])
def test_speculation_on_a_bfloat16_model_gives_the_plain_tokens(tiny32: Path, wrong_at: int | None) -> None:
    spec = Spec(temperature=1.0)
    prompt = prompts(1, 9, vocab=300, seed=2)[0]
    drv = Driver(make_executor(tiny32, dtype="bfloat16", num_blocks=64, block_size=4), seed=3)
    drv.add("x", prompt, spec, 42)
    want = drv.generate(["x"], 16)["x"]
    ex = make_executor(tiny32, dtype="bfloat16", num_blocks=64, block_size=4)
    assert ex.model._native and isinstance(ex.model.layers[0].qkv, HalfLinear)
    ex.proposer = AnswerKey(want, len(prompt), wrong_at=wrong_at)
    got, rows = speculate(ex, prompt, spec, 16, k=4)
    assert got == want
    assert sum(rows) > 0  # rows of five did run


def test_a_tied_bfloat16_model_looks_its_embeddings_up_in_the_heads_tiles(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from tickloom.engine.model.loaders import load_model

    path = write_tiny_model(tmp_path / "tied", seed=9, vocab_size=320, hidden_size=128, intermediate_size=256,
                            num_heads=4, num_kv_heads=2, tie_word_embeddings=True)
    model = load_model(path, dtype="bfloat16").model
    assert model.embed.table is None and model.embed.half is model.lm_head  # one copy of the tied weights
    table = load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"].bfloat16()
    ids = torch.tensor([0, 1, 319, 7, 7, 128])
    assert torch.equal(model.embed(ids), table[ids])
    untied = load_model(write_tiny_model(tmp_path / "untied", seed=9, vocab_size=320, hidden_size=128,
                                         intermediate_size=256, num_heads=4, num_kv_heads=2),
                        dtype="bfloat16").model
    assert untied.embed.table is not None  # an untied head is another matrix: the table stays
