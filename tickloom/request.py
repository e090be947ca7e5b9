"""One request surface: a request's arguments (``Request``) with their bounds, its id (``RequestIds``) and its
frames joined into whole outputs (``FrameCollector``), for every front end: ``Engine``, ``AsyncEngine``, the fleet
and the server's backends.

    stream = engine.generate_request(Request(prompt="Hello", params=SamplingParams(max_tokens=8), deadline=5.0))

A front end's keyword form (``engine.generate("Hello", params, deadline=5.0)``) builds the same ``Request``
(``request_of``); its keywords are ``RequestOptions``. ``checked_request`` is the one boundary where a request's
fields are converted (``RequestRejected`` names the field); the prompt is left to each front end, which alone knows
how to read it (the engine tokenizes and knows the vocabulary; the fleet passes text on to a replica).

A new request field is declared here (a ``Request`` field with its bounds, and its ``RequestOptions`` keyword) and
read where it is used; every front end passes the whole ``Request`` along, the fleet's replicas included.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Annotated, Any, TypedDict, Unpack

import msgspec
from msgspec import Meta

from tickloom.engine.errors import RequestRejected
from tickloom.engine.outputs import RequestOutput
from tickloom.events.types import TokenId
from tickloom.params import SamplingParams
from tickloom.prompts import Prompt
from tickloom.validation import INT32_MAX, INT32_MIN, checked, with_bounds

MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024
MAX_DEADLINE_S = 1e9
"""About 31 years: ``deadline_ns`` (submit time plus the deadline) stays far inside int64."""

RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS)]
PROMPT_TOKEN_IDS: Any = with_bounds(list[TokenId])
"""A token-id prompt's type with its bounds, for ``checked``."""

if TYPE_CHECKING:
    _PromptField = Prompt
else:
    # msgspec cannot decode ``Prompt`` (a union of two list types); each front end checks the prompt itself, so the
    # field is ``Any`` to msgspec (a replica decodes a ``Request`` whose prompt is token ids).
    _PromptField = Any


class Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A request's arguments. Making one checks nothing: a front end checks it when it takes it
    (``checked_request``), and refuses a bad field with ``RequestRejected`` naming it."""

    prompt: _PromptField
    """Text, token ids or chat messages (``tickloom.prompts.Prompt``); the fleet takes text or token ids."""
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    deadline: Annotated[float, Meta(gt=0.0, le=MAX_DEADLINE_S)] | None = None
    """Seconds from submit; the request finishes ``timeout`` when it passes."""
    request_id: RequestId | None = None
    """None: the front end gives it the next free ``req-N`` (``RequestIds``)."""
    priority: Annotated[int, Meta(ge=INT32_MIN, le=INT32_MAX)] = 0
    """Lower is more important, as in vLLM; an int32."""
    cache_salt: Annotated[str, Meta(max_length=MAX_CACHE_SALT_CHARS)] = ""
    """Requests share cached prompt blocks only with requests of the same salt."""


class RequestOptions(TypedDict, total=False):
    """The keyword arguments of a front end's ``generate``, ``stream``, ``complete`` and ``complete_n``:
    ``Request``'s fields after the prompt and the params (a test checks that the two agree)."""

    deadline: float | None
    request_id: str | None
    priority: int
    cache_salt: str


_OPTIONS = [f for f in msgspec.structs.fields(Request) if f.name not in ("prompt", "params")]
_CheckedOptions: Any = msgspec.defstruct("request", [(f.name, f.type, f.default) for f in _OPTIONS], kw_only=True,
                                         forbid_unknown_fields=True)
"""``Request``'s own fields with their bounds, converted by ``checked`` (the prompt and the params are checked by
their own rules, with their own messages)."""


def request_of(prompt: Prompt, params: SamplingParams | None = None, **options: Unpack[RequestOptions]) -> Request:
    """The ``Request`` of a front end's keyword form (unchecked); no params: the defaults."""
    return Request(prompt=prompt, params=SamplingParams() if params is None else params, **options)


def checked_request(request: Request) -> Request:
    """``request`` with its fields converted and within their bounds, and its params valid; else ``RequestRejected``
    naming the field. The prompt is the front end's to check."""
    if not isinstance(request, Request):
        raise RequestRejected(f"request must be a Request, not {type(request).__name__}")
    options = checked({f.name: getattr(request, f.name) for f in _OPTIONS}, _CheckedOptions, "request")
    params = request.params
    if not isinstance(params, SamplingParams):
        raise RequestRejected(f"params must be SamplingParams, not {type(params).__name__}")
    params.validate()  # again: its lists are mutable, and a subclass may skip __post_init__
    return msgspec.structs.replace(request, **{f.name: getattr(options, f.name) for f in _OPTIONS})


