"""Progress for the long commands: a bar on stderr only on a terminal; none in pipes and tests, none with --quiet,
which every long command accepts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from tickloom.tools.cli import build_parser, main
from tickloom.tools.progress import Progress


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = sub.choices[name]
    assert isinstance(found, argparse.ArgumentParser)
    return found


def long_command_parsers() -> dict[str, argparse.ArgumentParser]:
    root = build_parser()
    parsers = {name: subparser(root, name) for name in ("explore", "replay", "generate", "chat", "fleet")}
    bench = subparser(root, "bench")
    sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    parsers.update({f"bench {name}": p for name, p in sub.choices.items()})
    return parsers


def test_every_long_command_accepts_quiet() -> None:
    parsers = long_command_parsers()
    assert {"bench core", "bench engine", "bench model", "bench replay"} <= set(parsers)
    for name, parser in parsers.items():
        assert "--quiet" in {o for a in parser._actions for o in a.option_strings}, name


def test_a_bar_is_shown_only_on_a_terminal_without_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not Progress("x").shown  # pytest's stdout and stderr are not terminals
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert Progress("x").shown
    assert not Progress("x", quiet=True).shown


def test_explore_prints_no_progress_when_not_on_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    for quiet in ([], ["--quiet"]):
        assert main(["explore", "--seeds", "3", *quiet]) == 0
        captured = capsys.readouterr()
        assert captured.err == ""
        assert captured.out.startswith("explored 3 seeds")


def test_replay_full_and_a_bench_print_no_progress_when_not_on_a_terminal(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "run.tlog"
    assert main(["generate", "--model", "stub", "-n", "4", "--log", str(log), "a", "b"]) == 0
    capsys.readouterr()
    for quiet in ([], ["--quiet"]):
        assert main(["replay", str(log), "--full", *quiet]) == 0
        captured = capsys.readouterr()
        assert captured.err == "" and "identical" in captured.out
    argv = ["bench", "log", "--json", "--ticks", "10", "--sync-ticks", "2", "--repeat", "1", "--dir", str(tmp_path)]
    for quiet in ([], ["--quiet"]):
        assert main([*argv, *quiet]) == 0
        assert capsys.readouterr().err == ""


def test_model_work_lines_stay_plain_lines_around_the_spinner(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from tickloom.tools import cli, progress

    monkeypatch.setattr(progress, "progress_wanted", lambda quiet: not quiet)  # as on a terminal
    cli.show_model_progress()
    log = logging.getLogger("tickloom.engine.model.loaders")
    log.info("loading smollm2-135m…")
    log.info("loaded smollm2-135m in 1.0 s")
    log.info("converting x.gguf to the cache (first run only)…")
    cli._finish_model_progress()  # the command ended (or failed) while the work was under way
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if line.strip()][-3:] == [
        "loading smollm2-135m…", "loaded smollm2-135m in 1.0 s", "converting x.gguf to the cache (first run only)…"]


def test_a_bench_phase_is_noted_on_the_bar_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    from tickloom.tools import progress

    progress.progress_note("nothing shown: nothing happens")
    monkeypatch.setattr(progress, "progress_wanted", lambda quiet: not quiet)
    with Progress("tickloom bench engine") as bar:
        progress.progress_note("pipeline depth 2, run 1 of 2")
        assert bar._bar.tasks[0].description == "tickloom bench engine: pipeline depth 2, run 1 of 2"
    assert not progress._active
