"""What-if runs (``replay/whatif.py``, ``tickloom whatif``): a log's requests re-simulated under another core
configuration, with the log's tokens and modelled step times; with the log's own configuration, exact replay."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import msgspec
import pytest
import trio
from engine_helpers import stub_config
from replay_helpers import Records, rewrite
from scenarios import everything_scenario

from tickloom import Engine, SamplingParams
from tickloom.engine.core import CoreConfig
from tickloom.events import (
    Input,
    LogHeader,
    RequestArrived,
    RequestCancelled,
    RunStep,
    Shutdown,
    StepDone,
    StepFailed,
    TickRecord,
)
from tickloom.replay.oracle import OracleExecutor
from tickloom.replay.record import Scenario, arrival
from tickloom.replay.step_model import StepShape
from tickloom.replay.whatif import read_log, whatif
from tickloom.tools.cli import EX_USAGE, main
from tickloom.tools.commands.whatif import OverrideError, apply_overrides


@attrs.define(slots=True, eq=False)
class TimedOracle(OracleExecutor):
    """The oracle, with a measured step time of 300 µs + 2 µs a prefill token + 7 µs a decode row + 10 ns a position
    of context read + 50 µs a prefill chunk + 40 µs a step of two tokens or more."""

    def run_step(self, step: RunStep) -> StepDone | StepFailed:
        result = OracleExecutor.run_step(self, step)
        if isinstance(result, StepDone):
            shape = StepShape.of(step)
            ns = (300_000 + 2_000 * shape.prefill_tokens + 7_000 * shape.decode_rows + 10 * shape.context
                  + 50_000 * shape.prefill_chunks + 40_000 * (shape.prefill_tokens + shape.decode_rows >= 2))
            return msgspec.structs.replace(result, step_time_ns=ns)
        return result


def pressured_scenario() -> Scenario:
    """12 requests on a 24-block pool (requeue preemptions), two EOS, a stop-string match, running ahead."""
    config = CoreConfig(num_blocks=24, block_size=4, max_batch_size=8, max_seq_len=64, max_prefill_tokens=32,
                        max_batch_tokens=64, pipeline_depth=2, preempt_immunity_tokens=2, eos_token_ids=(2,),
                        vocab_size=512)
    script: dict[int, list[Input]] = {}
    for i in range(12):
        script.setdefault(i // 3, []).append(arrival(f"p{i:02d}", 6 + (i * 5) % 9, 14 + (i * 7) % 19))
    return Scenario(config=config, script=script, scripted={"p03": {6: 2}, "p08": {10: 2}}, stop_at={"p05": 4},
                    device_lag=1)


@pytest.fixture
def pressured(tmp_path: Path) -> Path:
    scenario = pressured_scenario()
    path = tmp_path / "pressured.tlog"
    scenario.record(path, device=TimedOracle(512, avoid=(2,), scripted=dict(scenario.scripted)))
    return path


def test_own_configuration_reproduces_every_decision(tmp_path: Path) -> None:
    """With the log's own configuration the what-if is exact replay: the same commands in every tick, on a log with
    swaps, requeues, running ahead, deadlines, a cancel, a stop match, EOS, a failed step and a failed spill."""
    path = tmp_path / "every.tlog"
    everything_scenario().record(path, snapshot_every=8)
    logged = read_log(path)
    result = whatif(path)
    assert result.mode == "replayed" and result.divergence is None and not result.changes
    assert len(result.run_ticks) == len(logged.ticks)
    for (inputs, out), (logged_inputs, logged_out) in zip(result.run_ticks, logged.ticks, strict=True):
        assert out.commands == logged_out.commands, f"tick {inputs.tick}"
        assert out.digest == logged_out.digest and inputs == logged_inputs
    assert result.whatif.summary() == result.original.summary()
    assert result.original.preemptions and result.original.swaps and result.original.finish_reasons["timeout"]
    assert result.oracle_tokens == {}


def test_more_blocks_fewer_preemptions_same_tokens(pressured: Path) -> None:
    """4x the KV blocks on a pressured log: fewer preemptions, every request finishes as it did, with the tokens
    it received in the original."""
    logged = read_log(pressured)
    more = msgspec.structs.replace(logged.config, num_blocks=4 * logged.config.num_blocks)
    result = whatif(pressured, more, run=logged)
    original, after = result.original, result.whatif
    assert result.mode == "modelled" and result.changes == {"num_blocks": (24, 96)}
    assert original.preemptions > 0 and after.preemptions < original.preemptions
    assert after.requests == original.requests == 12 and after.open == 0
    assert after.reasons == original.reasons and original.finish_reasons == {"length": 9, "stop": 3}
    assert after.outputs == original.outputs, "every request gets the tokens it got in the log"
    assert result.oracle_tokens == {}
    # The step-time model recovers the device's formula from the logged step times.
    model = result.model
    assert model.coefficients == (300_000, 2_000, 7_000, 10, 50_000, 40_000) and model.source == "log"
    assert model.samples > 0 and model.mean_abs_error_ns < 1e-3


def test_modelled_clock_follows_the_model(pressured: Path) -> None:
    """Modelled mode: arrivals at their logged times; a step's result comes at the earliest when the model says it
    can (never sooner than its modelled time after its dispatch)."""
    logged = read_log(pressured)
    result = whatif(pressured, msgspec.structs.replace(logged.config, max_batch_size=4), run=logged)
    arrivals = {m.request_id: i.now_ns for i, _ in logged.ticks for m in i.inputs if isinstance(m, RequestArrived)}
    seen = {m.request_id: i.now_ns for i, _ in result.run_ticks for m in i.inputs if isinstance(m, RequestArrived)}
    assert seen == arrivals
    dispatched: dict[int, tuple[int, RunStep]] = {}
    for inputs, out in result.run_ticks:
        for msg in inputs.inputs:
            if isinstance(msg, StepDone):
                at, step = dispatched.pop(msg.step_id)
                assert inputs.now_ns - at >= result.model.predict(step)
                assert msg.step_time_ns == result.model.predict(step)
        dispatched.update((c.step_id, (inputs.now_ns, c)) for c in out.commands if isinstance(c, RunStep))
    assert not dispatched


def test_cut_short_requests_fall_back_to_the_oracle(tmp_path: Path) -> None:
    """Requests the original ended with an error (a failed step, a failed spill) run on in the what-if: the log's
    tokens first, then the oracle's, and the report says so; faults are not carried over."""
    path = tmp_path / "every.tlog"
    scenario = everything_scenario()
    scenario.record(path)
    result = whatif(path, msgspec.structs.replace(scenario.config, num_blocks=160))
    original, after = result.original, result.whatif
    errored = {rid for rid, reason in original.reasons.items() if reason == "error"}
    assert errored and set(result.oracle_tokens) == errored
    for rid, out in after.outputs.items():
        assert out[: len(original.outputs[rid])] == original.outputs[rid]
        if rid not in errored:
            assert out == original.outputs[rid] and after.reasons[rid] == original.reasons[rid]
    assert after.open == 0 and "error" not in after.finish_reasons
    assert after.finish_reasons["timeout"] == 1 and after.finish_reasons["cancelled"] == 1
    assert after.preemptions == 0
    assert any("failed steps: 1, failed spills: 1" in note for note in result.notes)
    assert any(note.startswith(f"{rid}: the log has") for rid in errored for note in result.notes)


