"""Loaders: HF directories (sharded too), GGUF files, tokenizers, registry, and load errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from arch_gguf import add_gpt2_tokenizer, add_llama_shape
from model_fixtures import make_executor
from safetensors.torch import load_file, save_file

from tickloom.engine.model.batch import RowSpec, build_step_batch
from tickloom.engine.model.convert import resolve_model
from tickloom.engine.model.errors import ModelLoadError
from tickloom.engine.model.loaders import LoadedModel, load_model
from tickloom.engine.model.registry import available_models, cache_dir
from tickloom.engine.model.tiny import write_tiny_model

torch.set_num_threads(1)


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "tiny", seed=3)


def all_logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    kv = lm.model.new_kv_cache(16, 4)
    g = lm.config.num_heads // lm.config.num_kv_heads
    b = build_step_batch([RowSpec(0, len(ids), list(range(len(ids) // 4 + 1)), True)], ids, 4, g, kv.device)
    b.logit_index = None
    return lm.model.forward(b, kv)


def test_load_tiny_and_fingerprint(tiny_dir: Path, tmp_path: Path) -> None:
    lm = load_model(tiny_dir)
    assert lm.config.architecture == "llama" and lm.model.dtype == torch.float32
    assert lm.fingerprint == load_model(tiny_dir).fingerprint
    other = write_tiny_model(tmp_path / "other", seed=4)
    assert load_model(other).fingerprint != lm.fingerprint
    assert load_model(tiny_dir, dtype="float64").model.dtype == torch.float64


def test_sharded_checkpoint(tiny_dir: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_dir, sharded)
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(sharded / fname))
        weight_map.update({n: fname for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = load_model(tiny_dir), load_model(sharded)
    assert a.fingerprint == b.fingerprint
    ids = [5, 9, 40, 7]
    assert torch.equal(all_logits(a, ids), all_logits(b, ids))


def test_missing_tensor(tiny_dir: Path) -> None:
    t = load_file(str(tiny_dir / "model.safetensors"))
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, str(tiny_dir / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'") as e:
        load_model(tiny_dir)
    assert str(tiny_dir) in str(e.value)


def test_wrong_shape(tiny_dir: Path) -> None:
    t = load_file(str(tiny_dir / "model.safetensors"))
    t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(t, str(tiny_dir / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor .*k_proj.* has shape \(3, 64\)"):
        load_model(tiny_dir)


def test_truncated_safetensors(tiny_dir: Path) -> None:
    f = tiny_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated or corrupt"):
        load_model(tiny_dir)


def test_unknown_architecture(tiny_dir: Path) -> None:
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (tiny_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture 'MambaForCausalLM'"):
        load_model(tiny_dir)


def test_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a model directory"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve_model(tmp_path)


def test_tokenizer_and_chat_template(tiny_dir: Path) -> None:
    tok = load_model(tiny_dir).tokenizer
    text = "Hello, wörld! 123"
    assert tok.decode(tok.encode(text)) == text
    rendered = tok.render_chat([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.eos_token_ids == (2,)


# --- GGUF -------------------------------------------------------------------------------------------


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(tiny_dir: Path, out: Path, weight_type: gguf.GGMLQuantizationType | None = None) -> Path:
    cfg = json.loads((tiny_dir / "config.json").read_text())
    tensors = {k: v.numpy() for k, v in load_file(str(tiny_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(out), "llama")
    add_llama_shape(w, cfg)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    add_gpt2_tokenizer(w, tiny_dir / "tokenizer.json")
    w.add_eos_token_id(2)
    w.add_chat_template("{{ messages[0]['content'] }}")
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for name, arr in tensors.items():
        if name in top:
            gname = top[name]
        else:
            parts = name.split(".")
            gname = f"blk.{parts[2]}." + layer[".".join(parts[3:])]
        if gname.endswith("attn_q.weight"):
            arr = _permute(arr, cfg["num_attention_heads"])
        elif gname.endswith("attn_k.weight"):
            arr = _permute(arr, cfg["num_key_value_heads"])
        if weight_type is not None and gname == "blk.0.ffn_up.weight":
            nbytes = arr.size // 32 * gguf.GGML_QUANT_SIZES[weight_type][1]
            raw = np.zeros((arr.shape[0], nbytes // arr.shape[0]), dtype=np.uint8)
            w.add_tensor(gname, raw, raw_dtype=weight_type)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_gguf_roundtrip_unpermutes(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TICKLOOM_CACHE", str(tmp_path / "cache"))
    g = write_gguf(tiny_dir, tmp_path / "tiny.gguf")
    converted = resolve_model(g)
    assert converted.is_relative_to(cache_dir())
    assert resolve_model(g) == converted  # cached
    a, b = load_model(tiny_dir), load_model(g)
    ids = [7, 30, 99, 4, 250, 18, 61]
    torch.testing.assert_close(all_logits(b, ids), all_logits(a, ids), atol=1e-5, rtol=0)
    assert b.tokenizer.encode("hi there 42") == a.tokenizer.encode("hi there 42")
    assert b.tokenizer.render_chat([{"role": "user", "content": "x"}]) == "x"


def test_gguf_unsupported_quantization(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TICKLOOM_CACHE", str(tmp_path / "cache"))
    g = write_gguf(tiny_dir, tmp_path / "q.gguf", weight_type=gguf.GGMLQuantizationType.Q8_1)
    expect = r"q\.gguf: tensor 'blk\.0\.ffn_up\.weight' uses unsupported GGUF type Q8_1"
    with pytest.raises(ModelLoadError, match=expect):
        load_model(g)


def test_gguf_unknown_architecture(tmp_path: Path) -> None:
    out = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(out), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"mamba\.gguf: unsupported GGUF architecture 'mamba'"):
        load_model(out)


def test_available_models_lists_default() -> None:
    names = [m.name for m in available_models()]
    assert names == ["smollm2-135m"]


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TICKLOOM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "tickloom"
    monkeypatch.setenv("TICKLOOM_CACHE", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x"


def test_executor_from_loaded(tiny_dir: Path) -> None:
    ex = make_executor(tiny_dir, num_blocks=8, block_size=4)
    assert ex.kv.k[0].shape == (8, 4, 2, 16)
