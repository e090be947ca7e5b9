"""The ``tickloom`` command line: subcommands listed, usage errors exit 64, the log demo and bench log run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.cli import EX_USAGE, main


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
    assert "12 ticks (0..11), 1 snapshots" in capsys.readouterr().out
    # It never clobbers a file unless asked.
    assert main(["log", "demo", str(path)]) == EX_USAGE
    assert "exists" in capsys.readouterr().err


def test_log_info_reports_corruption(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.tlog"
    path.write_bytes(b"garbage" * 10)
    assert main(["log", "info", str(path)]) == 2
    assert "corrupt frame at byte offset 0" in capsys.readouterr().err
    assert main(["log", "info", str(tmp_path / "missing.tlog")]) == EX_USAGE


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
