"""Where a model comes from, and what it costs there: a Q4_K_M-style GGUF loads with every matrix as the file
stores it and a cache entry smaller than the file; a GGUF by path gets the defaults it gets by name (setting, chat,
template, tokens); ``--model org/name`` reads the local Hugging Face cache offline, and a name found nowhere is
told both places looked."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from arch_gguf import add_gpt2_tokenizer, add_llama_shape
from safetensors.torch import load_file
from test_model_gguf_types import k_blocks

from tickloom.engine.model import loaders, native
from tickloom.engine.model.config import ModelConfig
from tickloom.engine.model.convert import model_chat_template, resolve_model
from tickloom.engine.model.errors import ModelLoadError
from tickloom.engine.model.llama import LlamaModel
from tickloom.engine.model.loaders import DEFAULT_SETTING, default_setting, load_model
from tickloom.engine.model.quant import GroupedInt8Linear, Int4Linear, RawBlocks, SplitLinear, Weight
from tickloom.engine.model.quant_grouped import WideIntLinear
from tickloom.engine.model.registry import DEFAULT_MODEL, smollm2_gguf_path
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.events import LogReader, RequestArrived
from tickloom.tools.cli import EX_USAGE, main

Q = gguf.GGMLQuantizationType

Q4_K_M = {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q5_K", "token_embd.weight": "Q6_K", "output.weight": "Q6_K"}
"""A Q4_K_M file's mix (llama.cpp keeps these in more bits); every other matrix is Q4_K."""

_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight"}


