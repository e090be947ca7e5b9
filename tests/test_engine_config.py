"""One configuration: the scheduling knobs are declared once and reach the core as they are; the README's table is
rendered from the declarations; ``max_waiting`` bounds the open requests, so the core never refuses one."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from engine_helpers import assert_replays, core_finishes, stub_config

from tickloom import ConfigError, Engine, EngineConfig, EngineOverloaded, SamplingParams
from tickloom.config import configuration_table
from tickloom.engine.core import CoreConfig
from tickloom.engine.core.config import SchedulingKnobs
from tickloom.runtime import core_config_for

README = Path(__file__).resolve().parent.parent / "README.md"
KNOBS = SchedulingKnobs.__struct_fields__


def test_the_readme_table_is_the_one_rendered_from_the_declarations() -> None:
    text = README.read_text()
    found = re.search(r"<!-- configuration-table:start -->\n(.*?)<!-- configuration-table:end -->", text, re.S)
    assert found is not None, "README.md has no configuration table"
    assert found.group(1) == configuration_table(), (
        "README.md's configuration table is stale; paste engine.config.configuration_table() between the markers")


def test_the_table_has_one_row_per_field_with_its_default_and_bound() -> None:
    rows = configuration_table().splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == list(EngineConfig.__struct_fields__)
    assert "| `max_batch_size` (core) | `32` | 1–2**16 | Sequences in one step, at most. |" in rows
    assert any(row.startswith("| `pipeline_depth` (core) | `2` | `1` or `2` |") for row in rows)
    assert any(row.startswith("| `threads` | `None` | None or 1–4096 |") for row in rows)
    assert not any(row.startswith("| `model` (core)") for row in rows), "only the scheduling knobs are core"


def test_engine_and_core_share_every_knob_with_its_default_and_bound() -> None:
    engine_fields = {f.name: f for f in msgspec.structs.fields(EngineConfig)}
    core_fields = {f.name: f for f in msgspec.structs.fields(CoreConfig)}
    for name in KNOBS:
        assert engine_fields[name] == core_fields[name], name
    assert EngineConfig().pipeline_depth == CoreConfig(num_blocks=300).pipeline_depth == 2


@pytest.mark.parametrize(("field", "value"), [
    ("block_size", 4097), ("max_batch_size", 0), ("max_seq_len", 1), ("max_waiting", 0), ("pipeline_depth", 3),
    ("admit_watermark", -1), ("preempt_immunity_tokens", 2**31 + 1), ("prefix_caching", 1),
    ("think_start_token", -1),
])
def test_a_knob_out_of_its_bound_is_refused_alike_by_engine_and_core(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as engine_error:
        EngineConfig(**{field: value})
    with pytest.raises(ConfigError) as core_error:
        CoreConfig(num_blocks=300, **{field: value})
    assert str(engine_error.value).startswith(f"EngineConfig.{field}=")
    assert str(core_error.value) == str(engine_error.value).replace("EngineConfig.", "CoreConfig.", 1)


def test_knob_relations_are_checked_by_both() -> None:
    for make in (lambda **kw: EngineConfig(**kw), lambda **kw: CoreConfig(num_blocks=300, **kw)):
        with pytest.raises(ConfigError, match="max_batch_tokens=8 is below max_batch_size=16"):
            make(max_batch_size=16, max_batch_tokens=8)
        with pytest.raises(ConfigError, match="must be set together"):
            make(think_end_token=3)


def test_the_core_gets_every_knob_as_given_and_only_the_derived_fields_from_the_engine() -> None:
    """Each knob set to a value other than its default arrives in the core unchanged (no copy to forget)."""
    knobs: dict[str, Any] = dict(block_size=8, max_batch_size=5, max_seq_len=100, max_prefill_tokens=33,
                                 max_batch_tokens=77, admit_watermark=3, pipeline_depth=1, preempt_immunity_tokens=9,
                                 prefix_caching=False, max_waiting=11, think_start_token=4, think_end_token=5,
                                 speculative_tokens=3, speculative_max_running=3)
    assert set(knobs) == set(KNOBS)
    defaults = EngineConfig()
    assert all(getattr(defaults, name) != value for name, value in knobs.items())
    config = EngineConfig(model="stub", host_spill_bytes=1 << 20, **knobs)
    core = core_config_for(config, num_blocks=64, vocab_size=96, eos_token_ids=(95,))
    assert {name: getattr(core, name) for name in KNOBS} == knobs
    assert (core.num_blocks, core.vocab_size, core.eos_token_ids, core.spill_enabled) == (64, 96, (95,), True)
    assert core_config_for(config, num_blocks=64, max_seq_len=50).max_seq_len == 50


async def test_max_waiting_bounds_the_open_requests_so_the_core_never_refuses_one(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """With max_waiting=3 and one sequence per step: three requests open (one running, two waiting), a fourth is
    refused at submit (reject) and never reaches the core; once one finishes, a fourth fits."""
    log = tmp_path / "run.tlog"
    async with Engine.open(stub_config(log, max_waiting=3, max_batch_size=1, overload="reject")) as engine:
        assert engine.runtime.core_config.max_waiting == 3
        streams = [engine.generate("go", SamplingParams(max_tokens=5), request_id=f"r{i}") for i in range(3)]
        for stream in streams:
            await stream.start()
        with pytest.raises(EngineOverloaded):
            await engine.generate("one more", SamplingParams(max_tokens=5), request_id="r3").start()
        assert [out async for out in streams[0]][-1].finish_reason == "length"
        with trio.fail_after(60):
            while engine.runtime.free_slots == 0:
                await trio.sleep(0.01)
        last = await engine.complete("now", SamplingParams(max_tokens=5), request_id="r4")
        assert last.finish_reason == "length"
    finishes = core_finishes(log)
    assert "r3" not in finishes and {finishes[f"r{i}"].reason for i in (0, 1, 2, 4)} == {"length"}
    assert_replays(log)
