"""The stub model's tokenizer: printable ASCII, one token per character, and an EOS.

With ``EngineConfig(model="stub")`` the engine runs the core's oracle instead of a model, so engine tests can
drive every actor under ``MockClock`` in milliseconds. Ids 0–94 are the characters ``' '``–``'~'``; the last id
of the vocabulary is EOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class StubTokenizer:
    def __init__(self, vocab_size: int = 96) -> None:
        if vocab_size < 96:
            raise ValueError(f"the stub tokenizer needs vocab_size >= 96, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_id = vocab_size - 1
        self.bos_token_id: int | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        bad = [c for c in text if not " " <= c <= "~"]
        if bad:
            raise ValueError(f"the stub tokenizer encodes printable ASCII only, not {bad[0]!r}")
        return [ord(c) - 32 for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i + 32) if i < 95 else ("" if skip_special_tokens else "</s>") for i in ids)

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        text = " ".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + (" <assistant>" if add_generation_prompt else "")
