"""``tickloom inspect``: header and per-tick table, filters, a valid Perfetto trace and a non-blank plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.replay_helpers import record_everything
from tickloom.tools.cli import main


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("inspect") / "everything.tlog"
    record_everything(path)
    return path


def test_table_and_filters(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(log)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "digest v1" in lines[0] and "tickloom-record" in lines[1]
    table = lines[lines.index(next(line for line in lines if line.split()[:2] == ["tick", "time_ms"])) + 1:]
    assert len(table) == 73 and all(len(line.split()) == 13 for line in table)
    assert main(["inspect", str(log), "--ticks", "10:20"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line[:7].strip().isdigit()]
    assert [int(line.split()[0]) for line in rows] == list(range(10, 20))
    assert main(["inspect", str(log), "--request", "r05"]) == 0
    out = capsys.readouterr().out
    assert "Finish timeout" in out and "RequestArrived" in out
    assert main(["inspect", str(log), "--ticks", "x:y"]) == 64


def test_perfetto_trace_is_valid(log: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    assert main(["inspect", str(log), "--no-table", "--trace", str(out)]) == 0
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    assert events
    for event in events:
        for key in ("ph", "ts", "pid", "tid", "name"):
            assert key in event, (key, event)
        if event["ph"] == "X":
            assert event["dur"] >= 0
    cats = {e.get("cat") for e in events}
    assert {"step", "request", "io", "preempt"} <= cats
    assert any(e["ph"] == "X" and e["name"].startswith("spill") for e in events)


def test_plot_renders(log: Path, tmp_path: Path) -> None:
    import matplotlib.image

    out = tmp_path / "plot.png"
    assert main(["inspect", str(log), "--no-table", "--plot", str(out)]) == 0
    image = matplotlib.image.imread(str(out))
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert len({tuple(px) for px in image.reshape(-1, image.shape[-1])[::7].tolist()}) > 1