class RequestIds:
    """Gives each request its id: the caller's own, refused while in use, or the next ``req-N`` not in use."""

    def __init__(self) -> None:
        self._next = 0

    def assign(self, request_id: str | None, in_use: Callable[[str], bool]) -> str:
        if request_id is not None:
            if in_use(request_id):
                raise RequestRejected(f"request_id={request_id!r} is already in use")
            return request_id
        while True:
            rid = f"req-{self._next}"
            self._next += 1
            if not in_use(rid):  # a caller's own id may look like ours
                return rid


def joined_output(frames: Sequence[RequestOutput]) -> RequestOutput:
    """One choice's frames (the last one final) joined into one whole ``RequestOutput``: every token id, the whole
    text, every frame's logprobs and top logprobs (NaN and ``{}`` for a frame without them), the prompt logprobs."""
    last = frames[-1]
    assert last.finished
    logprobs: list[float] | None = None
    if any(f.logprobs is not None for f in frames):
        logprobs = [x for f in frames for x in (f.logprobs or [math.nan] * len(f.token_ids))]
    tops: list[dict[int, float]] | None = None
    if any(f.top_logprobs is not None for f in frames):
        tops = [d for f in frames for d in (f.top_logprobs or [{} for _ in f.token_ids])]
    prompt = next((f.prompt_logprobs for f in frames if f.prompt_logprobs is not None), None)
    return RequestOutput(
        request_id=last.request_id, index=last.index, token_ids=[t for f in frames for t in f.token_ids],
        text_delta="".join(f.text_delta for f in frames),
        reasoning_delta="".join(f.reasoning_delta for f in frames), finished=True,
        finish_reason=last.finish_reason, usage=last.usage, error=last.error, logprobs=logprobs,
        top_logprobs=tops, prompt_logprobs=prompt,
    )


class FrameCollector:
    """A stream's frames gathered by choice (``index``), then joined into one whole output per choice."""

    def __init__(self) -> None:
        self._choices: dict[int, list[RequestOutput]] = {}

    def add(self, out: RequestOutput) -> None:
        self._choices.setdefault(out.index, []).append(out)

    def outputs(self) -> list[RequestOutput]:
        """Each choice's ``joined_output``, ordered by index."""
        return [joined_output(self._choices[i]) for i in sorted(self._choices)]


class Completing:
    """``complete`` and ``complete_n`` for a front end with ``stream`` (``Engine``, ``Fleet``): one code path, so
    that each returns the same whole outputs and refuses ``n > 1`` in ``complete`` alike."""

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               **options: Unpack[RequestOptions]) -> AbstractAsyncContextManager[AsyncIterable[RequestOutput]]:
        raise NotImplementedError

    async def complete(self, prompt: Prompt, params: SamplingParams | None = None,
                       **options: Unpack[RequestOptions]) -> RequestOutput:
        """Run a request to the end; one ``RequestOutput`` with every token id, the whole text, and the logprobs,
        top logprobs and prompt logprobs asked for. For ``n > 1`` use ``complete_n``."""
        if isinstance(params, SamplingParams) and params.n != 1:
            raise RequestRejected(f"SamplingParams.n={params.n}: complete() returns one output; use "
                                  f"{type(self).__name__}.complete_n() for n > 1")
        [out] = await self.complete_n(prompt, params, **options)
        return out

    async def complete_n(self, prompt: Prompt, params: SamplingParams | None = None,
                         **options: Unpack[RequestOptions]) -> list[RequestOutput]:
        """Run a request's ``params.n`` choices to the end; one whole ``RequestOutput`` per choice (as ``complete``
        returns), ordered by ``index``."""
        collector = FrameCollector()
        async with self.stream(prompt, params, **options) as stream:
            async for out in stream:
                collector.add(out)
        return collector.outputs()


__all__ = ["MAX_CACHE_SALT_CHARS", "MAX_DEADLINE_S", "MAX_REQUEST_ID_CHARS", "PROMPT_TOKEN_IDS", "Completing",
           "FrameCollector", "Request", "RequestId", "RequestIds", "RequestOptions", "checked_request",
           "joined_output", "request_of"]
