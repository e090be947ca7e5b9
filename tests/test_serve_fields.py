"""Every field of vLLM's two OpenAI request models (``ChatCompletionRequest`` and ``CompletionRequest`` in
vllm/entrypoints/openai/protocol.py, and the newer ``structured_outputs``, ``return_token_ids``), sent one at a
time with a plausible value: each is honoured, and the behaviour named beside it is checked, or refused with a 400
whose ``param`` names it. Which it is comes from the server's own table (``tools/serve/fields.py``), so a field
moved from refused to honoured needs a check here."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import trio

from tests.test_serve_protocol import OnlyTheProtocol
from tickloom import Engine, EngineConfig, StructuredOutputs
from tickloom.engine.model.stub import StubTokenizer
from tickloom.request import Request
from tickloom.tools.serve import fields, tool_calls
from tickloom.tools.serve.server import ServeOptions, serve_engine

Check = Callable[[dict[str, Any], Request], None]
"""(the answer's JSON, the engine request it made) -> asserts."""

HELLO = [{"role": "user", "content": "Hello"}]
GUIDELLM = {"model": "stub", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "stop": None, "ignore_eos": True}
"""What guidellm's OpenAI backend sends with every streamed request."""
TOOLS = [{"type": "function", "function": {"name": "f"}}]


def param(name: str, expected: Any) -> Check:
    """Reaches the engine's ``SamplingParams.<name>`` (the engine applies it; its tests check how)."""

    def check(answer: dict[str, Any], request: Request) -> None:
        assert getattr(request.params, name) == expected, (name, getattr(request.params, name))

    return check


def tokens(count: int) -> Check:
    def check(answer: dict[str, Any], request: Request) -> None:
        assert answer["usage"]["completion_tokens"] == count

    return check


def choices(count: int) -> Check:
    def check(answer: dict[str, Any], request: Request) -> None:
        assert len(answer["choices"]) == count

    return check


def text_of(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def only_letter_a(answer: dict[str, Any], request: Request) -> None:
    assert text_of(answer) == "aaaa" and request.params.allowed_token_ids == [65]


def streamed(answer: dict[str, Any], request: Request) -> None:
    assert answer["stream"] and answer["events"][-1] == "[DONE]"


def usage_in_last_chunk(answer: dict[str, Any], request: Request) -> None:
    last = json.loads(answer["events"][-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4


def prompt_cut_to_3(answer: dict[str, Any], request: Request) -> None:
    assert answer["usage"]["prompt_tokens"] == 3 and request.params.truncate_prompt_tokens == 3


def prompt_logprobs_listed(answer: dict[str, Any], request: Request) -> None:
    listed = answer["prompt_logprobs"] if "prompt_logprobs" in answer and answer["prompt_logprobs"] is not None \
        else answer["choices"][0]["prompt_logprobs"]
    assert len(listed) == answer["usage"]["prompt_tokens"] and listed[0] is None
    assert all(1 <= len(entry) <= 2 and all(v["logprob"] <= 0 for v in entry.values()) for entry in listed[1:])


def chat_logprobs(answer: dict[str, Any], request: Request) -> None:
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == 2 for c in content)


def completion_logprobs(answer: dict[str, Any], request: Request) -> None:
    lp = answer["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4


def echoed(answer: dict[str, Any], request: Request) -> None:
    assert text_of(answer).startswith("Hello") and len(text_of(answer)) == len("Hello") + 4


def answered_as(model: str) -> Check:
    def check(answer: dict[str, Any], request: Request) -> None:
        assert answer["model"] == model

    return check


def request_field(name: str, expected: Any) -> Check:
    """Reaches the engine's ``Request.<name>``."""

    def check(answer: dict[str, Any], request: Request) -> None:
        assert getattr(request, name) == expected

    return check


def prompt_ids(text: str) -> Check:
    """Reaches the engine as the ids of ``text`` (the server tokenizes once, as the engine would: a chat rendered
    with the model's template)."""

    def check(answer: dict[str, Any], request: Request) -> None:
        assert request.prompt == StubTokenizer().encode(text)
        assert answer["usage"]["prompt_tokens"] == len(request.prompt)

    return check


def no_reasoning(answer: dict[str, Any], request: Request) -> None:
    """No ``reasoning_content`` (the stub model does not reason: ``tests/test_serve_scoring.py`` checks it with
    reasoning)."""
    assert answer["choices"][0]["message"]["reasoning_content"] is None


def answer_id(expected: str) -> Check:
    def check(answer: dict[str, Any], request: Request) -> None:
        assert answer["id"] == expected and request.request_id == f"{expected}-0"

    return check


def constrained(**expected: Any) -> Check:
    """Reaches the engine as ``SamplingParams.structured`` (``tests/test_serve_structured.py`` checks the mapping of
    every form, and the constraint's effect on a real model). The stub model runs no constraint: the engine
    refuses it at submit, and the server answers that refusal as a 400 naming the request's field."""

    def check(answer: dict[str, Any], request: Request) -> None:
        assert request.params.structured == StructuredOutputs(**expected), request.params.structured
        if "error" in answer:
            assert "structured-output" in answer["error"]["message"], answer

    check.engine_may_refuse = True  # type: ignore[attr-defined]
    return check


def tools_in_prompt(answer: dict[str, Any], request: Request) -> None:
    """The tools reach the prompt (the stub's template has none: the fallback writes them into a system message)."""
    text = StubTokenizer().decode(request.prompt)
    assert "<tools>" in text and '"name": "f"' in text, text


def accepted(answer: dict[str, Any], request: Request) -> None:
    """Accepted with no effect on the output, by its definition (an end user's id, as in OpenAI)."""
    assert answer["choices"]


# field -> (value, other fields it needs, the behaviour checked if the server honours it)
Field = tuple[Any, dict[str, Any], Check | None]

COMMON: dict[str, Field] = {
    "model": ("stub", {}, answered_as("stub")),
    "frequency_penalty": (0.5, {}, param("frequency_penalty", 0.5)),
    "logit_bias": ({"65": 100}, {}, param("logit_bias", {65: 100.0})),
    "max_tokens": (3, {}, tokens(3)),
    "n": (2, {}, choices(2)),
    "presence_penalty": (0.5, {}, param("presence_penalty", 0.5)),
    "response_format": ({"type": "json_object"}, {}, constrained(json_object=True)),
    "seed": (7, {}, param("seed", 7)),
    "stop": (["zz"], {}, param("stop", ["zz"])),
    "stream": (True, {}, streamed),
    "stream_options": ({"include_usage": True}, {"stream": True}, usage_in_last_chunk),
    "temperature": (0.5, {}, param("temperature", 0.5)),
    "top_p": (0.9, {}, param("top_p", 0.9)),
    "user": ("alice", {}, accepted),
    "best_of": (2, {"n": 2}, choices(2)),
    "use_beam_search": (True, {}, None),
    "top_k": (5, {}, param("top_k", 5)),
    "min_p": (0.1, {}, param("min_p", 0.1)),
    "repetition_penalty": (1.1, {}, param("repetition_penalty", 1.1)),
    "length_penalty": (0.5, {}, None),
    "stop_token_ids": ([5], {}, param("stop_token_ids", [5])),
    "include_stop_str_in_output": (True, {}, param("include_stop_str_in_output", True)),
    "ignore_eos": (True, {}, param("ignore_eos", True)),
    "min_tokens": (2, {}, param("min_tokens", 2)),
    "skip_special_tokens": (False, {}, param("skip_special_tokens", False)),
    "spaces_between_special_tokens": (False, {}, None),
    "truncate_prompt_tokens": (3, {}, prompt_cut_to_3),
    "allowed_token_ids": ([65], {}, only_letter_a),
    "prompt_logprobs": (1, {}, prompt_logprobs_listed),
    "guided_json": ({"type": "object"}, {}, constrained(json={"type": "object"})),
    "guided_regex": ("a+", {}, constrained(regex="a+")),
    "guided_choice": (["yes", "no"], {}, constrained(choice=["yes", "no"])),
    "guided_grammar": ("root ::= 'a'", {}, constrained(grammar="root ::= 'a'")),
    "guided_decoding_backend": ("xgrammar", {}, None),
    "guided_whitespace_pattern": (" ", {}, None),
    "structured_outputs": ({"choice": ["yes", "no"]}, {}, constrained(choice=["yes", "no"])),
    "grammar": ('root ::= "a"', {}, constrained(grammar='root ::= "a"')),
    "json_schema": ({"type": "object"}, {}, constrained(json={"type": "object"})),
    "priority": (3, {}, request_field("priority", 3)),
    "logits_processors": (["my.Processor"], {}, None),
    "return_tokens_as_token_ids": (True, {}, None),
    "return_token_ids": (True, {}, None),
    "cache_salt": ("pepper", {}, request_field("cache_salt", "pepper")),
    "kv_transfer_params": ({"do_remote_decode": True}, {}, None),
    "vllm_xargs": ({"x": 1}, {}, None),
}

CHAT: dict[str, Field] = {
    **COMMON,
    "messages": (HELLO, {}, prompt_ids("<user>Hello <assistant>")),
    "logprobs": (True, {"top_logprobs": 2}, chat_logprobs),
    "top_logprobs": (2, {"logprobs": True}, chat_logprobs),
    "max_completion_tokens": (3, {"max_tokens": None}, tokens(3)),
    "best_of": (2, {"n": 2}, None),
    "tools": (TOOLS, {}, tools_in_prompt),
    "tool_choice": ({"type": "function", "function": {"name": "f"}}, {"tools": TOOLS},
                    constrained(json={"type": "object"})),
    "reasoning_effort": ("low", {}, None),
    "include_reasoning": (False, {}, no_reasoning),
    "parallel_tool_calls": (False, {"tools": TOOLS, "tool_choice": "required"},
                            constrained(json=tool_calls.required_schema(TOOLS, parallel=False))),
    "echo": (True, {}, None),
    "add_generation_prompt": (False, {}, None),
    "continue_final_message": (True, {}, None),
    "add_special_tokens": (True, {}, None),
    "documents": ([{"title": "t", "text": "x"}], {}, None),
    "chat_template": ("{{ messages }}", {}, None),
    "chat_template_kwargs": ({"enable_thinking": False}, {}, None),
    "mm_processor_kwargs": ({"x": 1}, {}, None),
    "structural_tag": ('{"structures": []}', {}, None),
    "request_id": ("mine", {}, answer_id("chatcmpl-mine")),
}

COMPLETION: dict[str, Field] = {
    **COMMON,
    "prompt": ("Hello", {}, prompt_ids("Hello")),
    "prompt_embeds": ("AAAA", {}, None),
    "echo": (True, {}, echoed),
    "logprobs": (2, {}, completion_logprobs),
    "suffix": ("the end", {}, None),
    "add_special_tokens": (False, {}, None),
    "request_id": ("mine", {}, answer_id("cmpl-mine")),
}


async def _each_field(tmp_path: Path, chat: bool, table: dict[str, Field]) -> None:
    config = EngineConfig(model="stub", log_path=str(tmp_path / "s.tlog"), num_blocks=256, max_seq_len=1024,
                          stub_step_time=0.001)  # room for the tools' fallback prompt (a stub token per character)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base: dict[str, Any] = {"model": "stub", "max_tokens": 4, **({"messages": HELLO} if chat else {"prompt": "Hello"})}
    honoured = set(fields.honoured_fields(chat))
    refused = set(fields.refused_fields(chat))
    unknown = set(table) - honoured - refused
    assert not unknown, f"vLLM fields the server's table does not name: {sorted(unknown)}"
    shutdown = trio.Event()
    with trio.fail_after(120):
        async with Engine.open(config) as engine, trio.open_nursery() as nursery:
            served = OnlyTheProtocol(engine)
            binds = await nursery.start(functools.partial(serve_engine, served, ServeOptions(port=0),
                                                          shutdown=shutdown))

            def send_all() -> None:
                with httpx.Client(base_url=binds[0], timeout=30.0) as client:
                    for name, (value, needs, check) in table.items():
                        body = {k: v for k, v in {**base, **needs, name: value}.items() if v is not None}
                        r = client.post(path, json=body)
                        if name in honoured:
                            assert check is not None, f"{name} is honoured: name the behaviour to check"
                            answer: dict[str, Any]
                            if r.status_code == 400 and getattr(check, "engine_may_refuse", False):
                                answer = r.json()
                                assert answer["error"]["param"] in (name, "tools"), (name, r.text)
                            elif body.get("stream"):
                                assert r.status_code == 200, (name, r.text)
                                events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
                                answer = {"stream": True, "events": events}
                            else:
                                assert r.status_code == 200, (name, r.text)
                                answer = r.json()
                            check(answer, served.requests[-1])
                        else:
                            assert r.status_code == 400, (name, r.text)
                            error = r.json()["error"]
                            assert error["param"] == name and name in error["message"], (name, error)
                            assert error["code"] == "unsupported_field"

            await trio.to_thread.run_sync(send_all)
            shutdown.set()


async def test_every_vllm_chat_field_is_honoured_or_refused(tmp_path: Path) -> None:
    await _each_field(tmp_path, True, CHAT)


async def test_every_vllm_completion_field_is_honoured_or_refused(tmp_path: Path) -> None:
    await _each_field(tmp_path, False, COMPLETION)


async def test_unknown_fields_are_refused_and_neutral_values_accepted(tmp_path: Path) -> None:
    config = EngineConfig(model="stub", log_path=str(tmp_path / "s.tlog"), num_blocks=256, max_seq_len=256,
                          stub_step_time=0.02)
    shutdown = trio.Event()
    chat = {"model": "stub", "messages": HELLO, "max_tokens": 2}
    neutral = {**chat, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
               "add_generation_prompt": True, "continue_final_message": False, "echo": False,
               "spaces_between_special_tokens": True, "length_penalty": 1, "stream_options": None}
    with trio.fail_after(120):
        async with Engine.open(config) as engine, trio.open_nursery() as nursery:
            binds = await nursery.start(functools.partial(serve_engine, engine, ServeOptions(port=0),
                                                          shutdown=shutdown))

            def clash(c: httpx.Client) -> httpx.Response:
                """A request_id in use (a stream still open) is a 400 naming it."""
                body = {**chat, "max_tokens": 200, "stream": True, "request_id": "twice"}
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    lines = r.iter_lines()  # held: a dropped iterator closes the stream, which cancels the request
                    next(lines)
                    return c.post("/v1/chat/completions", json={**chat, "request_id": "twice"})

            def go() -> list[httpx.Response]:
                with httpx.Client(base_url=binds[0], timeout=30.0) as c:
                    return [c.post("/v1/chat/completions", json={**chat, "frobnicate": 1}),
                            c.post("/v1/chat/completions", json={**chat, "stream": True,
                                                                 "stream_options": {"include_usage": True,
                                                                                    "later": 1}}),
                            c.post("/v1/chat/completions", json={**chat, "stream": True, "max_tokens": 3,
                                                                 "stream_options": {"include_usage": True,
                                                                                    "continuous_usage_stats": True}}),
                            c.post("/v1/chat/completions", json=neutral),
                            c.post("/v1/completions", json={"model": "stub", "prompt": "x", "best_of": 3}),
                            c.post("/v1/completions", json={"model": "stub", "prompt": "x", "max_tokens": 0}),
                            c.post("/v1/completions", json={"model": "stub", "prompt": "x", "max_tokens": 1000000}),
                            c.post("/v1/chat/completions", json={**chat, "max_tokens": None,
                                                                 "max_completion_tokens": 256}),
                            c.post("/v1/completions", json={"model": "stub", "prompt": "x", "stream": True,
                                                            "prompt_logprobs": 1}),
                            c.post("/v1/completions", json={**GUIDELLM, "prompt": "a b c", "max_tokens": 3}),
                            c.post("/v1/chat/completions", json={**GUIDELLM, "max_completion_tokens": 3, "messages": [
                                {"role": "user", "content": [{"type": "text", "text": "a b c"}]}]}),
                            clash(c),
                            c.post("/v1/completions", json={"model": "stub", "prompt": "x" * 100, "max_tokens": 157}),
                            c.post("/v1/completions", json={"model": "stub", "prompt": "x" * 100, "max_tokens": 156})]

            (unknown, nested, continuous, fine, best_of, zero, huge, huge_chat, streamed_prompt, guidellm,
             guidellm_chat, twice, no_room, room) = await trio.to_thread.run_sync(go)
            shutdown.set()
    assert fine.status_code == 200, fine.text
    assert guidellm.status_code == guidellm_chat.status_code == 200 and guidellm.text.endswith("data: [DONE]\n\n")
    # guidellm's stream asks usage in every chunk: the prompt's tokens and the tokens so far, then the last count.
    assert continuous.status_code == 200, continuous.text
    chunks = [json.loads(line[6:]) for line in continuous.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    final = chunks[-1]["usage"]
    running = [(c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) for c in chunks[1:-1]]
    assert final["completion_tokens"] == 3 and running[-1] == (final["prompt_tokens"], 3)
    assert [done for _, done in running] == sorted(done for _, done in running)
    expected = [(unknown, "frobnicate"), (nested, "stream_options.later"),
                (best_of, "best_of"), (zero, "max_tokens"),
                (huge, "max_tokens"), (huge_chat, "max_completion_tokens"), (streamed_prompt, "prompt_logprobs"),
                (twice, "request_id"), (no_room, "max_tokens")]
    for r, name in expected:
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
    assert "max_seq_len=256" in huge.json()["error"]["message"]
    # The prompt's 100 tokens leave 156 of max_seq_len=256: more is a 400, as in vLLM, not a silent cut.
    assert "100 in the prompt" in no_room.json()["error"]["message"]
    assert room.status_code == 200 and room.json()["usage"]["completion_tokens"] == 156
    assert "unknown field `frobnicate`" in unknown.json()["error"]["message"]


async def test_include_reasoning_false_leaves_the_reasoning_out() -> None:
    """vLLM's ``include_reasoning``, on a reasoning model's frames: whole and streamed."""
    from tickloom import RequestOutput, RequestUsage
    from tickloom.tools.serve.chunks import ChunkWriter
    from tickloom.tools.serve.openai_types import decode_request
    from tickloom.tools.serve.translate import Choice

    usage = RequestUsage(prompt_tokens=3, completion_tokens=2, cached_prompt_tokens=0, reasoning_tokens=1)
    frames = [RequestOutput(request_id="r", token_ids=[5], reasoning_delta="hmm"),
              RequestOutput(request_id="r", token_ids=[6], text_delta="hi", finished=True, finish_reason="stop",
                            usage=usage)]

    class Sink:
        def __init__(self) -> None:
            self.events: list[bytes] = []

        async def write(self, data: bytes) -> None:
            self.events.append(data)

    seen = {}
    for include in (True, False):
        body = json.dumps({"model": "stub", "messages": HELLO, "include_reasoning": include}).encode()
        req = decode_request(body, fields.CHAT_WIRE)
        writer = ChunkWriter(req, "chatcmpl-x", 0, "stub", str)
        choice, sink = Choice(0), Sink()
        for out in frames:
            choice.add(out)
            await writer.frame(sink, choice, out)  # type: ignore[arg-type]
        message = writer.whole([choice], 1).choices[0].message  # type: ignore[union-attr]
        streamed = [json.loads(e.removeprefix(b"data: ")) for e in sink.events]
        seen[include] = (message.content, message.reasoning_content,
                         [c["choices"][0]["delta"].get("reasoning_content") for c in streamed])
    assert seen[True] == ("hi", "hmm", ["hmm", None])
    assert seen[False] == ("hi", None, [None])
