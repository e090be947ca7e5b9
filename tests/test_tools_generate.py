"""``tickloom generate``, ``chat`` and ``models`` end to end, with the stub model (piped output, no TTY); Ctrl-C in
``generate``; ``replay --full`` with the model the log names."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tickloom.tools.cli import EX_USAGE, main

SUMMARY = re.compile(r"^summary: (\d+) requests?, (\d+) tokens? in [\d.]+ s, [\d.]+ tokens/s, (\d+) preemptions?, "
                     r"log (.+)$", re.M)


def test_generate_streams_labelled_prompts_and_summarises(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "gen.tlog"
    prompts = ["hello there", "a second prompt", "third"]
    status = main(["generate", "--model", "stub", "--max-tokens", "12", "--seed", "7", "--log", str(log), *prompts])
    assert status == 0
    out = capsys.readouterr().out
    for i, _ in enumerate(prompts, start=1):
        assert f"[{i}] (length, 12 tokens)" in out
        assert re.search(rf"^\[{i}\] \S", out, re.M)
    match = SUMMARY.search(out)
    assert match is not None, out
    assert match.groups() == ("3", "36", "0", str(log))
    assert main(["replay", str(log)]) == 0
    assert "identical" in capsys.readouterr().out


def test_generate_one_at_a_time_streams_raw(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "stub", "--max-tokens", "5", "--concurrency", "1", "--temperature", "0",
                 "first prompt", "second"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "[1] first prompt" and len(lines[1]) == 5 and lines[2] == "[1] (length, 5 tokens)"
    assert lines[3] == "[2] second" and lines[5] == "[2] (length, 5 tokens)"
    match = SUMMARY.search(out)
    assert match is not None and match.group(4).startswith("none")


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "stub", "--concurrency", "0", "x"],
    ["generate", "--model", "stub", "--max-tokens", "0", "x"],
    ["generate", "--model", "stub", "--temperature", "-1", "x"],
])
def test_generate_usage_errors_exit_64(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == EX_USAGE
    assert "tickloom: error:" in capsys.readouterr().err


def test_generate_unknown_model_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "no-such-model", "x"]) == EX_USAGE
    assert "cannot load model 'no-such-model': no such file or directory" in capsys.readouterr().err


def test_generate_ctrl_c_exits_130_and_the_log_replays(tmp_path: Path) -> None:
    """SIGINT mid-run: the requests are cancelled, the engine shuts down, exit 130, no traceback; the log ends
    every request explicitly and replays."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tickloom.events import Finish, LogReader

    log = tmp_path / "int.tlog"
    argv = [sys.executable, "-m", "tickloom", "generate", "--model", "stub", "--stub-step-time", "0.05",
            "--max-tokens", "2000", "--log", str(log), "one", "two"]
    proc = subprocess.Popen(argv, cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        # until the run is well under way: a header and the first ticks alone come to about 2.4 kB, and each tick
        # with tokens adds about 200 bytes (at 2 kB the signal could come before the first token, and a request
        # with no tokens has no "(interrupted, ...)" line)
        while (not log.exists() or log.stat().st_size < 6000) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "tickloom: interrupted; 2 requests cancelled" in err, err
    assert "[1] (interrupted, " in out and "summary: 2 requests" in out
    with LogReader(log) as reader:
        finishes = {c.request_id: c.reason for r in reader.ticks() for c in r.outputs.commands
                    if isinstance(c, Finish)}
    assert finishes == {"prompt-1": "cancelled", "prompt-2": "cancelled"}
    assert main(["replay", str(log)]) == 0


def test_replay_full_takes_the_model_from_the_header(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tickloom.engine.model.tiny import write_tiny_model

    stub_log = tmp_path / "stub.tlog"
    assert main(["generate", "--model", "stub", "--max-tokens", "6", "--log", str(stub_log), "a", "b"]) == 0
    capsys.readouterr()
    assert main(["replay", str(stub_log), "--full"]) == 0
    assert "model: stub (from the log's header)" in capsys.readouterr().out
    model = write_tiny_model(tmp_path / "tiny", seed=2)
    log = tmp_path / "tiny.tlog"
    assert main(["generate", "--model", str(model), "--no-chat", "--max-tokens", "5", "--log", str(log),
                 "hello", "there"]) == 0
    capsys.readouterr()
    assert main(["replay", str(log), "--full"]) == 0
    out = capsys.readouterr().out
    assert f"model: {model} (from the log's header)" in out and "identical (full): " in out
    assert "fingerprint" not in out  # the same weights
    other = write_tiny_model(tmp_path / "other", seed=9)
    assert main(["replay", str(log), "--full", "--model", str(other)]) == 1  # --model still overrides
    assert "differs from the log's" in capsys.readouterr().out
    shutil.rmtree(model)
    assert main(["replay", str(log), "--full"]) == EX_USAGE
    assert f"cannot load model '{model}': no such file" in capsys.readouterr().err


def test_models_lists_the_default_and_the_stub(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "stub" in out
    assert main(["models", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["name"] for r in rows} >= {"smollm2-135m", "stub"}
    assert all(set(r) == {"name", "available", "description", "source"} for r in rows)


def test_chat_keeps_history_until_exit(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n/reset\nhello again\n/exit\nnever read\n"))
    assert main(["chat", "--model", "stub", "--max-tokens", "6", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert "(conversation reset)" in captured.out
    assert "chat: 2 replies, 12 tokens" in captured.err


ENGINE_KEYS = {"system", "pipeline_depth", "requests", "tokens", "seconds", "tokens_per_s", "cpu_s", "log_cpu_s",
               "log_share", "ticks", "steps", "preemptions", "log_bytes", "runs_tokens_per_s"}
HF_KEYS = {"system", "batch", "requests", "tokens", "computed_tokens", "seconds", "tokens_per_s"}
SUMMARY_KEYS = {"system", "model", "requests", "max_tokens", "batch", "threads", "log_share_max", "log_goal_met",
                "depth2_vs_depth1", "depth2_goal_met"}


def _bench_rows(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    assert main(["bench", "engine", "--json", "--requests", "6", "--max-tokens", "8", "--batch", "4", "--repeat", "1",
                 *argv]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_bench_engine_runs_on_the_stub(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _bench_rows(["--model", "stub"], capsys)
    assert [r["system"] for r in rows] == ["tickloom", "tickloom", "summary"]
    assert [r["pipeline_depth"] for r in rows[:2]] == [1, 2]
    for row in rows[:2]:
        assert set(row) == ENGINE_KEYS
        assert row["requests"] == 6 and row["preemptions"] == 0
    assert rows[0]["tokens"] == rows[1]["tokens"]
    assert set(rows[2]) == SUMMARY_KEYS


@pytest.mark.slow
def test_bench_engine_tiny_model_against_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _bench_rows(["--model", "tiny", "--depths", "2"], capsys)
    assert [r["system"] for r in rows] == ["tickloom", "transformers", "summary"]
    assert set(rows[0]) == ENGINE_KEYS and set(rows[1]) == HF_KEYS
    assert rows[0]["tokens"] == rows[1]["tokens"]
    assert set(rows[2]) == (SUMMARY_KEYS - {"depth2_vs_depth1", "depth2_goal_met"}) | {
        "speedup_vs_transformers", "speedup_goal_met"}


def test_bench_lists_engine_and_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "engine" in out and "model" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "model", "--help"])  # bench_model's own options, added when chosen
    assert exit_info.value.code == 0
    assert "--batch-sizes" in capsys.readouterr().out
