"""The what-if checked against real runs on the stub, whose step time is known exactly (``stub_step_time``, virtual
time under ``MockClock``): predictions within 10% of the real run, and ``whatif --validate``'s re-run and table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from engine_helpers import stub_config

from tickloom import Engine, SamplingParams
from tickloom.engine.core import CoreConfig
from tickloom.replay.record import arrival, record_core_run
from tickloom.replay.whatif import read_log, whatif
from tickloom.replay.whatif_measure import RunMetrics, measure, percentile
from tickloom.tools.cli import EX_USAGE, main
from tickloom.tools.commands._whatif_validate import FIGURES, run_for_real, validate

BASE: dict[str, Any] = dict(num_blocks=40, block_size=8, max_seq_len=128, max_batch_size=8, stub_step_time=0.005,
                            max_prefill_tokens=64)
"""A pool small enough to preempt, batches that fill, prompts that take several prefill chunks."""


def workload(n: int = 40) -> list[tuple[float, str, int]]:
    """(arrival s, prompt, max_tokens): bursts of ten, arriving between the stub's 5 ms steps (an arrival at the
    very instant a step ends may land in either tick of the real engine, but always in the same tick of the
    what-if)."""
    out = []
    for i in range(n):
        prompt = "".join(chr(40 + (i * 7 + k) % 80) for k in range(10 + (i * 13) % 50))
        out.append((0.00413 * i + 0.0317 * (i // 10), prompt, 8 + (i * 11) % 40))
    return out


async def _drive(config: Any) -> None:
    async def one(engine: Engine, i: int, at: float, prompt: str, max_tokens: int) -> None:
        await trio.sleep(at)
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=max_tokens, seed=i), request_id=f"w{i}"):
            pass

    async with Engine.open(config) as engine, trio.open_nursery() as nursery:
        for i, (at, prompt, max_tokens) in enumerate(workload()):
            nursery.start_soon(one, engine, i, at, prompt, max_tokens)


def record_stub(path: Path, **changes: Any) -> Path:
    """The workload on the stub engine, in virtual time, logged at ``path``."""
    trio.run(_drive, stub_config(path, **{**BASE, **changes}), clock=trio.testing.MockClock(autojump_threshold=0))
    return path


def quantiles(m: RunMetrics) -> dict[str, float]:
    out = {}
    for name, values in (("ttft", m.ttft_ns), ("itl", m.itl_ns)):
        for q in (50, 90):
            value = percentile(values, q)
            assert value is not None
            out[f"{name} p{q}"] = value
    return out


@pytest.fixture(scope="module")
def base_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_stub(tmp_path_factory.mktemp("stub") / "base.tlog")


CHANGES = [("max_batch_size", 4), ("max_batch_size", 16), ("num_blocks", 20), ("num_blocks", 80),
           ("max_prefill_tokens", 16), ("pipeline_depth", 1)]


@pytest.mark.slow
@pytest.mark.parametrize(("key", "value"), CHANGES)
def test_predictions_within_ten_percent_of_the_real_run(base_log: Path, tmp_path: Path, key: str, value: int) -> None:
    """Half and double the batch and the pool, a smaller prefill chunk, no running ahead: the what-if of the base
    log predicts p50 and p90 TTFT and inter-token latency within 10% of the same workload really run so."""
    logged = read_log(base_log)
    result = whatif(base_log, msgspec.structs.replace(logged.config, **{key: value}), run=logged)
    assert result.mode == "modelled" and result.model.source == "stub" and not result.extrapolated
    real = measure(read_log(record_stub(tmp_path / "real.tlog", **{key: value})).ticks)
    predicted, measured = quantiles(result.whatif), quantiles(real)
    for figure, truth in measured.items():
        assert predicted[figure] == pytest.approx(truth, rel=0.10), figure
    assert result.whatif.completion_tokens == real.completion_tokens
    # the change matters: the base run's figures are not the new ones
    if key != "pipeline_depth" or value != 1:
        assert quantiles(measure(logged.ticks)) != measured
    # --validate's re-run of the log's arrivals is the same real run
    again, clock = run_for_real(base_log, logged, result.config)
    assert clock.startswith("virtual") and quantiles(again) == measured


def test_the_stub_model_is_exact_and_its_intervals_are_points(base_log: Path) -> None:
    logged = read_log(base_log)
    result = whatif(base_log, msgspec.structs.replace(logged.config, max_batch_size=4), run=logged)
    model = result.model
    assert model.source == "stub" and model.per_step_ns == 5_000_000 and model.bounds is None
    assert model.why == "the log was written by the stub model, whose step time is fixed"
    summary = result.whatif.summary()
    assert result.intervals and all(lo == hi == summary[k] for k, (lo, hi) in result.intervals.items())
    assert "valid for any step" in model.describe_range() or model.describe_range() == "any step"


def test_validate_prints_predicted_against_measured(base_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["whatif", str(base_log), "--set", "max_batch_size=4", "--validate"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("validate: "))
    assert "(virtual (the stub under trio's MockClock))" in lines[start]
    assert lines[start + 1].split() == ["predicted", "interval", "measured", "ratio"]
    rows = lines[start + 2 : start + 2 + len(FIGURES)]
    assert [row[:22].strip() for row in rows] == [label for label, _ in FIGURES]
    for row in rows:
        predicted, interval, measured, ratio = row[22:].split()
        assert ratio == "1.00x" and predicted == measured and interval == f"{predicted}-{predicted}"
    assert main(["whatif", str(base_log), "--set", "max_batch_size=4", "--validate", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["validate"]
    assert report["clock"].startswith("virtual") and report["step_model"] == "stub"
    assert [r["key"] for r in report["rows"]] == [key for _, key in FIGURES]
    for row in report["rows"]:
        assert set(row) == {"figure", "key", "predicted", "low", "high", "measured", "ratio"}
        assert row["ratio"] == pytest.approx(1.0) and row["low"] <= row["predicted"] <= row["high"]


def test_validate_against_a_baseline_rerun(base_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--baseline rerun`` (the default for a model's log, whose host speed drifts between recording and validation):
    before each changed run the log's arrivals are re-run under the log's own configuration, and the prediction
    compared is the what-if of that fresh recording. On the stub, in virtual time, the fresh recording is the log
    again: its figures are the log's, and the prediction made from it is the log's own, figure for figure."""
    logged = read_log(base_log)
    prediction = whatif(base_log, msgspec.structs.replace(logged.config, max_batch_size=4), run=logged)
    report = validate(base_log, prediction, logged, baseline="rerun", rounds=2)
    assert report.baseline == "rerun" and len(report.rounds) == 2 and report.step_model == "stub"
    logged_figures, predicted = prediction.original.summary(), prediction.whatif.summary()
    for r in report.rounds:
        assert r.baseline is not None and r.from_log == predicted
        assert [r.baseline[k] for _, k in FIGURES] == [logged_figures[k] for _, k in FIGURES]
        assert [r.predicted[k] for _, k in FIGURES] == [predicted[k] for _, k in FIGURES]
        assert r.measured == report.rounds[0].measured
    assert [row["ratio"] for row in report.rows()] == pytest.approx([1.0] * len(FIGURES))
    text = report.format_text()
    assert "baseline: before each changed run, the same arrivals re-run under the log's own configuration" in text
    assert "2 rounds: each figure is the median over them, and each ratio the median of the rounds' own" in text
    count = f"{predicted['preemptions']} ({predicted['requeues']}, {predicted['swaps']})"
    assert f"preemptions (requeued, swapped): predicted {count}, measured {count}" in text
    lines = text.splitlines()
    head = lines.index(f"inter-token p50 (ms) by round (the log: {logged_figures['itl_ms_p50']:.3f})")
    p50, base = f"{predicted['itl_ms_p50']:.3f}", f"{logged_figures['itl_ms_p50']:.3f}"
    # virtual time: no slowdown to measure, so the prediction is the baseline's own, uncorrected
    for i in (1, 2):
        assert lines[head + 1 + i].split() == [str(i), p50, p50, "1.00x", "-,", "-", p50, "(1.00x)", base, p50,
                                               "(1.00x)"]
    assert all(r.speed == 1.0 and r.uncorrected == r.predicted for r in report.rounds)
    # the stub's default is the log itself (nothing drifts in virtual time); a round count below 1 is refused
    assert validate(base_log, prediction, logged).baseline == "log"
    args = ["whatif", str(base_log), "--set", "max_batch_size=4", "--validate", "--json"]
    assert main([*args, "--baseline", "rerun"]) == 0
    out = json.loads(capsys.readouterr().out)["validate"]
    assert out["baseline"] == "rerun" and len(out["rounds"]) == 1
    assert out["counts"]["preemptions"] == {"predicted": predicted["preemptions"], "measured": predicted["preemptions"]}
    assert out["rounds"][0]["baseline_itl_ms_p50"] == out["log_itl_ms_p50"] == logged_figures["itl_ms_p50"]
    assert main([*args, "--rounds", "0"]) == EX_USAGE
    assert "--rounds takes a number >= 1" in capsys.readouterr().err


