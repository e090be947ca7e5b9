"""``tickloom bench core`` runs at tiny sizes and prints the documented JSON keys (no timing assertions)."""

from __future__ import annotations

import json

import pytest

from tickloom.tools.cli import main


def test_bench_core_json_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "core", "--json", "--batches", "4", "8", "--ticks", "3", "--warmup", "5"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["batch"] for line in lines] == [4, 8]
    for line in lines:
        assert line["bench"] == "core" and line["depth"] == 1 and line["ticks"] == 3
        for key in ("us_per_request_step", "us_per_request_step_depth2", "ratio_to_vllm", "us_per_tick"):
            assert isinstance(line[key], float) and line[key] > 0
        assert line["vllm_us_per_request_step"] == 11.5 and line["goal_ratio"] == 0.13


def test_bench_core_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "core", "--batches", "4", "--ticks", "2", "--warmup", "2", "--depths", "2"]) == 0
    out = capsys.readouterr().out
    assert "vLLM" in out and "not installable" in out and "N=4" in out and "depth 2" in out


def test_bench_core_reports_its_best_round(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "core", "--json", "--batches", "4", "--ticks", "3", "--warmup", "5", "--rounds", "3"]
    assert main(args) == 0
    (line,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert line["rounds"] == 3 and len(line["round_medians"]) == 3
    assert line["us_per_request_step"] == pytest.approx(min(line["round_medians"]))


def test_bench_core_rejects_zero_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "core", "--rounds", "0"]) == 64
    assert "--rounds" in capsys.readouterr().err


def test_bench_core_cancel_case_prints_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "core", "--cases", "cancel", "--cancel-waiting", "20", "10"]) == 0
    out = capsys.readouterr().out
    assert "mass cancel" in out and "W=10 " in out and "W=20 " in out and "x the time for 2x" in out
    assert "N=" not in out, "the steady case runs only when asked for"


def test_bench_core_cancel_case_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "core", "--json", "--cases", "steady", "cancel", "--batches", "4", "--ticks", "2",
            "--warmup", "2", "--depths", "1", "--cancel-waiting", "10", "30"]
    assert main(args) == 0
    steady, cancel = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert steady["bench"] == "core" and steady["batch"] == 4
    assert cancel["bench"] == "core-cancel" and cancel["waiting"] == [10, 30] and cancel["size_ratio"] == 3.0
    assert cancel["rounds"] == 5 and len(cancel["ms"]) == 2 and cancel["time_ratio"] > 0


def test_bench_core_rejects_an_empty_cancel_queue(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "core", "--cases", "cancel", "--cancel-waiting", "0"]) == 64
    assert "--cancel-waiting" in capsys.readouterr().err
