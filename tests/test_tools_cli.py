"""The ``tickloom`` command line: subcommands listed, usage errors exit 64 (argparse's with the usage, ours as one
line), the log demo and bench log run, ``--plot`` without matplotlib (the optional extra ``tickloom[plot]``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tickloom.tools.cli import EX_USAGE, main


def test_help_lists_the_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in ("bench", "log"):
        assert name in out


@pytest.mark.parametrize(
    "argv", [[], ["no-such-command"], ["bench"], ["bench", "no-such-bench"], ["log", "demo"], ["bench", "log", "-x"]]
)
def test_usage_errors_exit_64(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == EX_USAGE
    assert "usage:" in capsys.readouterr().err


def test_log_demo_then_info(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "demo.tlog"
    assert main(["log", "demo", str(path), "--ticks", "12"]) == 0
    out = capsys.readouterr().out
    assert "equal to what was written: True" in out
    assert "mode 0o600" in out
    assert main(["log", "info", str(path)]) == 0
    assert "12 ticks (0..11), 1 snapshot," in capsys.readouterr().out
    # It never clobbers a file unless asked.
    assert main(["log", "demo", str(path)]) == EX_USAGE
    assert "exists" in capsys.readouterr().err


def test_log_info_reports_corruption(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.tlog"
    path.write_bytes(b"garbage" * 10)
    assert main(["log", "info", str(path)]) == 2
    assert "corrupt frame at byte offset 0" in capsys.readouterr().err
    assert main(["log", "info", str(tmp_path / "missing.tlog")]) == 2  # unreadable input, as the README says


def test_bench_log_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "log", "--json", "--ticks", "20", "--sync-ticks", "3", "--repeat", "1", "--dir", str(tmp_path)]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["figure"], r.get("sync")) for r in lines] == [
        ("bytes_per_tick", None),
        ("append", "never"),
        ("append_engine_path", "never"),
        ("append", "tick"),
        ("read_decode", None),
    ]
    assert all(r["bench"] == "log" and r["batch"] == 64 for r in lines)
    assert all(r["ratio"] > 0 for r in lines)
    assert list(tmp_path.iterdir()) == []  # it cleans up after itself


# --- usage mistakes: one line, exit 64 -------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--model", "stub", "--device", "gpu", "x"], "--device 'gpu': not a torch device"),
    (["generate", "--model", "stub", "--device", "cuda:7", "x"], "--device cuda:7: "),
    (["generate", "--model", "/no/such/model", "x"], "cannot load model '/no/such/model': no such file"),
    (["generate", "--model", "pyproject.toml", "x"], "--model 'pyproject.toml': a file must be a .gguf"),
    (["generate", "--model", "stub", "--max-seq-len", "1", "x"], "max_seq_len"),
    (["generate", "--model", "stub", "--seed", "-1", "x"], "seed"),
    (["generate", "--model", "stub", "--stub-step-time", "-1", "x"], "stub_step_time"),
    (["generate", "--model", "stub", "--log", "pyproject.toml", "x"], "log_path"),
    (["chat", "--model", "stub", "--log", "pyproject.toml"], "log_path"),
    (["replay", "missing.tlog", "--full", "--dtype", "bad"], "--dtype 'bad': choose one of"),
    (["replay", "missing.tlog", "--dtype", "float32"], "--dtype needs --full"),
    (["replay", "missing.tlog", "--full", "--model", "/no/such/model"], "cannot load model '/no/such/model'"),
    (["generate", "--model", "tests", "x"], "--model 'tests': a checkpoint directory needs config.json"),
    (["inspect", "missing.tlog", "--ticks", "a:b"], "--ticks 'a:b': expected A:B"),
    (["inspect", "missing.tlog", "--trace", "/no/such/dir/t.json"], "--trace /no/such/dir/t.json: no such directory"),
    (["models", "--all"], "--all needs --prune"),
])
def test_usage_mistakes_get_one_line_and_exit_64(argv: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == EX_USAGE
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tickloom: error: ") and message in lines[0], captured.err
    assert captured.out == ""


def test_plot_without_matplotlib_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "demo.tlog"
    assert main(["log", "demo", str(log), "--ticks", "3"]) == 0
    capsys.readouterr()
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main(["inspect", str(log), "--plot", str(tmp_path / "p.png")]) == EX_USAGE
    captured = capsys.readouterr()
    assert captured.err == "tickloom: error: install tickloom[plot] for --plot (matplotlib is not installed)\n"
    assert captured.out == "" and not (tmp_path / "p.png").exists()
    from tickloom.replay.trace import write_plot

    with pytest.raises(ImportError, match=r"install tickloom\[plot\]"):
        write_plot(log, tmp_path / "p.png")


def test_matplotlib_is_not_a_hard_dependency() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("matplotlib") for d in project["dependencies"])
    assert any(d.startswith("matplotlib") for d in project["optional-dependencies"]["plot"])


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tickloom {version('tickloom')}"


def test_version_falls_back_to_pyproject_in_a_source_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata
    import re

    from tickloom.tools.cli import package_version

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text(encoding="utf-8")
    declared = re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE)
    assert declared is not None and package_version() == declared.group(1)
