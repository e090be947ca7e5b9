"""The OpenAI wire schema: request Structs (decoded and validated by msgspec with ``Meta`` bounds), response
Structs, and the error body ``{"error": {"message", "type", "param", "code"}}``.

Validation happens here only for what is OpenAI's own (types, ``n``, the documented ranges of ``temperature``,
``top_p`` and the penalties, ``timeout``); everything else is left to ``SamplingParams`` and ``Engine``, whose
``RequestRejected`` names the field (``tools.serve.translate`` maps that name back to the request's).
Unknown request fields are ignored, as OpenAI's SDKs send fields this server may not know.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from tickloom.params import MAX_N

MAX_TIMEOUT_S = 1e9

NonNegInt = Annotated[int, Meta(ge=0)]


class OpenAIError(Exception):
    """An error answered as OpenAI error JSON with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body_struct(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))

    def body(self) -> bytes:
        return msgspec.json.encode(self.body_struct())


class ErrorBody(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorBody


# -- requests ------------------------------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Request(msgspec.Struct, kw_only=True):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``. ``None`` means "the default"."""

    model: Annotated[str, Meta(min_length=1, max_length=4096)]
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions, as vLLM names them.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    timeout: Annotated[float, Meta(gt=0.0, le=MAX_TIMEOUT_S)] | None = None
    """Seconds from submit; the request finishes ``timeout`` when it passes (default: the server's)."""


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[str | int | list[int]]
    """A string, token ids, or a batch of either (checked by ``prompts``)."""
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Meta(ge=1)] | None = None

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one for a string or a token-id list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [[x for x in p if isinstance(x, int)]]
        if all(isinstance(x, str) for x in p):
            return [x for x in p if isinstance(x, str)]
        if all(isinstance(x, list) for x in p):
            return [x for x in p if isinstance(x, list)]
        raise OpenAIError(400, "prompt must be a string, a list of token ids, or a list of either, not a mix",
                          param="prompt")


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Request, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


def decode_request(body: bytes, type_: type[Any]) -> Any:
    """Decode and validate a JSON body; a bad one is an ``OpenAIError`` (400) naming the field."""
    if not body.strip():
        raise OpenAIError(400, "the request body is empty: expected a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise OpenAIError(400, str(exc), param=error_param(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None


_AT = re.compile(r"at `\$\.?(.*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def error_param(message: str) -> str | None:
    """``messages[0].role`` from msgspec's ``... - at `$.messages[0].role```; a missing field's own name."""
    missing = _MISSING.search(message)
    at = _AT.search(message)
    path = at.group(1) if at is not None else ""
    if missing is not None:
        return f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


# -- responses -----------------------------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int


class CompletionTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float | None
    bytes: list[int]


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float | None
    """None where the model reported none (the stub model reports none)."""
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob]


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct, kw_only=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    system_fingerprint: str | None = None


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None
    system_fingerprint: str | None = None


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "tickloom"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"
