"""A float32 model on tickloom's row-wise kernels (norms, rope and the cache write, silu, attention read in place
from the paged cache), as a bfloat16 model has been: the same forward as torch's ops to float32 rounding. F16 and
BF16 GGUF files run as float32 models, so their steps are no longer mostly per-op overhead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tickloom.engine.model import native
from tickloom.engine.model.loaders import load_model
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
    """float32 activations on int4 weights (the accuracy bench's comparison path) stay as they were: its layers
    take bfloat16 activations on the kernels, which the float32 row-wise kernels do not give them."""
    assert not load_model(tiny32, dtype="float32", quant="int4").model._native
