"""The command line finds its subcommands in ``tools/commands/``: adding one is adding its module, nothing else."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tickloom.tools import commands
from tickloom.tools.cli import EX_USAGE, build_parser, main, subcommand_modules


def test_every_public_module_of_commands_is_a_subcommand_of_its_own_name() -> None:
    modules = subcommand_modules()
    names = [m.rsplit(".", 1)[1] for m in modules]
    assert names == sorted(names), "--help lists the subcommands by name"
    assert {"bench", "explore", "replay", "serve", "whatif"} <= set(names)
    assert not [n for n in names if n.startswith("_")], "a _module is a helper, not a subcommand"
    helpers = sorted(p.stem for p in Path(commands.__path__[0]).glob("_*.py") if p.stem != "__init__")
    assert helpers == ["_fleet_inspect", "_fleet_replay", "_whatif_validate"]
    choices = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert sorted(choices) == names


def test_a_new_module_in_commands_is_a_new_subcommand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "hello.py").write_text(textwrap.dedent('''
        import argparse

        NAME = "hello"
        HELP = "say hello"

        def add_arguments(parser: argparse.ArgumentParser) -> None:
            parser.add_argument("who")

        def run(args: argparse.Namespace) -> int:
            print(f"hello, {args.who}")
            return 3
    '''))
    (tmp_path / "_helper.py").write_text("raise AssertionError('a _module is never imported as a subcommand')\n")
    monkeypatch.setattr(commands, "__path__", [*commands.__path__, str(tmp_path)])
    assert main(["hello", "world"]) == 3
    assert capsys.readouterr().out == "hello, world\n"
    with pytest.raises(SystemExit) as exit_info:
        main(["hello"])
    assert exit_info.value.code == EX_USAGE
