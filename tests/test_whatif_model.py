"""The what-if's step-time model (``replay/step_model.py``, ``replay/whatif_model.py``): a non-negative fit of the
physics, which model a what-if runs on and why, the range it is valid for and the extrapolation beyond it, and the
interval around each predicted figure."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import msgspec
import numpy as np
import pytest

from tickloom.engine.core import CoreConfig
from tickloom.events import Input, LogReader, RunStep, StepDone, StepFailed
from tickloom.replay.oracle import OracleExecutor
from tickloom.replay.record import arrival, record_core_run
from tickloom.replay.step_model import (
    Profile,
    StepModel,
    StepSample,
    StepShape,
    fit_step_model,
    load_profile,
    nnls,
    save_profile,
)
from tickloom.replay.whatif import read_log, whatif
from tickloom.replay.whatif_measure import FIGURES
from tickloom.tools.cli import EX_USAGE, main

PHYSICS = (300_000.0, 2_000.0, 7_000.0, 10.0, 50_000.0, 40_000.0)
"""per step, per prefill token, per decode row, per position of context read, per prefill chunk, per step of two
tokens or more (ns)."""


def physics_ns(shape: StepShape, scale: float = 1.0) -> int:
    return round(scale * sum(c * f for c, f in zip(PHYSICS, shape.features(), strict=True)))


@attrs.define(slots=True, eq=False)
class PhysicsOracle(OracleExecutor):
    """The oracle, each step measured at ``PHYSICS``' time, times a pseudo-random factor in [1 - noise, 1 + noise]."""

    noise: float = 0.0

    def run_step(self, step: RunStep) -> StepDone | StepFailed:
        result = OracleExecutor.run_step(self, step)
        if isinstance(result, StepDone):
            factor = 1 + self.noise * (((step.step_id * 37) % 11) - 5) / 5
            return msgspec.structs.replace(result, step_time_ns=physics_ns(StepShape.of(step), factor))
        return result


CONFIG = CoreConfig(num_blocks=256, block_size=4, max_batch_size=2, max_seq_len=64, max_prefill_tokens=16,
                    vocab_size=512)