def test_cancel_comes_at_its_logged_time(tmp_path: Path) -> None:
    """A client's cancel is delivered at the logged ``now_ns``, whatever the what-if's own tick count is then."""
    config = CoreConfig(num_blocks=64, block_size=4, max_batch_size=4, max_seq_len=64, vocab_size=512)
    script: dict[int, list[Input]] = {0: [arrival(f"c{i}", 8, 40) for i in range(6)], 12: [RequestCancelled("c5")]}
    path = tmp_path / "cancel.tlog"
    Scenario(config=config, script=script).record(path, device=TimedOracle(512))
    logged = read_log(path)
    result = whatif(path, msgspec.structs.replace(config, max_batch_size=6), run=logged)
    when = [i.now_ns for i, _ in result.run_ticks for m in i.inputs if isinstance(m, RequestCancelled)]
    assert when == [t for t, m in logged.clients if isinstance(m, RequestCancelled)]
    assert result.original.reasons["c5"] == result.whatif.reasons["c5"] == "cancelled"
    assert len(result.whatif.outputs["c5"]) > len(result.original.outputs["c5"]), "batched at once: further along"
    assert result.oracle_tokens == {"c5": len(result.whatif.outputs["c5"]) - len(result.original.outputs["c5"])}


def test_a_shutdown_that_ended_requests_comes_at_its_logged_time(tmp_path: Path) -> None:
    config = CoreConfig(num_blocks=64, block_size=4, max_batch_size=4, max_seq_len=64, vocab_size=512)
    path = tmp_path / "shutdown.tlog"
    Scenario(config=config, script={0: [arrival(f"s{i}", 8, 40) for i in range(6)], 20: [Shutdown()]}).record(path)
    logged = read_log(path)
    assert logged.graceful_shutdown is None
    result = whatif(path, msgspec.structs.replace(config, max_batch_size=6), run=logged)
    when = [i.now_ns for i, _ in result.run_ticks for m in i.inputs if isinstance(m, Shutdown)]
    assert when == [t for t, m in logged.clients if isinstance(m, Shutdown)]
    assert result.whatif.finish_reasons == result.original.finish_reasons == {"error": 6}


