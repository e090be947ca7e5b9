"""e09: the paged-KV forward matches transformers' Llama/Qwen2 on random tiny checkpoints."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from model_fixtures import Driver, Spec, make_executor, prompts

from tickloom.engine.model.batch import RowSpec, build_step_batch
from tickloom.engine.model.loaders import load_model
from tickloom.engine.model.tiny import write_tiny_model

os.environ["HF_HUB_OFFLINE"] = "1"
torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "llama-gqa": {"architecture": "llama"},
    "llama-mha-tied-llama3rope": {
        "architecture": "llama",
        "num_kv_heads": 4,
        "tie_word_embeddings": True,
        "rope_scaling": LLAMA3_ROPE,
    },
    "qwen2": {"architecture": "qwen2", "num_layers": 3, "num_heads": 6, "num_kv_heads": 2, "hidden_size": 96},
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    name = request.param
    d = write_tiny_model(tmp_path_factory.mktemp(name), seed=7, **CONFIGS[name])
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(d), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return d, ref


def ref_logits(ref: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def run_rows(model: Any, kv: Any, rows: list[RowSpec], toks: list[int]) -> torch.Tensor:
    g = model.cfg.num_heads // model.cfg.num_kv_heads
    batch = build_step_batch(rows, toks, kv.block_size, g, torch.device("cpu"))
    batch.logit_index = None
    return model.forward(batch, kv)


def test_e09_reference_model_prefill_chunked_decode(tiny: tuple[Path, Any]) -> None:
    d, ref = tiny
    if "llama3rope" in str(d):
        rp = getattr(ref.config, "rope_parameters", None) or ref.config.rope_scaling
        assert rp["rope_type"] == "llama3"
    lm = load_model(d, dtype="float32")
    model = lm.model
    kv = model.new_kv_cache(num_blocks=64, block_size=4)
    rng = random.Random(1)
    ids = [rng.randrange(3, 250) for _ in range(23)]
    expect = ref_logits(ref, ids)

    table = rng.sample(range(64), 6)  # scattered, shuffled blocks
    got = run_rows(model, kv, [RowSpec(0, 23, table, True)], ids)
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=0)

    table2 = rng.sample([b for b in range(64) if b not in table], 6)
    parts: list[torch.Tensor] = []
    for start, end in [(0, 5), (5, 6), (6, 13), (13, 17)] + [(p, p + 1) for p in range(17, 23)]:
        parts.append(run_rows(model, kv, [RowSpec(start, end - start, table2, True)], ids[start:end]))
    torch.testing.assert_close(torch.cat(parts), expect, atol=1e-4, rtol=0)


def test_e09_reference_model_mixed_batch(tiny: tuple[Path, Any]) -> None:
    """Prefill chunks and decode rows of different requests in one forward."""
    d, ref = tiny
    model = load_model(d, dtype="float32").model
    kv = model.new_kv_cache(num_blocks=96, block_size=4)
    rng = random.Random(2)
    seqs = [[rng.randrange(3, 250) for _ in range(n)] for n in (19, 11, 26, 9)]
    blocks = list(range(96))
    rng.shuffle(blocks)
    tables = [blocks[i * 8 : (i + 1) * 8] for i in range(4)]
    expects = [ref_logits(ref, s) for s in seqs]
    # step 1: everything but the tail of each sequence
    cut = [15, 10, 20, 4]
    run_rows(
        model,
        kv,
        [RowSpec(0, c, t, True) for c, t in zip(cut, tables, strict=True)],
        [tok for s, c in zip(seqs, cut, strict=True) for tok in s[:c]],
    )
    # step 2: decode rows (seq 1, 0) around a chunk (seq 3) and a chunk (seq 2), interleaved
    rows = [
        RowSpec(10, 1, tables[1], True),
        RowSpec(4, 5, tables[3], True),
        RowSpec(15, 1, tables[0], True),
        RowSpec(20, 6, tables[2], True),
    ]
    toks = seqs[1][10:11] + seqs[3][4:9] + seqs[0][15:16] + seqs[2][20:26]
    got = run_rows(model, kv, rows, toks)
    torch.testing.assert_close(got[0:1], expects[1][10:11], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1:6], expects[3][4:9], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[6:7], expects[0][15:16], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[7:13], expects[2][20:26], atol=1e-4, rtol=0)


def test_e09_reference_model_greedy_generations(tiny: tuple[Path, Any]) -> None:
    d, ref = tiny
    ex = make_executor(d, num_blocks=128, block_size=4)
    drv = Driver(ex, seed=3)
    ps = prompts(3, 9)
    for i, p in enumerate(ps):
        drv.add(f"r{i}", p, Spec(), seed=i)
    got = drv.generate([f"r{i}" for i in range(3)], max_new=12, chunk=5)
    for i, p in enumerate(ps):
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got[f"r{i}"] == out[0, len(p) :].tolist()