def record(path: Path, config: CoreConfig = CONFIG, noise: float = 0.0) -> Path:
    """16 requests, two every three ticks, logged with a model fingerprint (so a profile can be found for it)."""
    script: dict[int, list[Input]] = {}
    for i in range(16):
        script.setdefault(3 * (i // 2), []).append(arrival(f"q{i:02d}", 5 + (i * 3) % 11, 12 + (i * 5) % 13))
    record_core_run(path, config, script, device=PhysicsOracle(512, noise=noise), model_fingerprint="fp-physics")
    return path


def store_profile(log: Path, scale: float) -> Path:
    """A profile for ``log``'s model: a grid of shapes measured at ``PHYSICS`` x ``scale``."""
    with LogReader(log) as reader:
        h = reader.header
    shapes = [StepShape(0, rows, rows * (ctx + 1)) for rows in (1, 2, 4, 8, 16) for ctx in (8, 32)]
    shapes += [StepShape(n, 0, n * start + n * (n + 1) // 2, 1) for n in (4, 16, 32) for start in (0, 16)]
    shapes += [StepShape(2 * n, 0, 2 * (n * start + n * (n + 1) // 2), 2) for n in (4, 16) for start in (0, 16)]
    samples = tuple(StepSample(s, physics_ns(s, scale)) for s in shapes)
    return save_profile(Profile("physics", h.model_fingerprint, h.device, h.dtype, h.threads, "test", samples))


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TICKLOOM_CACHE", str(tmp_path / "cache"))


# -- the fit --------------------------------------------------------------------------------------------------
def test_the_fit_recovers_the_physics() -> None:
    shapes = [StepShape(p, d, c, k) for p, d, c, k in [(0, 1, 9, 0), (0, 4, 60, 0), (32, 0, 528, 1), (16, 3, 400, 1),
                                                       (0, 8, 900, 0), (64, 1, 2500, 2), (0, 2, 30, 0), (8, 0, 36, 1)]]
    model = fit_step_model([StepSample(s, physics_ns(s), physics_ns(s) + 500) for s in shapes])
    assert model.coefficients == PHYSICS and model.overhead_ns == 500
    assert model.source == "log" and model.samples == 8 and model.mean_abs_error_ns < 1e-3
    assert model.bounds == ((0, 64), (0, 8), (9, 2500))
    assert model.time(StepShape(0, 1, 20)) == 300_000 + 7_000 + 200 + 500
    assert model.time(StepShape(0, 2, 20)) == 300_000 + 14_000 + 200 + 40_000 + 500
    assert model.time(StepShape(10, 0, 55, 1)) == 300_000 + 20_000 + 550 + 50_000 + 40_000 + 500


def test_the_fit_never_goes_negative_where_plain_least_squares_does() -> None:
    """Decode steps on a busy host: rows and tokens move together and the times fall as the batch grows. A plain
    least squares gives a negative cost (the old model's -3.6 ms a row); the fit's costs are all >= 0, and it is the
    best such fit of the relative errors (the Karush-Kuhn-Tucker conditions hold)."""
    rows = [1, 1, 2, 2, 3, 3, 4, 4, 3, 2]
    times = [31e6, 29e6, 27e6, 26e6, 24e6, 25e6, 22e6, 23e6, 24.5e6, 26.5e6]
    samples = [StepSample(StepShape(0, r, r * (40 + 3 * k)), int(t)) for k, (r, t) in enumerate(zip(rows, times,
                                                                                                      strict=True))]
    y = np.array([float(s.step_time_ns) for s in samples])
    x = np.array([s.shape.features() for s in samples]) / y[:, None]  # each step weighed by its time's inverse
    y = np.ones(len(samples))
    assert np.linalg.lstsq(x, y, rcond=None)[0].min() < 0, "the plain fit goes negative here"
    model = fit_step_model(samples)
    c = np.array(model.coefficients)
    assert (c >= 0).all()
    gradient = x.T @ (x @ c - y)
    scale = np.abs(x.T @ y)
    for ci, gi, si in zip(c, gradient, scale, strict=True):
        assert gi >= -1e-6 * si  # no cost could fall and fit better
        if ci > 0:
            assert abs(gi) <= 1e-6 * si  # a positive cost sits at the optimum
    assert 22e6 <= model.time(StepShape(0, 1, 40)) <= 31e6


def test_nnls_against_a_brute_force_grid() -> None:
    rng = np.random.default_rng(3)
    x = rng.uniform(0, 5, size=(30, 3))
    y = x @ np.array([2.0, -1.0, 0.5]) + rng.normal(0, 0.1, 30)
    c = np.array(nnls(x.tolist(), y.tolist()))
    assert (c >= 0).all() and c[1] == 0
    best = min(((x @ np.array(g) - y) ** 2).sum() for g in np.ndindex(41, 1, 41)
               for g in [(g[0] * 0.1, 0.0, g[2] * 0.025)])
    assert ((x @ c - y) ** 2).sum() <= best + 1e-9


def test_a_shape_outside_the_range_is_named() -> None:
    model = StepModel(1.0, bounds=((0, 10), (0, 4), (10, 1000)))
    assert model.outside(StepShape(5, 4, 1000)) == ()
    assert model.outside(StepShape(5, 4, 1100)) == ()  # within the slack
    assert model.outside(StepShape(0, 8, 500)) == ("decode_rows",)
    assert model.outside(StepShape(40, 0, 5000)) == ("prefill_tokens", "context")
    assert StepModel(1.0).outside(StepShape(10**6, 10**6, 10**9)) == ()  # no range: the stub's, valid anywhere


def test_a_profile_scaled_to_a_log_takes_each_class_of_step_at_the_logs_own_time() -> None:
    """``rescaled``: the profile's shape at the log's overall speed, and a class of step (its decode rows, or
    prefilling) the log measured 3 or more times at that class's own median: here the log's 1-row steps ran twice
    the profile's time (a busy host does not slow every shape alike), its 4-row steps the profile's. A class the log
    lacks takes its nearest row count's factor (ties to the larger); a prefill the log lacks, none."""
    from tickloom.replay.step_model import rescaled

    grid = [StepShape(0, rows, rows * (ctx + 1)) for rows in (1, 2, 4, 8) for ctx in (8, 32)]
    grid += [StepShape(n, 0, n * (n + 1) // 2, 1) for n in (4, 16, 32)]
    profile = fit_step_model([StepSample(shape, physics_ns(shape)) for shape in grid], source="calibration")
    one, four = StepShape(0, 1, 20), StepShape(0, 4, 80)
    log = [StepSample(one, 2 * physics_ns(one))] * 4 + [StepSample(four, physics_ns(four))] * 9
    model, scale = rescaled(profile, log)
    assert scale == pytest.approx(1.0, rel=1e-3)
    assert dict(model.local) == pytest.approx({1: 2.0, 4: 1.0}, rel=1e-3)
    for shape, factor in ((one, 2.0), (StepShape(0, 2, 40), 2.0), (StepShape(0, 3, 60), 1.0),
                          (StepShape(0, 8, 160), 1.0), (StepShape(16, 0, 136, 1), 1.0)):
        assert model.device_time(shape) == pytest.approx(factor * physics_ns(shape), rel=1e-3), shape
    assert model.ratios == pytest.approx([1.0] * 13, rel=1e-3)  # the log's steps, each at its class's time
    assert "1 row x2.00, 4 rows x1.00" in model.describe()
    assert rescaled(profile, log[:2] + log[4:])[0].local == ((4, pytest.approx(1.0, rel=1e-3)),)  # 2 are too few


def test_a_profile_round_trips_and_a_bad_one_is_named(tmp_path: Path) -> None:
    samples = (StepSample(StepShape(0, 2, 20), 1234), StepSample(StepShape(8, 0, 36, 1), 5678))
    path = save_profile(Profile("m", "fp", "cpu", "float32", 2, "box", samples))
    assert path.parent == tmp_path / "cache" / "calibration"
    loaded, where = load_profile("fp", "cpu", "float32", 2) or (None, None)
    assert loaded == Profile("m", "fp", "cpu", "float32", 2, "box", samples) and where == path
    assert load_profile("fp", "cpu", "float32", 1) is None  # another thread count: another profile
    path.write_text("{}")
    with pytest.raises(ValueError, match=str(path)):
        load_profile("fp", "cpu", "float32", 2)


# -- which model, and why -------------------------------------------------------------------------------------
def test_the_logs_own_steps_when_they_cover_the_whatif(tmp_path: Path) -> None:
    log = record(tmp_path / "a.tlog")
    store_profile(log, 2.0)  # there, but not needed
    result = whatif(log, modelled=True)
    assert result.model.source == "log" and result.model.mean_abs_error_ns < 1e-3  # the log's steps, exactly
    assert result.model.why.startswith("fitted on the log's own steps: ")
    assert "of the what-if's steps have 3 or more of the log's steps of their shape" in result.model.why
    ext = result.extrapolation
    assert not result.extrapolated and ext is not None and ext.fraction <= 0.02
    assert any(n.startswith("step model: log: fitted on the log's own steps") for n in result.notes)


def test_the_profile_when_the_log_does_not_cover_the_whatif(tmp_path: Path) -> None:
    """Logged at batch 2, asked at batch 16: the log's steps say nothing about 16 rows, so the profile is used,
    scaled to the log's speed (measured at twice the log's times, it is halved back to the physics)."""
    log = record(tmp_path / "a.tlog")
    path = store_profile(log, 2.0)
    result = whatif(log, msgspec.structs.replace(CONFIG, max_batch_size=16))
    model = result.model
    assert model.source == "calibration" and model.profile_path == str(path)
    assert "only" in model.why and "scaled by 0.50" in model.why
    assert model.coefficients == pytest.approx(PHYSICS, rel=1e-9)
    assert not result.extrapolated  # the profile spans 16 rows
    assert json.loads(json.dumps(result.to_json()))["step_model"]["source"] == "calibration"


def test_without_a_profile_the_log_fit_says_it_extrapolates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = record(tmp_path / "a.tlog")
    result = whatif(log, msgspec.structs.replace(CONFIG, max_batch_size=16))
    assert result.model.source == "log" and "no calibration profile" in result.model.why
    ext = result.extrapolation
    assert result.extrapolated and ext is not None and ext.outside > 0 and "decode_rows" in ext.by_dimension
    assert any(n.startswith("EXTRAPOLATION: ") and "decode rows 0-2" in n for n in result.notes)
    assert main(["whatif", str(log), "--set", "max_batch_size=16"]) == 0
    out = capsys.readouterr().out
    assert "EXTRAPOLATED" in out and "step model: log" in out and "valid for" in out
    assert main(["whatif", str(log), "--set", "max_batch_size=16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["extrapolated"] is True and report["extrapolation"]["outside"] == ext.outside
    assert report["step_model"]["valid_for"]["decode_rows"] == [0, 2]


def test_step_model_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = record(tmp_path / "a.tlog")
    assert main(["whatif", str(log), "--set", "max_batch_size=4", "--step-model", "calibration"]) == EX_USAGE
    assert "no calibration profile" in capsys.readouterr().err
    store_profile(log, 1.0)
    forced = whatif(log, msgspec.structs.replace(CONFIG, max_batch_size=16), step_model="log")
    assert forced.model.source == "log" and forced.extrapolated
    asked = whatif(log, modelled=True, step_model="calibration")
    assert asked.model.source == "calibration" and asked.model.why.startswith("asked for")


# -- intervals ------------------------------------------------------------------------------------------------
def test_every_figure_has_an_interval_around_the_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = record(tmp_path / "noisy.tlog", noise=0.3)
    logged = read_log(log)
    result = whatif(log, msgspec.structs.replace(CONFIG, max_batch_size=3), run=logged)
    assert result.model.ratios and min(result.model.ratios) < 1 < max(result.model.ratios)
    assert set(result.intervals) == set(FIGURES)
    summary = result.whatif.summary()
    for key, (lo, hi) in result.intervals.items():
        value = summary[key]
        assert isinstance(value, float) and lo <= value <= hi, key
    assert any(lo < hi for lo, hi in result.intervals.values())
    assert any(n.startswith("intervals: the least and most each figure came to over 8 runs") for n in result.notes)
    assert main(["whatif", str(log), "--set", "max_batch_size=3"]) == 0
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if "original" in line)
    assert header.split() == ["original", "what-if", "interval"]
    lo, hi = result.intervals["itl_ms_p50"]
    assert f"{lo:.3f}-{hi:.3f}" in table


# -- tickloom bench calibrate ---------------------------------------------------------------------------------
def test_bench_calibrate_stores_a_profile_whatif_finds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On a tiny model: every shape of the grid measured ``--repeat`` times, the profile stored under the model's
    fingerprint and setting, and found again by that key (as a log's header names it)."""
    from tickloom.engine.model.loaders import load_model
    from tickloom.engine.model.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "tiny", seed=0)
    args = ["bench", "calibrate", "--model", str(model_dir), "--threads", "1", "--batch-sizes", "1", "3",
            "--contexts", "1", "8", "--prefill", "4", "--repeat", "2", "--json", "--quiet"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # decode: 2 sizes x 2 contexts; prefill: 1 length x 3 starts; mixed: 2 sizes x 1 length; each twice
    assert out["samples"] == 2 * (4 + 3 + 2) and out["threads"] == 1
    assert out["waited_s"] >= 0  # the time the steps waited for a CPU, taken out of their samples
    assert out["step_model"]["source"] == "calibration" and out["profile"]
    fingerprint = load_model(model_dir, num_threads=1).fingerprint
    found = load_profile(fingerprint, out["device"], out["dtype"], 1)
    assert found is not None and str(found[1]) == out["profile"] and len(found[0].samples) == out["samples"]
    assert all(s.step_time_ns > 0 for s in found[0].samples)
    assert main(["bench", "calibrate", "--model", "stub"]) == EX_USAGE