def test_a_log_that_contradicts_itself_diverges(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Replayed mode checks the simulated actors against the log: a logged step result whose token is not the
    one the log then committed is reported at its tick, and the command exits 1."""
    path = tmp_path / "every.tlog"
    everything_scenario().record(path)
    edited: list[int] = []

    def edit(header: LogHeader, records: Records) -> tuple[LogHeader, Records]:
        out: Records = []
        for record in records:
            if isinstance(record, TickRecord) and record.inputs.tick > 20 and not edited:
                inputs = list(record.inputs.inputs)
                for k, msg in enumerate(inputs):
                    if isinstance(msg, StepDone) and msg.token_ids:
                        inputs[k] = msgspec.structs.replace(msg, token_ids=[msg.token_ids[0] ^ 1, *msg.token_ids[1:]])
                        edited.append(record.inputs.tick)
                        record = TickRecord(msgspec.structs.replace(record.inputs, inputs=inputs), record.outputs)
                        break
            out.append(record)
        return header, out

    rewrite(path, tmp_path / "edited.tlog", edit)
    result = whatif(tmp_path / "edited.tlog")
    assert result.divergence is not None and result.divergence.startswith(f"tick {edited[0]}: ")
    assert len(result.run_ticks) == edited[0]
    assert main(["whatif", str(tmp_path / "edited.tlog")]) == 1
    assert "DIVERGED" in capsys.readouterr().out


# -- the command line -----------------------------------------------------------------------------------------
def test_cli_table_json_and_plot(pressured: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["whatif", str(pressured), "--set", "num_blocks=96"]) == 0
    table = capsys.readouterr().out
    for row in ("throughput (tok/s)", "TTFT p99 (ms)", "inter-token p50 (ms)", "preemptions", "swap-ins",
                "timeouts", "finished: stop", "num_blocks 24 -> 96"):
        assert row in table
    png = tmp_path / "latency.png"
    assert main(["whatif", str(pressured), "--set", "num_blocks=96", "--json", "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "modelled" and report["set"] == {"num_blocks": {"was": 24, "now": 96}}
    assert report["whatif"]["preemptions"] < report["original"]["preemptions"]
    assert report["config"]["num_blocks"] == 96
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["whatif", str(pressured), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "replayed" and report["divergence"] is None
    assert report["original"] == report["whatif"]


@pytest.mark.parametrize(("setting", "names"), [
    ("num_block=512", "num_block"),
    ("num_blocks=abc", "num_blocks"),
    ("num_blocks=2.5", "num_blocks"),
    ("num_blocks=1", "num_blocks"),
    ("pipeline_depth=3", "pipeline_depth"),
    ("max_batch_tokens=2", "max_batch_tokens"),
    ("num_blocks", "num_blocks"),
    ("spill_enabled=maybe", "spill_enabled"),
    ("num_blocks=99999999999", "num_blocks"),
])
def test_cli_bad_settings_are_usage_errors(pressured: Path, capsys: pytest.CaptureFixture[str], setting: str,
                                           names: str) -> None:
    assert main(["whatif", str(pressured), "--set", setting]) == EX_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and names in err[0] and err[0].startswith("tickloom: error: --set")


def test_overrides_parse_each_field_type() -> None:
    base = pressured_scenario().config
    config = apply_overrides(base, ["eos_token_ids=2,3", "spill_enabled=true", "think_start_token=5",
                                    "think_end_token=6", "admit_watermark=8"])
    assert config.eos_token_ids == (2, 3) and config.spill_enabled and config.admit_watermark == 8
    assert (config.think_start_token, config.think_end_token) == (5, 6)
    assert apply_overrides(config, ["think_start_token=none", "think_end_token=null", "eos_token_ids="]) == \
        msgspec.structs.replace(config, think_start_token=None, think_end_token=None, eos_token_ids=())
    with pytest.raises(OverrideError, match="think_start_token"):
        apply_overrides(base, ["think_start_token=5"])  # the core's own check: both or neither


def test_cli_unreadable_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["whatif", str(tmp_path / "missing.tlog")]) == 2
    assert "unreadable" in capsys.readouterr().out
    bad = tmp_path / "bad.tlog"
    bad.write_bytes(b"not a log at all")
    assert main(["whatif", str(bad), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["status"] == "unreadable"


# -- a real engine's log --------------------------------------------------------------------------------------
async def test_engine_log(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """A stub-engine run (real actors: running ahead, swaps, a stop string, a deadline, a client leaving) is
    reproduced exactly with its own configuration; with 4x the blocks it preempts less and the requests that ended
    on their own get the same tokens."""
    log = tmp_path / "tickloom.engine.tlog"
    config = stub_config(log, num_blocks=24, block_size=8, max_seq_len=96, max_batch_size=8,
                         preempt_immunity_tokens=4, stub_step_time=0.002, host_spill_bytes=1 << 20)

    async def one(engine: Engine, i: int) -> None:
        await trio.sleep(0.003 * i)
        prompt = "".join(chr(40 + (i * 7 + k) % 80) for k in range(12 + (i * 5) % 20))
        params = SamplingParams(max_tokens=20 + (i * 11) % 40, seed=i, stop=["a", "e", "o"] if i == 3 else [])
        seen = 0
        async for out in engine.generate(prompt, params, request_id=f"e{i}", deadline=0.02 if i == 5 else None):
            seen += len(out.token_ids)
            if i == 6 and seen >= 5:
                break  # the client leaves

    async with Engine.open(config) as engine, trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(one, engine, i)
    logged = read_log(log)
    same = whatif(log, run=logged)
    assert same.divergence is None and same.mode == "replayed"
    assert [o.commands for _, o in same.run_ticks] == [o.commands for _, o in logged.ticks]
    assert same.original.swaps > 0 and {"stop", "timeout", "cancelled"} <= set(same.original.reasons.values())
    more = whatif(log, msgspec.structs.replace(logged.config, num_blocks=96), run=logged)
    assert more.whatif.preemptions < more.original.preemptions and more.whatif.open == 0
    for rid, reason in more.original.reasons.items():
        if reason in ("stop", "length"):
            assert more.whatif.outputs[rid] == more.original.outputs[rid]
            assert more.whatif.reasons[rid] == reason
