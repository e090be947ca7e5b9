"""The stub model: a model-free executor with ``ModelExecutor``'s interface, whose tokens come from a pure oracle,
and its tokenizer.

``EngineConfig(model="stub")`` runs it (``tickloom generate --model stub``, the benchmarks, the explorer, and the
engine tests under ``MockClock``, where ``actors.device.StubDevice`` plays its steps in virtual time). It is a
model the engine offers, not a test double, so it lives in the model room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tickloom.engine.model.tables import BoundRequests, proposal_slots
from tickloom.engine.model.types import HostKV, StepResult
from tickloom.events import SamplingSpec
from tickloom.events.commands import BindRequest, RunStep
from tickloom.events.oracle import OracleRow, oracle_accept_count, oracle_fill_count, oracle_step, oracle_token


def token_for(seed: int, output_index: int, vocab_size: int = 32000) -> int:
    """The stub's token for output ``output_index`` of a request with ``seed``: the oracle's (``events.oracle``), so
    a run on this executor and a run of the core's tests agree token for token."""
    return oracle_token(seed, output_index, vocab_size)


@dataclass(slots=True)
class _StubRequest:
    seed: int
    prompt_len: int
    spec: SamplingSpec | None = None
    prompt: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)


class StubExecutor(BoundRequests[_StubRequest]):
    """Same methods as ``ModelExecutor``; no tensors. ``copy_out``/``copy_in`` move no data.

    Its tokens and logprobs are the oracle's (``events.oracle.oracle_step``), biases and allowed tokens applied,
    never one of ``avoid`` (the stub device avoids EOS: pass the same to re-run its logs), so they equal the stub
    device's token for token.
    """

    def __init__(self, vocab_size: int = 32000, num_blocks: int = 1024, block_size: int = 16,
                 avoid: tuple[int, ...] = ()) -> None:
        super().__init__(block_size)
        self.vocab_size = vocab_size
        self.num_blocks = num_blocks
        self.avoid = avoid
        self.steps_run = 0
        self._spilled_blocks: dict[str, int] = {}
        """request id -> how many blocks its last ``copy_out`` copied."""

    def bind(self, command: BindRequest) -> None:
        self._requests[command.request_id] = _StubRequest(command.seed, command.prompt_len, command.params,
                                                          list(command.prompt_token_ids))

    def run_step(self, step: RunStep) -> StepResult:
        """Oracle tokens for the sampling rows. A row with proposal slots accepts a stable number of them
        (``events.oracle.oracle_accept_count``, as if a proposer had guessed that many of the oracle's next tokens),
        so its output is the same with or without speculation."""
        states = self.start_step(step)
        rows = [OracleRow(st.seed, k, st.spec, st.prompt)
                for st, k in zip(states, step.sample_indices, strict=True) if k >= 0]
        self.steps_run += 1
        out = oracle_step(rows, self.vocab_size, self.avoid)
        result = StepResult(out.token_ids, *out.columns)
        slots = [n for n, k in zip(proposal_slots(step), step.sample_indices, strict=True) if k >= 0]
        if any(slots):
            extras = [[oracle_step([row._replace(output_index=row.output_index + 1 + j)], self.vocab_size,
                                   self.avoid).token_ids[0]
                       for j in range(oracle_accept_count(row.seed, row.output_index, n))]
                      for row, n in zip(rows, slots, strict=True)]
            result.extra_token_ids = extras if any(extras) else None
            result.proposed = [oracle_fill_count(row.seed, row.output_index, n) if n else 0
                               for row, n in zip(rows, slots, strict=True)]
        return result

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._spilled_blocks.pop(request_id, None)

    def copy_out(self, request_id: str, block_ids: list[int], num_tokens: int) -> HostKV:
        if request_id not in self._requests:
            raise KeyError(request_id)
        self._spilled_blocks[request_id] = len(block_ids)
        return HostKV(None, None, num_tokens)

    def copy_in(self, request_id: str, block_ids: list[int], host_kv: HostKV) -> None:
        # The stub holds no KV, but keeps the real cache's rule (``PagedKVCache.copy_blocks_in``), so that the
        # actor tests catch a swap-in that brings fewer blocks than its spill copied.
        spilled = self._spilled_blocks.pop(request_id, 0)
        if spilled > len(block_ids):
            raise ValueError(f"host KV holds {spilled} blocks, only {len(block_ids)} block ids given")
        self._requests[request_id].block_table[:] = list(block_ids)


class StubTokenizer:
    """The stub model's tokenizer: one token per printable ASCII character (ids 0-94 are ``' '``-``'~'``), the last
    id of the vocabulary as EOS, and any other text (newlines, tabs, emoji: anything UTF-8 can encode) as escapes.

    An escape is three tokens per UTF-8 byte: EOS, then the byte's two hex digits (``"\\n"`` is EOS ``0`` ``a``).
    EOS marks it because the stub never generates EOS (its device avoids it), so generated text decodes one
    character per token as before and only prompts carry escapes; ``decode(encode(text)) == text`` for any text.
    """

    def __init__(self, vocab_size: int = 96) -> None:
        if vocab_size < 96:
            raise ValueError(f"the stub tokenizer needs vocab_size >= 96, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_id = vocab_size - 1
        self.bos_token_id: int | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        for char in text:
            if " " <= char <= "~":
                ids.append(ord(char) - 32)
                continue
            try:
                raw = char.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"the stub tokenizer encodes text UTF-8 can encode, not {char!r}") from None
            for byte in raw:
                ids += [self.eos_token_id, _HEX_IDS[byte >> 4], _HEX_IDS[byte & 15]]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        escaped = bytearray()
        i = 0
        while i < len(ids):
            token = ids[i]
            byte = self._escaped_byte(ids, i)
            if byte is not None:
                escaped.append(byte)
                i += 3
                continue
            if escaped:
                parts.append(escaped.decode("utf-8", errors="replace"))
                escaped.clear()
            parts.append(chr(token + 32) if token < 95 else ("" if skip_special_tokens else "</s>"))
            i += 1
        if escaped:
            parts.append(escaped.decode("utf-8", errors="replace"))
        return "".join(parts)

    def _escaped_byte(self, ids: Sequence[int], i: int) -> int | None:
        """The byte escaped at ``ids[i:i + 3]`` (EOS and two hex digits), or None if no escape starts there."""
        if ids[i] != self.eos_token_id or i + 2 >= len(ids):
            return None
        high, low = _HEX_VALUES.get(ids[i + 1]), _HEX_VALUES.get(ids[i + 2])
        return None if high is None or low is None else high * 16 + low

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        text = " ".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + (" <assistant>" if add_generation_prompt else "")


_HEX_IDS = [ord(c) - 32 for c in "0123456789abcdef"]
"""The token ids of the hex digits an escaped byte is written with."""

_HEX_VALUES = {token: value for value, token in enumerate(_HEX_IDS)}
