"""The prompt's side of an answer: ``echo`` on ``/v1/completions`` (the prompt's tokens and logprobs first, in
OpenAI's legacy form, as lm-evaluation-harness's ``local-completions`` reads them to score log-likelihoods) and
``prompt_logprobs`` in vLLM's form.

The engine reports each prompt position's logprobs (``RequestOutput.prompt_logprobs``: None for the first, then the
top-k alternatives and the prompt's own token, keyed by id) but not which key is the prompt's token when it is among
the top k: the server tokenizes the prompt itself, exactly as the engine does (``engine_prompts``: ``tickloom.prompts``,
the same tokenizer, the same truncation), and submits those ids; the two must agree in length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tickloom import RequestRejected
from tickloom.prompts import Prompt, text_prompt_ids
from tickloom.tools.serve.openai_types import CompletionLogprobs, OpenAIError, PromptLogprob
from tickloom.tools.serve.openai_types import PromptLogprobs as WirePromptLogprobs
from tickloom.tools.serve.translate import Decode, OpenAIRequest

EnginePromptLogprobs = list[dict[int, float] | None]


@dataclass(frozen=True)
class EchoedPrompt:
    ids: list[int]
    """The prompt's token ids as the engine takes them (truncated as the request says)."""
    text: str
    """The prompt's text: as given, or its tokens decoded (token ids, or a truncated prompt)."""


def engine_prompts(tokenizer: Any, prompts: Sequence[Prompt], req: OpenAIRequest, max_seq_len: int, *,
                   with_text: bool = False, tools: Sequence[dict[str, Any]] | None = None) -> list[EchoedPrompt]:
    """A request's prompts tokenized and truncated as the engine does (``RequestRejected`` names what is wrong):
    the server submits these ids (so a prompt is tokenized once), counts them against ``max_tokens``, and echoes
    them. ``with_text``: each prompt's text too (for ``echo``). ``tools``: a chat's tools, for its template."""
    truncate = req.truncate_prompt_tokens
    keep = max_seq_len - 1 if truncate == -1 else truncate or None  # 0: the engine refuses it
    out = []
    for prompt in prompts:
        ids = text_prompt_ids(tokenizer, prompt, max_seq_len, tools=tools)
        chat = ids is not None and not isinstance(prompt, str)
        if ids is None:
            assert isinstance(prompt, list)
            ids = list(prompt)
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < tokenizer.vocab_size), None)
            if bad is not None:
                raise RequestRejected(f"prompt token id {ids[bad]} at position {bad} is outside "
                                      f"vocab_size={tokenizer.vocab_size}")
        kept = ids if keep is None else ids[-keep:]
        text = ""
        if with_text and not chat:  # chat messages are never echoed
            whole = isinstance(prompt, str) and len(kept) == len(ids)
            text = prompt if whole and isinstance(prompt, str) else tokenizer.decode(kept, req.skip_special_tokens)
        out.append(EchoedPrompt(kept, text))
    return out


def _finite(lp: float) -> float | None:
    return None if lp != lp else lp


def echo_logprobs(prompt: EchoedPrompt, engine_logprobs: EnginePromptLogprobs | None,
                  decode: Decode) -> CompletionLogprobs:
    """The prompt's part of the legacy logprobs: its tokens, each one's logprob (null for the first: nothing
    precedes it), the alternatives with the token itself keyed by text (null for the first), and text offsets."""
    ids = prompt.ids
    if engine_logprobs is None or len(engine_logprobs) != len(ids):
        got = "none" if engine_logprobs is None else f"{len(engine_logprobs)} positions"
        raise OpenAIError(500, f"the engine's prompt logprobs ({got}) do not cover the prompt's {len(ids)} tokens",
                          type="server_error", code="prompt_logprobs_missing")
    tokens = [decode(t) for t in ids]
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for tid, entry in zip(ids, engine_logprobs, strict=True):
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        own = entry.get(tid)
        token_logprobs.append(None if own is None else _finite(own))
        tops.append({decode(alt): lp for alt, lp in entry.items() if lp == lp})
    offsets, offset = [], 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets)


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=first.tokens + then.tokens,
                              token_logprobs=first.token_logprobs + then.token_logprobs,
                              top_logprobs=(first.top_logprobs or []) + (then.top_logprobs or []),
                              text_offset=first.text_offset + then.text_offset)


def prompt_logprobs(engine_logprobs: EnginePromptLogprobs | None, top_k: int,
                    decode: Decode) -> WirePromptLogprobs | None:
    """vLLM's form: per position None (the first) or token id (a str key) -> logprob, rank (1 for the best; None
    for the prompt's token when it is not among the ``top_k``), decoded token."""
    if engine_logprobs is None:
        return None
    out: WirePromptLogprobs = []
    for entry in engine_logprobs:
        if entry is None:
            out.append(None)
            continue
        out.append({str(tid): PromptLogprob(logprob=_finite(lp), rank=rank if rank <= top_k else None,
                                            decoded_token=decode(tid))
                    for rank, (tid, lp) in enumerate(entry.items(), start=1)})
    return out


__all__ = ["EchoedPrompt", "echo_logprobs", "engine_prompts", "joined", "prompt_logprobs"]
