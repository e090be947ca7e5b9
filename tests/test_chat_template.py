"""``EngineConfig.chat_template`` (``--chat-template``, as vLLM's): a file's path or the template itself, read and
compiled when the config is made (a template that cannot be is a ``ConfigError`` naming the field), stored as the
template's text (so the log header holds it), and used to render every chat prompt in place of the model's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tickloom import ConfigError, Engine, EngineConfig, SamplingParams
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.events import LogReader, RequestArrived
from tickloom.tools.cli import EX_USAGE, build_parser, main
from tickloom.tools.model_options import engine_config

TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
RENDERED = "[system] be brief\n[user] hi\n>"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


def arrivals(log: Path) -> list[RequestArrived]:
    with LogReader(log) as reader:
        return [i for t in reader.ticks() for i in t.inputs.inputs if isinstance(i, RequestArrived)]


def logged_engine_config(log: Path) -> dict[str, object]:
    with LogReader(log) as reader:
        engine: dict[str, object] = json.loads(reader.header.config_json)["engine"]
        return engine


async def test_a_chat_prompt_renders_with_the_template_given_as_text_or_as_a_file(tiny: Path, tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    for name, source in (("text", TEMPLATE), ("file", str(path)), ("model's", None)):
        log = tmp_path / f"{name}.tlog"
        config = EngineConfig(model=str(tiny), chat_template=source, num_blocks=64, max_seq_len=256,
                              log_path=str(log))
        assert config.chat_template == (None if source is None else TEMPLATE)
        async with Engine.open(config) as engine:
            rendered = engine.tokenizer.render_chat(CHAT)
            expected = engine.tokenizer.encode(rendered, add_special_tokens=False)
            await engine.complete(CHAT, SamplingParams(max_tokens=2, temperature=0.0), request_id="chat")
        if source is None:
            assert rendered.startswith("<|im_start|>system\nbe brief<|im_end|>")  # the tiny model's own (ChatML)
        else:
            assert rendered == RENDERED
        [arrived] = arrivals(log)
        assert arrived.prompt_token_ids == expected
        assert logged_engine_config(log)["chat_template"] == config.chat_template  # the text, not the path


@pytest.mark.parametrize(("source", "reason"), [
    ("{{ messages", "does not compile: line 1"),
    ("{% for m in messages %}{{ m.content }}", "does not compile"),
    ("no-such-template.jinja", "no such file"),
])
def test_a_bad_template_is_refused_naming_the_field(tiny: Path, source: str, reason: str) -> None:
    with pytest.raises(ConfigError) as error:
        EngineConfig(model=str(tiny), chat_template=source)
    assert str(error.value).startswith(f"EngineConfig.chat_template={source!r}: ")
    assert reason in str(error.value)


def test_a_file_that_holds_no_template_or_is_unreadable_is_refused(tiny: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jinja"
    empty.write_text("", encoding="utf-8")
    binary = tmp_path / "binary.jinja"
    binary.write_bytes(b"\xff\xfe{{ x }}")
    for path, reason in ((empty, "holds no template"), (binary, "cannot read")):
        with pytest.raises(ConfigError, match=f"^EngineConfig.chat_template=.*{reason}"):
            EngineConfig(model=str(tiny), chat_template=str(path))


def test_the_stub_refuses_a_template_and_an_empty_one_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^EngineConfig\.chat_template=.*stub model renders chats its own way"):
        EngineConfig(model="stub", chat_template=TEMPLATE)
    with pytest.raises(ConfigError, match=r"length >= 1 - at `\$\.chat_template`"):
        EngineConfig(chat_template="")


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_the_flag_reaches_engine_config(command: str, tiny: Path, tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    parser = sub.choices[command]
    prompt = ["hi"] if command == "generate" else []
    for source in (str(path), TEMPLATE):
        args = parser.parse_args(["--model", str(tiny), "--chat-template", source, *prompt])
        assert engine_config(args).chat_template == TEMPLATE
    assert engine_config(parser.parse_args(["--model", str(tiny), *prompt])).chat_template is None


def test_a_bad_template_flag_is_a_usage_error_naming_the_field(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tiny), "--chat-template", "{{ oops", "hi"]) == EX_USAGE
    assert "EngineConfig.chat_template='{{ oops': the template does not compile" in capsys.readouterr().err
