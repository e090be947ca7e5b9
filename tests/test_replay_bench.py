"""``tickloom bench replay`` runs and prints its figures (no timing thresholds)."""

from __future__ import annotations

import json

import pytest

from tickloom.tools.cli import main


def test_bench_replay_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "replay", "--batch", "8", "--tokens", "8", "--repeat", "1", "--json", "--live-batch", "2",
            "--live-tokens", "3"]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    exact, live = lines
    assert exact["figure"] == "exact_replay" and exact["rows"] == 64 and exact["ratio"] > 0
    assert live["figure"] == "replay_vs_live" and live["ratio"] > 0 and live["live_s"] > 0


def test_bench_replay_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "replay", "--batch", "4", "--tokens", "4", "--repeat", "1", "--no-live"]) == 0
    out = capsys.readouterr().out
    assert "exact replay" in out and "core.tick only" in out and "ratio" in out
