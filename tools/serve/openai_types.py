"""The OpenAI wire schema: request Structs (decoded and validated by msgspec with ``Meta`` bounds), response
Structs, and the error body ``{"error": {"message", "type", "param", "code"}}``.

Validation happens here only for what is OpenAI's own (types, ``n``, the documented ranges of ``temperature``,
``top_p`` and the penalties, ``timeout``); everything else is left to ``SamplingParams`` and ``Engine``, whose
``RequestRejected`` names the field (``tools.serve.translate`` maps that name back to the request's).
The request Structs hold the fields this server honours; ``tools.serve.fields`` adds the ones it refuses, and an
unknown field is a 400 naming it: no field is accepted and ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from tickloom.events.types import MAX_TOP_LOGPROBS
from tickloom.params import MAX_N
from tickloom.request import MAX_CACHE_SALT_CHARS, MAX_REQUEST_ID_CHARS

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


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    """vLLM's usage in every chunk: the prompt's tokens and the request's tokens so far (the last usage chunk has
    the engine's own count, cached tokens included)."""


JsonValue = dict[str, Any]
"""A JSON object as given (a schema, a tool's parameters): checked where it is used."""


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``response_format.json_schema``, as OpenAI has it. A missing ``schema`` asks for any JSON object."""

    name: Annotated[str, Meta(min_length=1, max_length=256)] = "response"
    description: str | None = None
    schema: JsonValue | None = None
    strict: bool | None = None
    """Enforced either way: the engine only samples what the schema allows."""


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's ``response_format``; ``schema`` with ``json_object`` is llama.cpp's form of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema: JsonValue | None = None


class StructuredOutputsField(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` (``StructuredOutputsParams``): one of these is set."""

    json: JsonValue | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Request(msgspec.Struct, kw_only=True):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``. ``None`` means "the default"."""

    model: Annotated[str, Meta(min_length=1, max_length=4096)]
    max_tokens: Annotated[int, Meta(ge=0)] | None = None
    """0 only with ``echo`` (scoring the prompt, as vLLM does); above what ``max_seq_len`` leaves, a 400."""
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
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """Each prompt token's logprob and its top-k alternatives, in vLLM's form (not with ``stream``)."""
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    """Keep the prompt's last k tokens; -1: as many as leave room for one new token."""
    priority: int = 0
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    """Requests share cached prompt blocks only with requests of the same salt."""
    request_id: Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS - 64)] | None = None
    """The answer's id is ``cmpl-<request_id>`` (``chatcmpl-`` for chat), as in vLLM; it must not be in use."""
    timeout: Annotated[float, Meta(gt=0.0, le=MAX_TIMEOUT_S)] | None = None
    """Seconds from submit; the request finishes ``timeout`` when it passes (default: the server's)."""
    # Structured outputs: at most one of these (``tools.serve.structured`` maps them to ``StructuredOutputs``).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: JsonValue | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    grammar: str | None = None
    """llama.cpp's: a GBNF grammar."""
    json_schema: JsonValue | None = None
    """llama.cpp's: a JSON schema."""


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[str | int | list[int]]
    """A string, token ids, or a batch of either (checked by ``prompts``)."""
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    """The prompt first, in the text and (with ``logprobs``) in the logprobs, the first token's logprob null."""
    best_of: Annotated[int, Meta(ge=1)] | None = None
    """Only equal to ``n``."""

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


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's form)."""


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    """None only in an assistant message with ``tool_calls``."""
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant message's calls (an earlier turn of an agent loop)."""
    tool_call_id: str | None = None
    """A ``tool`` message: the call it answers."""


class FunctionDefinition(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    description: str | None = None
    parameters: JsonValue | None = None
    """A JSON schema of the arguments (none: any object)."""
    strict: bool | None = None
    """Enforced either way when the call is required (``tool_choice``); with ``auto`` the call is parsed."""


class Tool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Request, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    include_reasoning: bool = True
    """False: the answer leaves the model's reasoning (``reasoning_content``) out, as in vLLM."""
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: ``auto`` with tools, ``none`` without (``tools.serve.tool_calls``)."""
    parallel_tool_calls: bool | None = None
    """Default true: the model may make several calls in one answer."""


def decode_request(body: bytes, type_: type[Any]) -> Any:
    """Decode and validate a JSON body; a bad one is an ``OpenAIError`` (400) naming the field."""
    if not body.strip():
        raise OpenAIError(400, "the request body is empty: expected a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if _UNKNOWN.search(message):
            message += ": this server does not know that field (it refuses a field rather than ignore it)"
        raise OpenAIError(400, message, param=error_param(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None


_AT = re.compile(r"at `\$\.?(.*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")


def error_param(message: str) -> str | None:
    """``messages[0].role`` from msgspec's ``... - at `$.messages[0].role```; a missing or unknown field's own
    name."""
    missing = _MISSING.search(message) or _UNKNOWN.search(message)
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
    top_logprobs: list[dict[str, float] | None] | None
    """Null for an echoed prompt's first token."""
    text_offset: list[int]


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's ``Logprob``: ``rank`` is 1 for the best token, None for a prompt token outside the top k."""

    logprob: float | None
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's ``prompt_logprobs``: per prompt token, None for the first, then token id (a str key) -> its logprob."""


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = None


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
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    """The calls the model made (``finish_reason`` is then ``tool_calls``); empty otherwise, as in vLLM."""


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
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunction(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One piece of a streamed call: the first has its ``id``, ``type`` and name, the later ones argument text
    (the client joins the pieces of one ``index``)."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
    created: int
    """When the server started serving it (Unix seconds)."""
    max_model_len: int
    root: str
    """The model the engine loaded (``EngineConfig.model``)."""
    object: str = "model"
    owned_by: str = "tickloom"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


# -- tokenizer endpoints (vLLM's ``/tokenize`` and ``/detokenize``) --------------------------------------------------


class TokenizeCompletion(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    model: str | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[Annotated[int, Meta(ge=0)]]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class Version(msgspec.Struct, kw_only=True):
    version: str