def write_k_gguf(tiny_dir: Path, out: Path, types: Mapping[str, str] = Q4_K_M, *, template: bool = True,
                 default: str = "Q4_K") -> Path:
    """A GGUF of the tiny model's shapes and tokenizer whose matrices are random blocks of K-quant types
    (``gguf`` cannot write K-quants; the model's numbers need not mean anything), norms in F32."""
    cfg = json.loads((tiny_dir / "config.json").read_text())
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), "llama")
    add_llama_shape(w, cfg)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    add_gpt2_tokenizer(w, tiny_dir / "tokenizer.json")
    w.add_eos_token_id(2)
    if template:
        w.add_chat_template("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if name in _TOP:
            gname = _TOP[name]
        else:
            parts = name.split(".")
            gname = f"blk.{parts[2]}." + _LAYER[".".join(parts[3:])]
        if t.dim() == 1:
            w.add_tensor(gname, t.numpy())
            continue
        kind = next((k for key, k in types.items() if gname == key or gname.endswith("." + key)), default)
        if kind in ("Q4_K", "Q5_K", "Q6_K"):
            raw = _small_k_blocks(kind, t.shape[0], t.shape[1], seed=i)
        else:
            raw = np.ascontiguousarray(gguf.quants.quantize(t.numpy(), Q[kind])).view(np.uint8).reshape(t.shape[0], -1)
        w.add_tensor(gname, raw, raw_dtype=Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _small_k_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random K-quant blocks whose weights are about the tiny model's size (|w| < 0.05)."""
    b = k_blocks(kind, n, k, seed).reshape(n, k // 256, -1)
    small = np.full(b.shape[:-1], 2e-5, dtype=np.float16).view(np.uint8).reshape(*b.shape[:-1], 2)
    if kind == "Q6_K":
        b[..., 208:210] = small
    else:
        b[..., 0:2] = small
        b[..., 2:4] = small
    return b.reshape(n, -1)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TICKLOOM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with K-quant-sized rows (256 inputs, 512 in the MLP's down projection)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", hidden_size=256, intermediate_size=512,
                            num_heads=4, num_kv_heads=2, seed=7)


@pytest.fixture(scope="module")
def k_gguf(tiny_256: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_k_gguf(tiny_256, tmp_path_factory.mktemp("gguf") / "tiny-Q4_K_M.gguf")


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_q4_k_m_file_loads_as_it_is_stored(cache: Path, k_gguf: Path) -> None:
    seen: dict[str, Weight] = {}

    def build(cfg: ModelConfig, tensors: Mapping[str, Weight], dtype: torch.dtype, device: torch.device,
              quant: str) -> LlamaModel:
        seen.update(tensors)
        return LlamaModel(cfg, tensors, dtype, device, quant)

    q = load_model(k_gguf, quant="int4", build=build)
    matrices = {n: w for n, w in seen.items() if len(w.shape) == 2}
    assert matrices and all(isinstance(w, RawBlocks) for w in matrices.values())  # no float32 copy was made
    assert {w.kind for w in matrices.values() if isinstance(w, RawBlocks)} == {"Q4_K", "Q5_K", "Q6_K"}
    layer = q.model.layers[0]
    wide = WideIntLinear if native.available() else GroupedInt8Linear  # Q5_K and Q6_K: their own bits
    assert isinstance(layer.qkv, SplitLinear)  # q, k in Q4_K as int4; v in Q6_K as 6-bit (grouped int8 in torch)
    assert [type(p) for p in layer.qkv.parts] == [Int4Linear, wide]
    assert isinstance(layer.wo, Int4Linear) and isinstance(layer.w13, Int4Linear)
    assert isinstance(layer.w2, wide)
    assert q.model.embed.blocks is not None and q.model.embed.blocks.kind == "Q6_K"  # rows dequantized per lookup
    # the same file unquantized (float32, dequantized as ggml does) predicts the same way
    f = load_model(k_gguf, dtype="float32", quant="none")
    assert f.fingerprint + "+int4" == q.fingerprint
    ids = torch.tensor([[3, 17, 99, 250, 4, 61]])
    with torch.inference_mode():
        a = _last_logits(f, ids)
        b = _last_logits(q, ids)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    torch.testing.assert_close(b, a, atol=0.05 * float(a.abs().max()), rtol=0.05)


def _last_logits(lm: Any, ids: torch.Tensor) -> torch.Tensor:
    from test_model_loaders import all_logits

    return all_logits(lm, ids[0].tolist())


def test_the_cache_entry_of_a_gguf_is_no_larger_than_the_file(cache: Path, k_gguf: Path) -> None:
    entry = resolve_model(k_gguf)
    assert not list(entry.glob("*.safetensors"))  # the weights stay in the GGUF
    assert (entry / "config.json").is_file() and (entry / "tokenizer.json").is_file()
    size, file_size = _tree_bytes(entry), k_gguf.stat().st_size
    assert size <= file_size, (size, file_size)
    with pytest.raises(ModelLoadError, match="holds no weights: load the GGUF it was converted from"):
        load_model(entry)


def test_a_type_with_no_path_is_dequantized_with_a_warning_that_says_its_cost(
        cache: Path, tiny_256: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    raw_q3 = np.random.default_rng(0).integers(0, 256, (512, 110), dtype=np.uint8)  # one 256-weight block a row
    raw_q3[:, 108:110] = np.full((512, 1), 1e-5, np.float16).view(np.uint8)  # its d, last
    w = gguf.GGUFWriter(str(tmp_path / "q3only.gguf"), "llama")
    w.add_tensor("blk.0.ffn_gate.weight", raw_q3, raw_dtype=Q.Q3_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from tickloom.engine.model.gguf_loader import gguf_weights, open_gguf

    cfg = ModelConfig.from_file(tiny_256 / "config.json")
    with caplog.at_level("WARNING"):
        got = gguf_weights(tmp_path / "q3only.gguf", open_gguf(tmp_path / "q3only.gguf"), cfg)
    assert got["model.layers.0.mlp.gate_proj.weight"].dtype == torch.float32
    [record] = [r for r in caplog.records if "Q3_K" in r.getMessage()]
    assert "'blk.0.ffn_gate.weight'" in record.getMessage() and "0.5 MB of memory" in record.getMessage()


# -- by path as by name ---------------------------------------------------------------------------------------


def test_a_gguf_gets_its_defaults_from_the_file(k_gguf: Path, tiny_256: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    floats = tmp_path / "f16.gguf"
    write_k_gguf(tiny_256, floats, {}, default="F16", template=False)
    monkeypatch.setattr(loaders, "bf16_runs_fast", lambda: True)  # tickloom's kernels or native bfloat16
    bundled = smollm2_gguf_path()
    assert bundled is not None
    assert default_setting(DEFAULT_MODEL, cpu) == default_setting(str(bundled), cpu) == DEFAULT_SETTING
    assert default_setting(k_gguf, cpu) == DEFAULT_SETTING
    assert default_setting(floats, cpu) == (None, "none")  # nothing quantized in the file
    assert default_setting(tiny_256, cpu) == (None, "none")
    monkeypatch.setattr(loaders, "bf16_runs_fast", lambda: False)  # neither: float32 for every model
    assert default_setting(DEFAULT_MODEL, cpu) == default_setting(str(bundled), cpu) == (None, "none")
    # chat: on where the model has a template, by name or by path
    assert model_chat_template(k_gguf) == "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert model_chat_template(floats) is None
    assert model_chat_template(DEFAULT_MODEL) == model_chat_template(bundled) is not None
    assert model_chat_template("stub") is None


def _logged(log: Path) -> tuple[str, str, list[int]]:
    """The header's setting and weight fingerprint, and the first request's prompt tokens."""
    with LogReader(log) as reader:
        header = reader.header
        arrived = [i for t in reader.ticks() for i in t.inputs.inputs if isinstance(i, RequestArrived)]
    return header.dtype, header.model_fingerprint, list(arrived[0].prompt_token_ids)


def test_the_bundled_gguf_by_path_runs_as_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundled = smollm2_gguf_path()
    assert bundled is not None
    runs = []
    for label, model in (("name", DEFAULT_MODEL), ("path", str(bundled))):
        log = tmp_path / f"{label}.tlog"
        assert main(["generate", "--model", model, "--temperature", "0", "-n", "8", "--log", str(log), "--json",
                     "--quiet", "What is the capital of France?"]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        tokens = [t for line in lines if "token_ids" in line for t in line["token_ids"]]
        runs.append((*_logged(log), tokens))
    (dtype_a, fp_a, prompt_a, out_a), (dtype_b, fp_b, prompt_b, out_b) = runs
    assert (dtype_a, fp_a) == (dtype_b, fp_b)  # the same setting and weights
    assert prompt_a == prompt_b and len(out_a) == 8 and out_a == out_b  # the same chat rendering and tokens
    assert prompt_a[0] == 1  # "<|im_start|>": chat was on for both, with the file's template


# -- the Hugging Face cache -----------------------------------------------------------------------------------


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "hf"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def _snapshot(root: Path, repo: str, commit: str = "0123abcd") -> Path:
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    return snap


def test_org_name_loads_from_the_hugging_face_cache(cache: Path, hf_cache: Path, tmp_path: Path) -> None:
    snap = _snapshot(hf_cache, "tickloom-test/tiny")
    write_tiny_model(snap, seed=11)
    (hf_cache / "models--tickloom-test--tiny" / "snapshots" / "older").mkdir()  # refs/main names the one to use
    assert resolve_model("tickloom-test/tiny") == snap
    loaded = load_model("tickloom-test/tiny")
    assert loaded.fingerprint == load_model(write_tiny_model(tmp_path / "same", seed=11)).fingerprint
    assert main(["generate", "--model", "tickloom-test/tiny", "-n", "2", "--quiet", "hi"]) == 0


def test_a_gguf_snapshot_loads_its_file(cache: Path, hf_cache: Path, k_gguf: Path) -> None:
    snap = _snapshot(hf_cache, "tickloom-test/tiny-GGUF")
    (snap / k_gguf.name).symlink_to(k_gguf)
    assert loaders._source_gguf("tickloom-test/tiny-GGUF") == snap / k_gguf.name
    assert load_model("tickloom-test/tiny-GGUF").fingerprint == load_model(k_gguf).fingerprint
    (snap / "second.gguf").symlink_to(k_gguf)
    with pytest.raises(ModelLoadError, match=r"holds 2 \.gguf files"):
        resolve_model("tickloom-test/tiny-GGUF")


def test_a_name_found_nowhere_names_both_places_looked(hf_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ModelLoadError) as info:
        resolve_model("nobody/nothing")
    message = str(info.value)
    assert DEFAULT_MODEL in message and str(hf_cache / "models--nobody--nothing") in message
    assert main(["generate", "--model", "nobody/nothing", "hi"]) == EX_USAGE
    err = capsys.readouterr().err
    assert DEFAULT_MODEL in err and "models--nobody--nothing" in err and "Hugging Face cache" in err
