"""Which request fields this server honours and which it refuses: one table, so no field is accepted and ignored.

A request body is decoded into its endpoint's wire type (``CHAT_WIRE``, ``COMPLETION_WIRE``): the request Struct of
``openai_types`` (its fields are the honoured ones: each reaches the engine or shapes the answer), extended with
every field of ``REFUSED`` as an untyped field. Anything else is an unknown field, and msgspec refuses it. After
decoding, ``check_refused`` answers a 400 naming the first refused field whose value asks for something (a value
among its ``neutral`` ones asks for nothing: ``"tools": []``, ``"add_generation_prompt": true``).

The list of fields follows vLLM's OpenAI request models (``ChatCompletionRequest``, ``CompletionRequest``) and
OpenAI's own; ``tests/test_serve_fields.py`` sends every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from tickloom.tools.serve.openai_types import ChatCompletionRequest, CompletionRequest, OpenAIError

BACKEND = "the grammar engine is the server's own (llguidance)"
LEGACY_FUNCTIONS = "the deprecated functions API is not supported: use tools and tool_choice"


@dataclass(frozen=True)
class Refused:
    """A field this server does not do: ``why`` says so; a value in ``neutral`` asks for nothing and is accepted."""

    why: str
    neutral: tuple[Any, ...] = (None,)


_BOTH = "both"
_CHAT = "chat"
_COMPLETION = "completion"

REFUSED: tuple[tuple[str, str, Refused], ...] = (
    # Structured outputs and tools: the constraint itself is honoured (``tools.serve.structured``), not these.
    ("guided_decoding_backend", _BOTH, Refused(f"{BACKEND}: guided_decoding_backend is not supported",
                                               (None, "auto", "guidance"))),
    ("guided_whitespace_pattern", _BOTH, Refused("a whitespace pattern for JSON is not supported")),
    ("structural_tag", _BOTH, Refused("structural tags are not supported")),
    ("functions", _CHAT, Refused(LEGACY_FUNCTIONS, (None, []))),
    ("function_call", _CHAT, Refused(LEGACY_FUNCTIONS, (None, "none"))),
    # Chat templating: the engine renders every conversation with its generation prompt, nothing else.
    ("add_generation_prompt", _CHAT, Refused("the chat template always adds the generation prompt", (None, True))),
    ("continue_final_message", _CHAT, Refused("continuing the final message is not supported", (None, False))),
    ("echo", _CHAT, Refused("echoing the last message in chat is not supported (echo is a /v1/completions field)",
                            (None, False))),
    ("chat_template", _CHAT, Refused("a per-request chat template is not supported")),
    ("chat_template_kwargs", _CHAT, Refused("chat template arguments are not supported", (None, {}))),
    ("documents", _CHAT, Refused("documents for the chat template are not supported", (None, []))),
    ("reasoning_effort", _CHAT, Refused("reasoning effort is not supported")),
    ("add_special_tokens", _BOTH, Refused("the engine tokenizes as the model's template says: with special tokens "
                                          "for text, without (the template has them) for chat", (None,))),
    # Sampling the engine does not do.
    ("use_beam_search", _BOTH, Refused("beam search is not supported", (None, False))),
    ("length_penalty", _BOTH, Refused("length_penalty applies to beam search, which is not supported", (None, 1.0))),
    ("bad_words", _BOTH, Refused("bad_words is not supported", (None, []))),
    ("logits_processors", _BOTH, Refused("custom logits processors are not supported", (None, []))),
    ("spaces_between_special_tokens", _BOTH, Refused("the tokenizer decodes special tokens as it is", (None, True))),
    ("best_of", _CHAT, Refused("best_of is not supported", (None, 1))),
    ("suffix", _COMPLETION, Refused("suffix (insertion) is not supported", (None, ""))),
    # Inputs and outputs the server does not take or give.
    ("prompt_embeds", _COMPLETION, Refused("prompt embeddings are not supported")),
    ("mm_processor_kwargs", _BOTH, Refused("multimodal inputs are not supported", (None, {}))),
    ("return_tokens_as_token_ids", _BOTH, Refused("tokens as 'token_id:N' are not supported", (None, False))),
    ("return_token_ids", _BOTH, Refused("returning token ids is not supported", (None, False))),
    ("kv_transfer_params", _BOTH, Refused("disaggregated serving is not supported")),
    ("vllm_xargs", _BOTH, Refused("vLLM's extension arguments are not supported", (None, {}))),
    # OpenAI's own, with no meaning here.
    ("modalities", _CHAT, Refused("only text output is supported", (None, ["text"]))),
    ("audio", _CHAT, Refused("audio output is not supported")),
    ("prediction", _CHAT, Refused("predicted outputs are not supported")),
    ("web_search_options", _CHAT, Refused("web search is not supported")),
    ("store", _CHAT, Refused("stored completions are not supported", (None, False))),
    ("metadata", _CHAT, Refused("metadata is kept only with stored completions, which are not supported",
                                (None, {}))),
    ("service_tier", _BOTH, Refused("service tiers are not supported", (None, "auto", "default"))),
    ("add_special_tokens", _COMPLETION, Refused("text prompts are always tokenized with the model's special tokens",
                                                (None, True))),
)
"""(field, the endpoints that know it, its refusal); a field may have one entry per endpoint."""


def refused_fields(chat: bool) -> dict[str, Refused]:
    """The refused fields of one endpoint (less any the request Struct honours: best_of on /v1/completions)."""
    own = ChatCompletionRequest if chat else CompletionRequest
    kinds = (_BOTH, _CHAT if chat else _COMPLETION)
    return {name: rule for name, kind, rule in REFUSED if kind in kinds and name not in own.__struct_fields__}


def _wire(base: type[Any], chat: bool) -> type[Any]:
    fields = [(name, Any, msgspec.UNSET) for name in refused_fields(chat)]
    return msgspec.defstruct(base.__name__, fields, bases=(base,), kw_only=True, forbid_unknown_fields=True)


CHAT_WIRE: type[Any] = _wire(ChatCompletionRequest, chat=True)
"""What ``/v1/chat/completions`` decodes: a ``ChatCompletionRequest`` that also holds the refused fields."""
COMPLETION_WIRE: type[Any] = _wire(CompletionRequest, chat=False)
"""What ``/v1/completions`` decodes: a ``CompletionRequest`` that also holds the refused fields."""

_REFUSED_BY_WIRE = {CHAT_WIRE: refused_fields(True), COMPLETION_WIRE: refused_fields(False)}


def honoured_fields(chat: bool) -> tuple[str, ...]:
    """The fields this server acts on (the request Struct's own)."""
    return (ChatCompletionRequest if chat else CompletionRequest).__struct_fields__


def check_refused(req: Any) -> None:
    """A 400 naming the first refused field whose value asks for something this server does not do."""
    for name, rule in _REFUSED_BY_WIRE.get(type(req), {}).items():
        value = getattr(req, name)
        if value is msgspec.UNSET or any(_same(value, n) for n in rule.neutral):
            continue
        raise OpenAIError(400, f"{name} is not supported by this server: {rule.why}", param=name,
                          code="unsupported_field")


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality: ``1 == 1.0``, but ``true`` is no number and ``0`` no ``false``."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return bool(value == neutral)


__all__ = ["CHAT_WIRE", "COMPLETION_WIRE", "REFUSED", "Refused", "check_refused", "honoured_fields",
           "refused_fields"]
