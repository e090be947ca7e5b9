"""Between the OpenAI schema and the engine: requests to ``SamplingParams``, the engine's ``RequestRejected`` to an
OpenAI error naming the request's field, and ``RequestOutput`` frames to choices, logprobs and usage."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tickloom import EngineError, EngineOverloaded, RequestOutput, RequestRejected, SamplingParams
from tickloom.tools.serve import fields, structured, tool_calls
from tickloom.tools.serve.backend import ReplicaUnavailable
from tickloom.tools.serve.openai_types import (
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    CompletionTokensDetails,
    ContentPart,
    OpenAIError,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)

Decode = Callable[[int], str]
"""One token id's text (special tokens included), for logprobs."""

OpenAIRequest = CompletionRequest | ChatCompletionRequest


def check_supported(req: OpenAIRequest) -> None:
    """Refuse what depends on a field's value or on two fields together, naming the field; the fields this server
    never does are refused by the table in ``tools.serve.fields``."""
    fields.check_refused(req)
    structured.constraint(req)  # two constraints at once, or a malformed one, are a 400 naming the field
    if req.stream and req.prompt_logprobs is not None:
        raise OpenAIError(400, "prompt_logprobs are not available with stream=true", param="prompt_logprobs")
    if isinstance(req, CompletionRequest):
        if req.max_tokens == 0 and not req.echo:
            raise OpenAIError(400, "max_tokens=0 asks for no token: it is only for scoring the prompt, with echo=true",
                              param="max_tokens")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError(400, "best_of other than n is not supported", param="best_of")
    else:
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise OpenAIError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
        if req.max_tokens == 0:
            raise OpenAIError(400, "max_tokens must be at least 1", param="max_tokens")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the engine takes them: text content (text parts joined), ``developer`` as ``system``; an
    assistant's earlier ``tool_calls`` (its content may be null) with their arguments as JSON objects, as chat
    templates read them (text that is no JSON object stays text), and ``tool`` messages with their
    ``tool_call_id``."""
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise OpenAIError(400, "only an assistant message has tool_calls", param=f"messages[{i}].tool_calls")
        if m.role == "tool" and m.tool_call_id is None:
            raise OpenAIError(400, "a tool message needs the tool_call_id of the call it answers",
                              param=f"messages[{i}].tool_call_id")
        if m.content is None and not m.tool_calls:
            raise OpenAIError(400, "a message needs content", param=f"messages[{i}].content")
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": _text(m.content, i)}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type,
                                      "function": {"name": c.function.name,
                                                   "arguments": _arguments(c.function.arguments)}}
                                     for c in m.tool_calls]
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
        messages.append(message)
    return messages


def _text(content: str | list[ContentPart] | None, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise OpenAIError(400, f"content part type {part.type!r} is not supported (text only)",
                              param=f"messages[{i}].content[{j}]")
        parts.append(part.text)
    return "".join(parts)


def _arguments(text: str) -> dict[str, Any] | str:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def chat_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the chat template is given (none with ``tool_choice="none"``)."""
    tool_plan = tool_calls.plan(req)
    return None if tool_plan is None else tool_plan.template_tools()