def test_a_slower_host_stretches_the_prediction(base_log: Path) -> None:
    """``speed``: every modelled step time times it (``--validate`` sets it from the real runs' slowdowns). The
    stub's 5 ms steps at twice the time give a 10 ms inter-token p50; and a round's speed is the changed run's
    slowdown over its baseline's."""
    from tickloom.tools.commands._whatif_validate import Round

    logged = read_log(base_log)
    config = msgspec.structs.replace(logged.config, max_batch_size=4)
    plain, slow = whatif(base_log, config, run=logged), whatif(base_log, config, run=logged, speed=2.0)
    assert plain.whatif.summary()["itl_ms_p50"] == pytest.approx(5.0)
    assert slow.whatif.summary()["itl_ms_p50"] == pytest.approx(10.0)
    assert slow.model.per_step_ns == 2 * plain.model.per_step_ns and "x2.000 for the host's speed" in slow.model.why
    assert Round({}, {}, baseline_slowdown=1.25, slowdown=2.0).speed == pytest.approx(1.6)
    assert Round({}, {}, baseline_slowdown=None, slowdown=2.0).speed == 1.0


def test_over_rounds_a_ratio_is_the_median_of_each_rounds_own() -> None:
    """Each round's prediction is set against its own run (the same moment of the host): a figure's ratio over
    rounds is the median of the rounds' ratios, not the ratio of two medians taken from different rounds."""
    from tickloom.tools.commands._whatif_validate import Round, ValidateReport

    def summary(itl: float) -> dict[str, object]:
        return {**{key: 1.0 for _, key in FIGURES}, "itl_ms_p50": itl, "preemptions": 0, "requeues": 0, "swaps": 0}

    rounds = [Round(summary(p), summary(m)) for p, m in ((100.0, 100.0), (200.0, 100.0), (300.0, 250.0))]
    report = ValidateReport(summary(200.0), {}, summary(100.0), "real time", "log", False, rounds)
    ratios = {row["key"]: row["ratio"] for row in report.rows()}
    assert ratios["itl_ms_p50"] == pytest.approx(1.2) and ratios["ttft_ms_p50"] == pytest.approx(1.0)
    assert report.baseline == "log" and "3 rounds" in report.format_text()


def test_validate_needs_an_engine_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = CoreConfig(num_blocks=64, block_size=4, max_batch_size=4, max_seq_len=64, vocab_size=512)
    log = tmp_path / "core.tlog"
    record_core_run(log, config, {0: [arrival("c0", 8, 10)]})
    assert main(["whatif", str(log), "--set", "max_batch_size=2", "--validate"]) == EX_USAGE
    assert "--validate re-runs an engine: this log has no engine configuration" in capsys.readouterr().err
    assert main(["whatif", str(tmp_path / "base.tlog"), "--set", "vocab_size=200", "--validate"]) == 2  # no log


def test_validate_refuses_what_an_engine_cannot_take(base_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["whatif", str(base_log), "--set", "vocab_size=200", "--validate"]) == EX_USAGE
    assert "vocab_size comes from the model" in capsys.readouterr().err
