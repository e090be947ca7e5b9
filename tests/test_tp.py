"""Tensor parallelism on CPU: two gloo ranks (two processes) of the tiny model give the tokens one rank gives, for
greedy and for seeded sampling, with the real core driving rank 0 and every call mirrored to rank 1."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tickloom.engine.model.config import ModelConfig
from tickloom.engine.model.executor import ModelExecutor
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.engine.model.tp import shard_config, shard_tensors
from tickloom.replay import verify

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_two_gloo_ranks_give_the_tokens_of_one(tmp_path: Path, architecture: str) -> None:
    from tp_rank import CONFIG, rank_model, run_workload

    model_dir = write_tiny_model(tmp_path / "model", seed=3, architecture=architecture)
    one = run_workload(ModelExecutor(rank_model(model_dir, rank=0, world=1),
                                     CONFIG.num_blocks, CONFIG.block_size), tmp_path / "one.tlog")
    assert sorted(one) == ["g0", "g1", "s0", "s1"] and all(one.values())

    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "tp_rank.py"), "--rank", str(r), "--world", "2",
                               "--port", str(port), "--model", str(model_dir), "--log", str(tmp_path / "two.tlog"),
                               "--out", str(tmp_path / f"rank{r}.json")], cwd=HERE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank0["tokens"] == one
    assert rank0["kv_heads"] == rank1["kv_heads"] == 1  # each rank holds half of the two kv heads
    assert rank1["calls"] > 4  # every bind, step and release reached rank 1
    assert verify(tmp_path / "two.tlog").status == "identical"


def test_a_rank_keeps_its_heads_and_channels(tiny: Path) -> None:
    cfg = ModelConfig.from_file(tiny / "config.json")
    from tickloom.engine.model.checkpoint import read_safetensors

    tensors, _ = read_safetensors(tiny)
    rank1 = shard_tensors(cfg, tensors, 1, 2)
    d = cfg.head_dim
    p = "model.layers.0."
    q = tensors[p + "self_attn.q_proj.weight"]
    assert torch.equal(rank1[p + "self_attn.q_proj.weight"], q[cfg.num_heads // 2 * d :])
    k = tensors[p + "self_attn.k_proj.weight"]
    assert torch.equal(rank1[p + "self_attn.k_proj.weight"], k[cfg.num_kv_heads // 2 * d :])
    o = tensors[p + "self_attn.o_proj.weight"]
    assert torch.equal(rank1[p + "self_attn.o_proj.weight"], o[:, cfg.num_heads // 2 * d :])
    half = cfg.intermediate_size // 2
    assert torch.equal(rank1[p + "mlp.up_proj.weight"], tensors[p + "mlp.up_proj.weight"][half:])
    assert torch.equal(rank1[p + "mlp.down_proj.weight"], tensors[p + "mlp.down_proj.weight"][:, half:])
    assert rank1["model.embed_tokens.weight"] is tensors["model.embed_tokens.weight"]
    rank_cfg = shard_config(cfg, 2)
    assert (rank_cfg.num_heads, rank_cfg.num_kv_heads, rank_cfg.intermediate_size, rank_cfg.head_dim) == (
        cfg.num_heads // 2, cfg.num_kv_heads // 2, half, cfg.head_dim)


def test_a_world_that_does_not_divide_the_heads_is_refused(tiny: Path) -> None:
    cfg = ModelConfig.from_file(tiny / "config.json")
    with pytest.raises(ValueError, match="num_heads=4 divisible by 3"):
        shard_config(cfg, 3)
    with pytest.raises(ValueError, match="num_kv_heads=2 divisible by 4"):
        shard_config(cfg, 4)
    with pytest.raises(ValueError, match="intermediate_size=129 divisible by 2"):
        shard_config(dataclasses.replace(cfg, intermediate_size=129), 2)