def sampling_params(req: OpenAIRequest, default_max_tokens: int, max_seq_len: int) -> SamplingParams:
    """The params of one prompt's ``n`` choices (the engine seeds choice ``j`` with ``seed + j``). A ``max_tokens``
    no prompt leaves room for (``max_seq_len - 1``) is a 400, as in vLLM, not a silent cap. ``echo`` with
    ``logprobs`` asks the engine for the prompt's logprobs too; ``max_tokens=0`` with ``echo`` asks for one token,
    which the answer leaves out (vLLM's echo-only scoring). ``RequestRejected`` names the engine's field."""
    kw: dict[str, Any] = {}
    max_tokens, name = req.max_tokens, "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is not None and max_tokens > max_seq_len - 1:
        raise OpenAIError(400, f"{name}={max_tokens} is more than this model's context allows: max_seq_len="
                               f"{max_seq_len} tokens, the prompt's included, so at most {max_seq_len - 1} new "
                               "tokens", param=name)
    kw["max_tokens"] = default_max_tokens if max_tokens is None else max(max_tokens, 1)
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                "repetition_penalty", "min_tokens", "stop", "stop_token_ids", "allowed_token_ids",
                "prompt_logprobs", "truncate_prompt_tokens"):
        value = getattr(req, key)
        if value is not None:
            kw[key] = value
    if req.seed is not None:
        kw["seed"] = req.seed
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None:
            kw["logprobs"] = req.logprobs
            if req.echo and req.prompt_logprobs is None:
                kw["prompt_logprobs"] = req.logprobs
    elif req.logprobs:
        kw["logprobs"] = req.top_logprobs or 0
    if req.logit_bias:
        kw["logit_bias"] = logit_bias(req.logit_bias)
    found = structured.constraint(req)
    if found is not None:
        kw["structured"] = found[1]
    return SamplingParams(n=req.n, ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
                          skip_special_tokens=req.skip_special_tokens, **kw)


def check_room(req: OpenAIRequest, prompt_tokens: int, max_seq_len: int) -> None:
    """A ``max_tokens`` the prompt leaves no room for is a 400 naming it, as in vLLM (the engine would stop at
    ``max_seq_len`` and answer ``length``); a default ``max_tokens`` fills what the prompt leaves."""
    max_tokens, name = req.max_tokens, "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None or prompt_tokens >= max_seq_len:  # a prompt too long: the engine names it
        return
    if prompt_tokens + max(max_tokens, 1) > max_seq_len:
        raise OpenAIError(400, f"this model's context is max_seq_len={max_seq_len} tokens, but the request asks "
                               f"for {prompt_tokens + max_tokens}: {prompt_tokens} in the prompt and {name}="
                               f"{max_tokens}; ask for at most {max_seq_len - prompt_tokens}", param=name)


def logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) with int keys; a key that is no id is a 400."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not re.fullmatch(r"\d{1,10}", key):
            raise OpenAIError(400, f"logit_bias keys are token ids, not {key!r}", param="logit_bias")
        out[int(key)] = value
    return out


_FIELD = re.compile(r"^(SamplingParams|request)(?:\.(\w+)|: .*at `\$\.(\w+))")
_RENAMED = {"deadline": "timeout"}


def rejected(exc: RequestRejected, req: OpenAIRequest) -> OpenAIError:
    """The engine's refusal as a 400 whose ``param`` is the request's name for the field the engine named."""
    message = str(exc)
    prompt_field = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    param: str | None = None
    found = _FIELD.search(message)
    if found is not None:
        name = found.group(2) or found.group(3)
        param = _RENAMED.get(name, name)
        if name == "structured":
            source = structured.constraint(req)
            param = "tools" if source is not None and source[0] == "tool_choice" else source and source[0]
        elif name == "max_tokens" and isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
            param = "max_completion_tokens"
        elif name == "logprobs" and isinstance(req, ChatCompletionRequest):
            param = "top_logprobs"
    elif re.match(r"^(the )?prompt\b", message):
        param = prompt_field
    elif message.startswith("request_id="):
        param = "request_id"
    return OpenAIError(400, message, param=param)


def engine_error(exc: EngineOverloaded | EngineError) -> OpenAIError:
    """``EngineOverloaded`` is 503, and so is a fleet's ``ReplicaUnavailable`` (the replica died, or none is live:
    the client may retry); another ``EngineError`` is 500."""
    if isinstance(exc, EngineOverloaded):
        return OpenAIError(503, str(exc), type="server_error", code="engine_overloaded")
    if isinstance(exc, ReplicaUnavailable):
        return OpenAIError(503, str(exc), type="server_error", code="replica_unavailable")
    return OpenAIError(500, str(exc), type="server_error", code="engine_error")


# -- outputs -------------------------------------------------------------------------------------------------------


