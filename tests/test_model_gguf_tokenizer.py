"""SentencePiece GGUF tokenizers (the "llama" tokenizer model of Llama 2, Mistral, Gemma and Phi-3 files) are read
as a byte-fallback BPE whose merges follow llama.cpp's rule, with and without the space prefix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from arch_gguf import spm_reference, write_spm_gguf

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.mark.parametrize("add_prefix", [True, False])
def test_sentencepiece_gguf_tokenizer_matches_llama_cpp_rules(add_prefix: bool, tmp_path: Path) -> None:
    from tickloom.engine.model.gguf_loader import gguf_tokenizer, open_gguf

    g = write_spm_gguf(tmp_path / "spm.gguf", add_prefix)
    tok, tok_cfg = gguf_tokenizer(g, open_gguf(g))
    assert tok_cfg["bos_token"] == "<s>" and tok_cfg["eos_token"] == "</s>"
    texts = ["hello world", "the  hello", "hello", "Hello wörld", "a<start_of_turn>hello the",
             "llo he", "", "  the", "héllo 🙂"]
    for text in texts:
        got = tok.encode(text).ids
        assert got == [1, *spm_reference(text, add_prefix)], text
        if "<start" not in text:
            assert tok.decode(got, skip_special_tokens=True) == text
