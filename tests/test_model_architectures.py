"""Issue 28: the architectures people download (Qwen3, Mistral, Gemma 2, Gemma 3, Phi-3, Llama 3.x rope scaling)
match transformers on small random checkpoints, through the paged KV cache, and as GGUF files.

Each case is a config shaped like the real architecture's with its options on and sized so they matter: windows
shorter than the test sequences, soft-caps near the scores' and logits' size, a local rope base far from the
global one, LongRoPE factors far from 1. ``test_each_rule_matters`` turns each option off in turn and checks the
agreement then breaks, so that every agreement test would catch the rule's removal.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from arch_gguf import GEMMA_TYPES, spm_reference, write_gguf
from model_fixtures import Driver, Spec, make_executor, prompts
from test_model_reference import ref_logits, run_rows

from tickloom.engine.model import llama
from tickloom.engine.model.arch import ArchOptions
from tickloom.engine.model.batch import RowSpec
from tickloom.engine.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tickloom.engine.model.errors import ModelLoadError
from tickloom.engine.model.loaders import load_model
from tickloom.engine.model.rope import Rope
from tickloom.engine.model.tiny import tiny_tokenizer, write_tiny_model

os.environ["HF_HUB_OFFLINE"] = "1"
torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")

HALF = 16  # head_dim 32: rotated pairs
_factors = random.Random(5)
LONGROPE = {  # Phi-3's head_dim is hidden / heads = 16: 8 pairs
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [round(1 + 0.5 * _factors.random(), 3) for _ in range(8)],
    "long_factor": [round(1 + 3 * _factors.random(), 3) for _ in range(8)],
}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
COMMON: dict[str, Any] = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "bos_token_id": 0,
                          "eos_token_id": 2, "pad_token_id": 0, "max_position_embeddings": 256}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {"num_hidden_layers": 2, "tie_word_embeddings": True}),
    "mistral-window": ("mistral", {"num_hidden_layers": 2, "sliding_window": 6, "head_dim": 16}),
    "llama3-rope": ("llama", {"num_hidden_layers": 2, "head_dim": 16, "rope_parameters": LLAMA3}),
    "gemma2": ("gemma2", {"num_hidden_layers": 4, "sliding_window": 5, "query_pre_attn_scalar": 24,
                          "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0}),
    "gemma3": ("gemma3_text", {"num_hidden_layers": 6, "sliding_window": 5, "query_pre_attn_scalar": 32,
                               "rope_parameters": {
                                   "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
    "phi3": ("phi3", {"num_hidden_layers": 2, "sliding_window": 7, "head_dim": 16,
                      "original_max_position_embeddings": 64, "rope_parameters": LONGROPE,
                      "tie_word_embeddings": False}),
}


def _randomize(model: Any, model_type: str) -> None:
    """Weights of a trained model's scale, not transformers' tiny init (Gemma's norms init to 0, i.e. 1 + 0).

    With tied embeddings, a token's own embedding must not dominate the last hidden state, or every prompt's
    greedy continuation repeats its last token: the embeddings are small there, and Gemma's sublayer outputs
    (after their post-norms, ``1 + w``) large."""
    gemma = model_type in GEMMA_TYPES
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                post = gemma and name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"))
                base = 2.0 if post else 0.0 if gemma else 1.0
                p.copy_(base + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p) * (0.25 if model.config.tie_word_embeddings else 1.0))
            else:
                p.copy_(torch.randn_like(p) * (1.5 / p.shape[-1] ** 0.5))


def _write_tokenizer(d: Path) -> None:
    tok, tok_cfg = tiny_tokenizer()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg), encoding="utf-8")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    made: dict[str, tuple[Path, Any]] = {}

    def get(case: str) -> tuple[Path, Any]:
        if case not in made:
            model_type, extra = CASES[case]
            cfg = transformers.AutoConfig.for_model(model_type, **{**COMMON, **extra})
            torch.manual_seed(11)
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
            _randomize(model, model_type)
            d = tmp_path_factory.mktemp(case)
            model.save_pretrained(str(d))
            _write_tokenizer(d)
            made[case] = (d, model)
        return made[case]

    return get


def _prompt(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def _paged_logits(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """All 23 positions' logits in one prefill, and through chunks and decode steps over shuffled blocks."""
    ids = _prompt(23)
    kv = model.new_kv_cache(num_blocks=64, block_size=4)
    rng = random.Random(1)
    one = run_rows(model, kv, [RowSpec(0, 23, rng.sample(range(64), 6), True)], ids)
    table = rng.sample(range(64), 6)
    parts = [run_rows(model, kv, [RowSpec(a, b - a, table, True)], ids[a:b])
             for a, b in [(0, 5), (5, 6), (6, 13), (13, 17)] + [(p, p + 1) for p in range(17, 23)]]
    return one, torch.cat(parts)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_prefill_chunks_and_decode(
    case: str, checkpoints: Callable[[str], tuple[Path, Any]]
) -> None:
    d, ref = checkpoints(case)
    lm = load_model(d, dtype="float32")
    assert lm.config.architecture == SUPPORTED_ARCHITECTURES[type(ref).__name__]
    assert not lm.model._native
    expect = ref_logits(ref, _prompt(23))
    one, paged = _paged_logits(lm.model)
    torch.testing.assert_close(one, expect, atol=1e-4, rtol=0)
    torch.testing.assert_close(paged, expect, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_mixed_batch_windows(case: str, checkpoints: Callable[[str], tuple[Path, Any]]) -> None:
    """Decode rows of different lengths batched with prefill chunks: each row's window is its own."""
    d, ref = checkpoints(case)
    model = load_model(d, dtype="float32").model
    kv = model.new_kv_cache(num_blocks=96, block_size=4)
    rng = random.Random(2)
    seqs = [_prompt(n, seed=n) for n in (19, 11, 26, 9)]
    blocks = list(range(96))
    rng.shuffle(blocks)
    tables = [blocks[i * 8 : (i + 1) * 8] for i in range(4)]
    cut = [15, 10, 20, 4]
    run_rows(model, kv, [RowSpec(0, c, t, True) for c, t in zip(cut, tables, strict=True)],
             [tok for s, c in zip(seqs, cut, strict=True) for tok in s[:c]])
    rows = [RowSpec(10, 1, tables[1], True), RowSpec(4, 5, tables[3], True), RowSpec(15, 1, tables[0], True),
            RowSpec(20, 6, tables[2], True)]
    got = run_rows(model, kv, rows, seqs[1][10:11] + seqs[3][4:9] + seqs[0][15:16] + seqs[2][20:26])
    torch.testing.assert_close(got[0:1], ref_logits(ref, seqs[1])[10:11], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1:6], ref_logits(ref, seqs[3])[4:9], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[6:7], ref_logits(ref, seqs[0])[15:16], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[7:13], ref_logits(ref, seqs[2])[20:26], atol=1e-4, rtol=0)


def _greedy_reference(ref: Any, ps: list[list[int]], new: int) -> list[list[int]]:
    out = []
    for p in ps:
        with torch.no_grad():
            g = ref.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        out.append(g[0, len(p) :].tolist())
    return out


def _greedy_tickloom(path: Path, ps: list[list[int]], new: int) -> list[list[int]]:
    drv = Driver(make_executor(path, num_blocks=128, block_size=4), seed=3)
    for i, p in enumerate(ps):
        drv.add(f"r{i}", p, Spec(), seed=i)
    got = drv.generate([f"r{i}" for i in range(len(ps))], max_new=new, chunk=5)
    return [got[f"r{i}"] for i in range(len(ps))]


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_generation_and_gguf(
    case: str, checkpoints: Callable[[str], tuple[Path, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executor's greedy tokens (chunked prefill, batched decode) are transformers'; so are those of a GGUF
    written from the same weights as llama.cpp's converter lays them out."""
    monkeypatch.setenv("TICKLOOM_CACHE", str(tmp_path / "cache"))
    d, ref = checkpoints(case)
    ps = prompts(3, 9)
    expect = _greedy_reference(ref, ps, 12)
    assert _greedy_tickloom(d, ps, 12) == expect
    g = write_gguf(d, CASES[case][0], tmp_path / f"{case}.gguf")
    from_gguf, from_dir = load_model(g, dtype="float32"), load_model(d, dtype="float32")
    assert from_gguf.config.architecture == from_dir.config.architecture
    if CASES[case][0] in ("mistral", "phi3", *GEMMA_TYPES):
        ref_ids = spm_reference("hello world", add_prefix=CASES[case][0] not in GEMMA_TYPES)
        assert from_gguf.tokenizer.encode("hello world")[-len(ref_ids) :] == ref_ids
    torch.testing.assert_close(_paged_logits(from_gguf.model)[1], _paged_logits(from_dir.model)[1], atol=1e-4,
                               rtol=0)
    assert _greedy_tickloom(g, ps, 12) == expect


@pytest.mark.parametrize("case", ["gemma2", "phi3", "qwen3", "mistral-window"])
def test_quantized_gguf_runs_each_family(case: str, checkpoints: Callable[[str], tuple[Path, Any]], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q8_0 GGUF of each family loads as float32 (its blocks dequantized) and with int8 layers: both near
    transformers' logits (Q8_0 moves them by ~1% of their range, int8 activations by ~5%; a misread tensor moves
    them far)."""
    monkeypatch.setenv("TICKLOOM_CACHE", str(tmp_path / "cache"))
    d, ref = checkpoints(case)
    g = write_gguf(d, CASES[case][0], tmp_path / f"{case}-q8.gguf", q8=True)
    expect = ref_logits(ref, _prompt(23))
    scale = expect.abs().max().item()
    for quant, share in (("none", 0.05), ("int8", 0.1)):
        _, paged = _paged_logits(load_model(g, dtype="float32", quant=quant).model)
        gap = (paged - expect).abs().max().item()
        assert gap < share * scale, (quant, gap, scale)


def test_longrope_switches_to_long_factors_past_the_original_context(
    checkpoints: Callable[[str], tuple[Path, Any]]
) -> None:
    """Phi-3's LongRoPE: a 60-token prompt (short factors) decoded past position 64 (long factors from there), as
    transformers' model rotates tokens fed one by one through its cache (its Phi-3 ``generate`` instead re-encodes
    the whole sequence with the long factors once it passes the original context; tickloom keeps the cache)."""
    d, ref = checkpoints("phi3")
    model = load_model(d, dtype="float32").model
    ids = _prompt(70, seed=9)
    cache = transformers.DynamicCache(config=ref.config)
    with torch.no_grad():
        first = ref(torch.tensor([ids[:60]]), cache=cache, use_cache=True)
        expect = [first.logits[0, -1]]
        for p in range(60, 70):
            step = ref(torch.tensor([[ids[p]]]), cache=cache, use_cache=True,
                       position_ids=torch.tensor([[p]]))
            expect.append(step.logits[0, -1])
    kv = model.new_kv_cache(num_blocks=32, block_size=4)
    table = list(range(32))
    got = [run_rows(model, kv, [RowSpec(0, 60, table, True)], ids[:60])[-1]]
    got += [run_rows(model, kv, [RowSpec(p, 1, table, True)], ids[p : p + 1])[0] for p in range(60, 70)]
    torch.testing.assert_close(torch.stack(got), torch.stack(expect).float(), atol=1e-4, rtol=0)
    long_only = dataclasses.replace(model.opts.ropes[0], long_from=1 << 30)  # never switching: must differ
    model.opts = dataclasses.replace(model.opts, ropes=(long_only,))
    model._grow_rope(128)
    again = run_rows(model, model.new_kv_cache(num_blocks=32, block_size=4), [RowSpec(0, 70, table, True)], ids)
    assert (again[-1] - expect[-1]).abs().max() > 1e-2


RULES: dict[str, list[tuple[str, Callable[[ArchOptions], ArchOptions]]]] = {
    "gemma2": [
        ("norm offset", lambda o: dataclasses.replace(o, norm_offset=0.0)),
        ("gelu", lambda o: dataclasses.replace(o, gelu=False)),
        ("embedding scale", lambda o: dataclasses.replace(o, embed_scale=None)),
        ("sandwich norms", lambda o: dataclasses.replace(o, sandwich_norms=False)),
        ("attention scale", lambda o: dataclasses.replace(o, attn_scale=32**-0.5)),
        ("attention soft-cap", lambda o: dataclasses.replace(o, attn_softcap=None)),
        ("final soft-cap", lambda o: dataclasses.replace(o, final_softcap=None)),
        ("windows", lambda o: dataclasses.replace(o, layer_window=(None,) * len(o.layer_window))),
    ],
    "gemma3": [
        ("qk-norm", lambda o: dataclasses.replace(o, qk_norm=False)),
        ("local rope base", lambda o: dataclasses.replace(o, layer_rope=(0,) * len(o.layer_rope))),
        ("global rope scaling", lambda o: dataclasses.replace(
            o, ropes=(Rope(tuple(f * 8 for f in o.ropes[0].inv_freq)), *o.ropes[1:]))),
        ("windows", lambda o: dataclasses.replace(o, layer_window=(None,) * len(o.layer_window))),
    ],
    "qwen3": [("qk-norm", lambda o: dataclasses.replace(o, qk_norm=False))],
    "mistral-window": [("windows", lambda o: dataclasses.replace(o, layer_window=(None,) * len(o.layer_window)))],
    "phi3": [
        ("windows", lambda o: dataclasses.replace(o, layer_window=(None,) * len(o.layer_window))),
        ("longrope attention factor", lambda o: dataclasses.replace(
            o, ropes=(dataclasses.replace(o.ropes[0], scale=1.0),))),
    ],
    "llama3-rope": [("llama3 rope scaling", lambda o: dataclasses.replace(
        o, ropes=(Rope(tuple(1 / 10000 ** (i / 16) for i in range(0, 16, 2))),)))],
}


@pytest.mark.parametrize(("case", "rule"), [(c, i) for c, rules in sorted(RULES.items()) for i in range(len(rules))],
                         ids=[f"{c}-{r[0]}" for c, rules in sorted(RULES.items()) for r in rules])
def test_each_rule_matters(case: str, rule: int, checkpoints: Callable[[str], tuple[Path, Any]],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """With one rule of the architecture turned off, the logits leave transformers' by far more than the
    agreement tests' tolerance: each agreement test above fails if that rule is removed."""
    d, ref = checkpoints(case)
    name, off = RULES[case][rule]
    real = llama.arch_options
    monkeypatch.setattr(llama, "arch_options", lambda cfg: off(real(cfg)))
    _, paged = _paged_logits(load_model(d, dtype="float32").model)
    gap = (paged - ref_logits(ref, _prompt(23))).abs().max().item()
    assert gap > 1e-2, f"{case}: turning off {name} moved the logits by only {gap}"


def test_native_kernels_are_refused_for_options_they_lack(
    checkpoints: Callable[[str], tuple[Path, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The fused native CPU kernels implement Llama's forward only: a model with windows, soft-caps or extra norms
    runs the torch path even where they are available."""
    from tickloom.engine.model import native
    from tickloom.engine.model.checkpoint import check_tensors, read_safetensors

    monkeypatch.setattr(native, "available", lambda: True)
    built = {}
    dirs = {case: checkpoints(case)[0] for case in ("mistral-window", "gemma2", "qwen3")}
    dirs["llama"] = write_tiny_model(tmp_path / "llama", head_dim=32)
    for case, d in dirs.items():
        cfg = ModelConfig.from_file(d / "config.json")
        tensors, origin = read_safetensors(d)
        built[case] = llama.LlamaModel(cfg, check_tensors(cfg, tensors, origin, d), torch.bfloat16,
                                       torch.device("cpu"))._native
    assert built == {"mistral-window": False, "gemma2": False, "qwen3": False, "llama": True}


def test_longrope_long_factors_matter(checkpoints: Callable[[str], tuple[Path, Any]]) -> None:
    d, _ = checkpoints("phi3")
    model = load_model(d, dtype="float32").model
    rope = model.opts.ropes[0]
    assert rope.long_inv_freq is not None and rope.long_from == 64
    assert rope.scale == pytest.approx(math.sqrt(1 + math.log(256 / 64) / math.log(64)))
    assert rope.long_inv_freq != rope.inv_freq


def test_multimodal_gemma3_runs_its_text_part(tmp_path: Path) -> None:
    """Gemma 3 4B and up are ``Gemma3ForConditionalGeneration`` (a vision tower and a language model): tickloom
    reads the language model's config (``text_config`` over transformers' defaults) and weights, and its logits
    on text are the multimodal model's."""
    text = {**COMMON, "num_hidden_layers": 6, "sliding_window": 5, "query_pre_attn_scalar": 32,
            "model_type": "gemma3_text"}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    boi_token_index=500, eoi_token_index=501, image_token_index=502)
    torch.manual_seed(11)
    ref = transformers.Gemma3ForConditionalGeneration(cfg).float().eval()
    _randomize(ref, "gemma3_text")
    ref.save_pretrained(str(tmp_path))
    _write_tokenizer(tmp_path)
    lm = load_model(tmp_path, dtype="float32")
    assert lm.config.architecture == "gemma3" and lm.config.num_layers == 6 and lm.config.rope_local_theta == 10000.0
    one, paged = _paged_logits(lm.model)
    expect = ref_logits(ref, _prompt(23))
    torch.testing.assert_close(one, expect, atol=1e-4, rtol=0)
    torch.testing.assert_close(paged, expect, atol=1e-4, rtol=0)


def test_multimodal_gemma3_config_takes_text_defaults() -> None:
    cfg = ModelConfig.from_hf_dict({"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
                                    "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                                                    "num_hidden_layers": 34, "sliding_window": 1024,
                                                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}})
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262_208)
    assert cfg.eos_token_ids == (1, 106) and cfg.tie_word_embeddings and cfg.rope_theta == 1e6
    assert cfg.layer_types.count("full_attention") == 5 and cfg.sliding_window == 1024


# --- configs -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_round_trips_through_its_config_json(case: str, checkpoints: Callable[[str], tuple[Path, Any]]) -> None:
    d, _ = checkpoints(case)
    cfg = ModelConfig.from_file(d / "config.json")
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    # transformers reads tickloom's config.json as the same model
    again = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"})
    assert ModelConfig.from_hf_dict({**again.to_dict(), "architectures": cfg.to_hf_dict()["architectures"]}) == cfg


@pytest.mark.parametrize(("family", "extra"), [
    ("qwen3", {"head_dim": 32}),
    ("mistral", {"options": (("sliding_window", 6), ("layer_types", ("sliding_attention",) * 2))}),
    ("gemma2", {"num_layers": 4, "tie_word_embeddings": True}), ("gemma3", {"num_layers": 6, "head_dim": 32}),
    ("phi3", {}),
])
def test_tiny_models_of_each_family_are_transformers_models(family: str, extra: dict[str, Any],
                                                            tmp_path: Path) -> None:
    """``write_tiny_model`` writes any family, and its config.json (``to_hf_dict``: also what a GGUF's conversion
    writes) means to transformers what it means to tickloom."""
    d = write_tiny_model(tmp_path / family, architecture=family, seed=4, **extra)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    assert type(ref).__name__ == ModelConfig.from_file(d / "config.json").to_hf_dict()["architectures"][0]
    one, paged = _paged_logits(load_model(d, dtype="float32").model)
    expect = ref_logits(ref, _prompt(23))
    torch.testing.assert_close(one, expect, atol=1e-4, rtol=0)
    torch.testing.assert_close(paged, expect, atol=1e-4, rtol=0)


def test_llama_and_qwen2_configs_keep_their_fingerprint_fields() -> None:
    """A Llama or Qwen2 config's ``to_dict`` (hashed into the weight fingerprint) has no new keys."""
    cfg = ModelConfig.from_hf_dict({**COMMON, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 2})
    assert set(cfg.to_dict()) == {
        "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
        "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
        "attention_bias", "rope_scaling", "bos_token_id", "eos_token_ids"}


def _raw(arch: str, **extra: Any) -> dict[str, Any]:
    return {**COMMON, "num_hidden_layers": 2, "architectures": [arch], **extra}


@pytest.mark.parametrize(("raw", "message"), [
    (_raw("MambaForCausalLM"), r"unsupported architecture 'MambaForCausalLM'; supported: \['Gemma2ForCausalLM'"),
    ({**COMMON, "num_hidden_layers": 2, "model_type": "falcon"}, r"unsupported architecture 'falcon'; supported:"),
    (_raw("Phi3ForCausalLM", rope_scaling={"type": "yarn", "factor": 4.0}),
     r"unsupported rope scaling type 'yarn'; supported: \['linear', 'llama3', 'longrope'\]"),
    (_raw("Phi3ForCausalLM", rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
     r"longrope short_factor must list 16 numbers"),
    (_raw("Phi3ForCausalLM", partial_rotary_factor=0.75), r"partial_rotary_factor=0.75"),
    (_raw("Gemma3ForCausalLM", use_bidirectional_attention=True), r"use_bidirectional_attention"),
    (_raw("Gemma2ForCausalLM", hidden_activation="relu"), r"unsupported hidden_act 'relu'"),
    (_raw("MistralForCausalLM", sliding_window=4, layer_types=["sliding_attention"]), r"layer_types must list 2"),
])
def test_config_refusals_name_what_is_unsupported(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_dict(raw, "x/config.json")


def test_config_defaults_follow_transformers() -> None:
    """Absent keys mean what they mean to transformers: Mistral's window is 4096, Gemma 2's soft-caps 50 and 30,
    Gemma 3's local rope base 10000 and every sixth layer global; Phi-3's "su" is LongRoPE."""
    m = ModelConfig.from_hf_dict(_raw("MistralForCausalLM"))
    assert m.sliding_window == 4096 and set(m.layer_types) == {"sliding_attention"}
    assert ModelConfig.from_hf_dict(_raw("MistralForCausalLM", sliding_window=None)).sliding_window is None
    g2 = ModelConfig.from_hf_dict(_raw("Gemma2ForCausalLM"))
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
    assert g2.layer_types == ("sliding_attention", "full_attention") and g2.tie_word_embeddings
    g3 = ModelConfig.from_hf_dict(_raw("Gemma3ForCausalLM", num_hidden_layers=12, rope_theta=1e6,
                                       rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert g3.rope_local_theta == 10000.0 and g3.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert [i for i, t in enumerate(g3.layer_types) if t == "full_attention"] == [5, 11]
    assert g3.attn_logit_softcapping is None
    su = ModelConfig.from_hf_dict(_raw("Phi3ForCausalLM", original_max_position_embeddings=64, rope_scaling={
        "type": "su", "short_factor": [1.0] * HALF, "long_factor": [2.0] * HALF}))
    assert su.rope_scaling is not None and su.rope_scaling["rope_type"] == "longrope"
    assert su.rope_scaling["original_max_position_embeddings"] == 64
    assert ModelConfig.from_hf_dict(_raw("Qwen3ForCausalLM", sliding_window=4)).sliding_window is None
    q = ModelConfig.from_hf_dict(_raw("Qwen3ForCausalLM", sliding_window=4, use_sliding_window=True,
                                      max_window_layers=1))
    assert q.layer_types == ("full_attention", "sliding_attention")