@dataclass
class Choice:
    """One choice's state as its frames arrive."""

    index: int
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """The engine's, from the first frame that carries them (``RequestOutput.prompt_logprobs``)."""

    def add(self, out: RequestOutput, *, keep: bool = True) -> None:
        """Take a frame; ``keep=False`` (a stream, whose frames go out as they come) keeps only its finish and
        usage, so a long stream with logprobs costs nothing here."""
        if keep:
            self.text.append(out.text_delta)
            self.reasoning.append(out.reasoning_delta)
            self.token_ids += out.token_ids
            self.logprobs += frame_logprobs(out)
            self.tops += frame_tops(out)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error = out.error
            if out.usage is not None:
                self.prompt_tokens = out.usage.prompt_tokens
                self.cached_tokens = out.usage.cached_prompt_tokens
                self.completion_tokens = out.usage.completion_tokens
                self.reasoning_tokens = out.usage.reasoning_tokens


def frame_logprobs(out: RequestOutput) -> list[float | None]:
    """A frame's logprob per token: None where the engine has none (NaN, or no logprobs at all)."""
    if out.logprobs is None:
        return [None] * len(out.token_ids)
    return [None if lp != lp else lp for lp in out.logprobs]


def frame_tops(out: RequestOutput) -> list[dict[int, float]]:
    """A frame's top logprobs per token (``RequestOutput.top_logprobs``): empty dicts where there are none."""
    if out.top_logprobs is None:
        return [{} for _ in out.token_ids]
    return out.top_logprobs


def _finite(lp: float) -> float | None:
    return None if lp != lp else lp


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[float | None], decode: Decode,
                  tops: Sequence[dict[int, float]], top_k: int) -> ChatLogprobs:
    """OpenAI's chat form: each token's ``top_logprobs`` are its ``top_k`` best alternatives (the first ``top_k``
    entries of the engine's dict, which lists them best first and only then the sampled token)."""
    content = []
    for tid, lp, top in zip(token_ids, logprobs, tops, strict=True):
        text = decode(tid)
        alternatives = []
        for alt, alt_lp in list(top.items())[:top_k]:
            alt_text = decode(alt)
            alternatives.append(TopLogprob(token=alt_text, logprob=_finite(alt_lp),
                                           bytes=list(alt_text.encode("utf-8"))))
        content.append(TokenLogprob(token=text, logprob=lp, bytes=list(text.encode("utf-8")),
                                    top_logprobs=alternatives))
    return ChatLogprobs(content=content)


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[float | None], decode: Decode,
                        offset: int, tops: Sequence[dict[int, float]]) -> CompletionLogprobs:
    """OpenAI's legacy form, ``text_offset`` counted from ``offset`` (the choice's text so far). ``top_logprobs``
    holds per token the ``logprobs`` best alternatives and the sampled token (so up to ``logprobs + 1`` entries,
    as OpenAI documents), keyed by their text."""
    tokens = [decode(t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top_logprobs: list[dict[str, float] | None] = [{decode(alt): lp for alt, lp in top.items() if lp == lp}
                                                   for top in tops]
    return CompletionLogprobs(tokens=tokens, token_logprobs=list(logprobs), top_logprobs=top_logprobs,
                              text_offset=offsets)


def running_usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    """A stream's usage so far (``continuous_usage_stats``); cached and reasoning tokens are known at the end."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=0),
                 completion_tokens_details=CompletionTokensDetails(reasoning_tokens=0))


def usage(choices: Sequence[Choice], n: int) -> Usage:
    """Prompt tokens once per prompt (choices ``k*n .. k*n+n-1`` share prompt ``k``), completion tokens summed."""
    prompt = cached = completion = reasoning = 0
    for k in range(0, len(choices), n):
        group = choices[k : k + n]
        prompt += group[0].prompt_tokens
        cached += max(c.cached_tokens for c in group)
    for c in choices:
        completion += c.completion_tokens
        reasoning += c.reasoning_tokens
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                 completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning))
