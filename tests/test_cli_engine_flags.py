"""The engine flags: one set, declared once (``model_options.ENGINE_FLAGS``), in every command that builds an engine,
with vLLM's and llama.cpp's names as aliases of the same ``EngineConfig`` field."""

from __future__ import annotations

import argparse

import pytest

from tickloom.config import EngineConfig
from tickloom.tools.cli import EX_USAGE, build_parser, main
from tickloom.tools.model_options import DEFAULT_MAX_TOKENS, ENGINE_FLAGS, MAX_SEQ_LEN_CAP, engine_config

ENGINE_COMMANDS = ("generate", "chat", "serve", "fleet")
"""Every command that builds an engine; a new one belongs here."""

ALIASES = {
    "--max-model-len": "max_seq_len", "-c": "max_seq_len", "--ctx-size": "max_seq_len",
    "--max-num-seqs": "max_batch_size", "-np": "max_batch_size", "--parallel": "max_batch_size",
    "--max-num-batched-tokens": "max_batch_tokens", "-t": "threads", "-tp": "tensor_parallel_size",
    "--enable-prefix-caching": "prefix_caching",
}


def command_parser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[name]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def option_strings(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every option string of the parser -> its dest."""
    return {option: action.dest for action in parser._actions for option in action.option_strings}


def test_every_flag_names_a_field_of_engine_config() -> None:
    for flag in ENGINE_FLAGS:
        assert flag.field in EngineConfig.__struct_fields__, flag


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_engine_command_takes_every_engine_flag(command: str) -> None:
    options = option_strings(command_parser(command))
    for flag in ENGINE_FLAGS:
        for name in flag.names:
            assert options.get(name) == flag.field, (command, name)
    engine_fields = {flag.field for flag in ENGINE_FLAGS}
    reference = {o: d for o, d in option_strings(command_parser("generate")).items() if d in engine_fields}
    assert {o: d for o, d in options.items() if d in engine_fields} == reference


@pytest.mark.parametrize("alias, field", sorted(ALIASES.items()))
def test_an_alias_sets_the_same_field_as_the_long_name(alias: str, field: str) -> None:
    flag = next(f for f in ENGINE_FLAGS if f.field == field)
    assert alias in flag.names and flag.names[0] != alias
    parser = command_parser("generate")
    value = [] if field == "prefix_caching" else ["64"]
    by_alias = parser.parse_args(["--model", "stub", alias, *value, "x"])
    by_name = parser.parse_args(["--model", "stub", flag.names[0], *value, "x"])
    assert getattr(by_alias, field) == getattr(by_name, field) is not None
    if field != "tensor_parallel_size":  # the stub has no weights to shard
        assert getattr(engine_config(by_alias), field) == getattr(engine_config(by_name), field)


def test_given_flags_reach_engine_config() -> None:
    args = command_parser("serve").parse_args(["--model", "stub", "-c", "512", "-np", "4", "-t", "2", "--block-size",
                                               "32", "--no-prefix-caching", "--num-blocks", "64"])
    config = engine_config(args)
    assert (config.max_seq_len, config.max_batch_size, config.threads, config.block_size, config.prefix_caching,
            config.num_blocks) == (512, 4, 2, 32, False, 64)


def test_max_seq_len_defaults_to_the_models_context_capped() -> None:
    parser = command_parser("generate")
    assert engine_config(parser.parse_args(["--model", "stub", "x"])).max_seq_len == EngineConfig().max_seq_len
    # a real model: the cap, which the engine lowers to the model's context when it loads it
    assert engine_config(parser.parse_args(["x"])).max_seq_len == MAX_SEQ_LEN_CAP


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_dtype_refuses_free_text_with_exit_64(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [command, "--model", "stub", "--dtype", "half"] + (["--dir", "d", "x"] if command == "fleet" else
                                                              ["x"] if command == "generate" else [])
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == EX_USAGE
    assert "invalid choice: 'half'" in capsys.readouterr().err


def test_fleet_has_no_log_flag() -> None:
    assert "--log" not in option_strings(command_parser("fleet"))


def test_max_tokens_default_is_the_same_everywhere() -> None:
    for command in ("generate", "chat", "fleet"):
        defaults = {a.dest: a.default for a in command_parser(command)._actions}
        assert defaults["max_tokens"] == DEFAULT_MAX_TOKENS, command


def test_the_readme_names_every_engine_flag_and_alias() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Command line"):]
    section = section[:section.index("\n## ", 1)]
    for flag in ENGINE_FLAGS:
        for name in flag.names:
            assert f"`{name}`" in section, name
