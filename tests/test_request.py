"""The one request surface (``tickloom.request``): the struct and its bounds, the id allocator, the frame collector."""

from __future__ import annotations

import math
import typing
from typing import Any

import msgspec
import pytest

from tickloom import RequestOutput, RequestRejected, SamplingParams
from tickloom.request import (
    MAX_CACHE_SALT_CHARS,
    MAX_DEADLINE_S,
    MAX_REQUEST_ID_CHARS,
    FrameCollector,
    Request,
    RequestIds,
    RequestOptions,
    checked_request,
    joined_output,
    request_of,
)


def test_the_keywords_are_the_structs_fields() -> None:
    fields = [f.name for f in msgspec.structs.fields(Request)]
    assert fields[:2] == ["prompt", "params"]
    assert list(typing.get_type_hints(RequestOptions)) == fields[2:]


def test_request_of_fills_the_default_params_and_refuses_an_unknown_keyword() -> None:
    assert request_of("hi") == Request(prompt="hi", params=SamplingParams())
    assert request_of("hi", deadline=2.0).deadline == 2.0
    with pytest.raises(TypeError, match="colour"):
        request_of("hi", colour="red")  # type: ignore[call-arg]


@pytest.mark.parametrize(("name", "value"), [
    ("deadline", 0), ("deadline", math.nan), ("deadline", math.inf), ("deadline", MAX_DEADLINE_S * 2),
    ("deadline", True), ("deadline", "1"), ("request_id", ""), ("request_id", "x" * (MAX_REQUEST_ID_CHARS + 1)),
    ("request_id", "\ud800"), ("request_id", 3), ("priority", True), ("priority", 2**31), ("priority", 1.0),
    ("cache_salt", None), ("cache_salt", "s" * (MAX_CACHE_SALT_CHARS + 1)), ("cache_salt", "\udc00"),
])
def test_a_bad_field_is_refused_naming_it(name: str, value: Any) -> None:
    with pytest.raises(RequestRejected, match=name):
        checked_request(Request(prompt="hi", **{name: value}))


def test_checking_converts_and_keeps_the_prompt_and_params() -> None:
    params = SamplingParams(max_tokens=3)
    request = checked_request(Request(prompt=("any", "prompt"), params=params, deadline=5, request_id="r",
                                      priority=-(2**31), cache_salt="s" * MAX_CACHE_SALT_CHARS))
    assert type(request.deadline) is float and request.deadline == 5.0
    assert request.params is params and request.prompt == ("any", "prompt"), "the prompt is the front end's to check"
    with pytest.raises(RequestRejected, match="params must be SamplingParams, not dict"):
        checked_request(Request(prompt="hi", params={"max_tokens": 3}))  # type: ignore[arg-type]
    mutated = SamplingParams(stop=["ok"])
    mutated.stop.append("")  # type: ignore[union-attr]
    with pytest.raises(RequestRejected, match="stop"):
        checked_request(Request(prompt="hi", params=mutated))
    with pytest.raises(RequestRejected, match="request must be a Request, not dict"):
        checked_request({"prompt": "hi"})  # type: ignore[arg-type]


def test_a_token_id_request_crosses_the_wire_whole() -> None:
    request = Request(prompt=[1, 2, 3], params=SamplingParams(stop="x", logit_bias={3: 1.5}, n=2, logprobs=1),
                      deadline=2.5, request_id="r", priority=-3, cache_salt="s")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=Request) == request


def test_ids_are_the_callers_or_the_next_free_one() -> None:
    ids = RequestIds()
    in_use = {"req-1", "mine"}
    assert [ids.assign(None, in_use.__contains__) for _ in range(3)] == ["req-0", "req-2", "req-3"]
    assert ids.assign("yours", in_use.__contains__) == "yours"
    with pytest.raises(RequestRejected, match="request_id='mine' is already in use"):
        ids.assign("mine", in_use.__contains__)


def _frame(index: int, tokens: list[int], *, logprobs: bool, finished: bool = False, **kw: Any) -> RequestOutput:
    return RequestOutput(request_id="r", index=index, token_ids=tokens, text_delta="".join(map(str, tokens)),
                         reasoning_delta="." if tokens else "", finished=finished,
                         logprobs=[-float(t) for t in tokens] if logprobs else None,
                         top_logprobs=[{t: -float(t)} for t in tokens] if logprobs else None,
                         finish_reason="stop" if finished else None, **kw)


def test_every_frame_is_joined_per_choice() -> None:
    collector = FrameCollector()
    frames = [_frame(1, [7], logprobs=True), _frame(0, [1, 2], logprobs=False, prompt_logprobs=[None, {4: -0.5}]),
              _frame(0, [3], logprobs=True), _frame(1, [8], logprobs=True, finished=True),
              _frame(0, [], logprobs=False, finished=True)]
    for frame in frames:
        collector.add(frame)
    zero, one = collector.outputs()
    assert (zero.index, zero.token_ids, zero.text_delta, zero.reasoning_delta) == (0, [1, 2, 3], "123", "..")
    assert zero.logprobs is not None and len(zero.logprobs) == 3, "NaN for each token of a frame without logprobs"
    assert math.isnan(zero.logprobs[0]) and math.isnan(zero.logprobs[1]) and zero.logprobs[2] == -3.0
    assert zero.top_logprobs == [{}, {}, {3: -3.0}]
    assert zero.prompt_logprobs == [None, {4: -0.5}] and zero.finished and zero.finish_reason == "stop"
    assert (one.index, one.token_ids, one.logprobs, one.prompt_logprobs) == (1, [7, 8], [-7.0, -8.0], None)
    assert joined_output([frames[1], frames[2], frames[4]]) == zero
    without = joined_output([_frame(0, [5], logprobs=False, finished=True)])
    assert without.logprobs is None and without.top_logprobs is None
