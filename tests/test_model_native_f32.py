"""A float32 model on tickloom's row-wise kernels (norms, rope and the cache write, silu, attention read in place
from the paged cache), as a bfloat16 model has been: the same forward as torch's ops to float32 rounding. F16 and
BF16 GGUF files run as float32 models, so their steps are no longer mostly per-op overhead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from arch_gguf import write_gguf

from tickloom.engine.core.blocks import blocks_holding
from tickloom.engine.model import native
from tickloom.engine.model.batch import RowSpec, build_step_batch
from tickloom.engine.model.loaders import load_model
from tickloom.engine.model.quant_grouped import HalfLinear
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.tools.bench.accuracy import tickloom_greedy, tickloom_logits

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 32, so that attention runs on the kernels too."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny32"), seed=5, vocab_size=320, hidden_size=128,
                            intermediate_size=256, num_heads=4, num_kv_heads=2)


def test_a_float32_model_runs_the_kernels_and_matches_torchs_ops(tiny32: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    on = load_model(tiny32, dtype="float32")
    assert on.model._native and on.model.new_kv_cache(2, 4).kv[0].dtype == torch.float32
    with monkeypatch.context() as m:
        m.setattr(native, "available", lambda: False)
        off = load_model(tiny32, dtype="float32")
    assert not off.model._native
    ids = [5, 9, 14, 3, 22, 7, 8, 1, 30, 2, 40, 41, 42, 43, 44, 45, 46, 47]  # more than one block of 16
    got, want = tickloom_logits(on)(ids), tickloom_logits(off)(ids)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # decode steps read the cache the prefill wrote (float32 slots of the paged cache)
    assert tickloom_greedy(on, ids[:6], 12) == tickloom_greedy(off, ids[:6], 12)


def test_a_float32_model_with_integer_weights_keeps_torchs_path(tiny32: Path) -> None:
    """A float32 model with int4 weights stays on torch's path: its layers take bfloat16 activations on the
    kernels, which the float32 row-wise kernels do not give them."""
    assert not load_model(tiny32, dtype="float32", quant="int4").model._native


def _decode_logits(m: Any, prompts: list[list[int]], together: bool) -> torch.Tensor:
    """One decode step's logits after each prompt's prefill: the rows in one step, or each in a step of its own."""
    bs = 16
    gqa = m.cfg.num_heads // m.cfg.num_kv_heads
    sizes = [blocks_holding(len(p) + 1, bs) for p in prompts]
    kv = m.new_kv_cache(sum(sizes) + 1, bs)
    tables, first = [], 0
    for size in sizes:
        tables.append(list(range(first, first + size)))
        first += size
    nxt = []
    for p, t in zip(prompts, tables, strict=True):
        batch = build_step_batch([RowSpec(0, len(p), t, True)], p, bs, gqa, torch.device("cpu"))
        nxt.append(int(m.forward(batch, kv)[-1].argmax()))
    rows = [RowSpec(len(p), 1, t, True) for p, t in zip(prompts, tables, strict=True)]
    if together:
        return m.forward(build_step_batch(rows, nxt, bs, gqa, torch.device("cpu")), kv)
    return torch.cat([m.forward(build_step_batch([r], [x], bs, gqa, torch.device("cpu")), kv)
                      for r, x in zip(rows, nxt, strict=True)])


@pytest.mark.parametrize("half", ["F16", "BF16"])
def test_an_f16_or_bf16_file_is_a_float32_model_whose_rows_ignore_their_batch(tiny32: Path, tmp_path: Path,
                                                                            half: str) -> None:
    """An F16 or BF16 GGUF runs as a float32 model wholly on the kernels: its projections are the file's 16 bits in
    tiles, its row-wise ops and attention the float32 kernels. Each is row-invariant, so a row's logits in a batch
    of three are its logits alone, to the bit (speculation and batching then cannot change its tokens, as on the
    quantized and bfloat16 paths); and they are the checkpoint's to the 16-bit rounding of its weights."""
    torch.set_num_threads(1)
    lm = load_model(write_gguf(tiny32, "llama", tmp_path / f"tiny32-{half}.gguf", half=half), dtype="float32")
    assert lm.model._native and isinstance(lm.model.layers[0].qkv, HalfLinear)
    prompts = [[5, 9, 14, 3, 22, 7], [40, 41, 42], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]]
    together = _decode_logits(lm.model, prompts, together=True)
    assert torch.equal(together, _decode_logits(lm.model, prompts, together=False))
    ref = load_model(tiny32, dtype="float32")
    torch.testing.assert_close(together, _decode_logits(ref.model, prompts, together=True), atol=0.05, rtol=0)
