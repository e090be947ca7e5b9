"""The core's configuration as the log header stores it: ``CoreConfig.to_json`` and ``from_json``."""

from __future__ import annotations

import json

import pytest

from tickloom.engine.core import ConfigError, CoreConfig


def test_the_config_round_trips_through_json() -> None:
    config = CoreConfig(num_blocks=40, block_size=8, max_seq_len=128, max_batch_size=3, pipeline_depth=1,
                        eos_token_ids=(2, 7), think_start_token=5, think_end_token=6, spill_enabled=True)
    text = config.to_json()
    assert json.loads(text)["eos_token_ids"] == [2, 7] and json.loads(text)["spill_enabled"] is True
    assert CoreConfig.from_json(text) == config
    assert CoreConfig.from_json(text.encode()) == config


def test_from_json_names_a_field_of_the_wrong_type() -> None:
    text = json.dumps({**json.loads(CoreConfig(num_blocks=200).to_json()), "num_blocks": "many"})
    with pytest.raises(ConfigError, match=r"invalid core config: .*\$\.num_blocks"):
        CoreConfig.from_json(text)


def test_from_json_checks_the_bounds_as_the_constructor_does() -> None:
    text = json.dumps({**json.loads(CoreConfig(num_blocks=200).to_json()), "pipeline_depth": 3})
    with pytest.raises(ConfigError, match=r"invalid core config: Invalid enum value 3 - at `\$\.pipeline_depth`"):
        CoreConfig.from_json(text)
    with pytest.raises(ConfigError, match=r"invalid core config: CoreConfig\.num_blocks=8 cannot hold one max_seq_len"):
        CoreConfig.from_json(json.dumps({**json.loads(CoreConfig(num_blocks=200).to_json()), "num_blocks": 8,
                                         "max_seq_len": 128}))


BASE = {"num_blocks": 9, "block_size": 16, "max_seq_len": 128, "max_batch_size": 4, "max_batch_tokens": 4,
        "vocab_size": 100}
"""A config exactly at its bounds: 9 blocks hold one 128-token sequence (128 // 16 + 1), the token budget equals
the batch size."""


@pytest.mark.parametrize(
    ("change", "message"),
    [
        *[({field: 0}, f"CoreConfig.{field}=0: Expected `int` >= 1 - at `$.{field}`") for field in (
            "num_blocks", "block_size", "max_batch_size", "max_prefill_tokens", "max_batch_tokens", "vocab_size",
            "max_waiting")],
        ({"max_seq_len": 1}, "CoreConfig.max_seq_len=1: Expected `int` >= 2 - at `$.max_seq_len`"),
        *[({field: -1}, f"CoreConfig.{field}=-1: Expected `int` >= 0 - at `$.{field}`") for field in (
            "admit_watermark", "preempt_immunity_tokens")],
        ({"block_size": 4097}, "CoreConfig.block_size=4097: Expected `int` <= 4096 - at `$.block_size`"),
        ({"num_blocks": True}, "CoreConfig.num_blocks=True: Expected `int`, got `bool` - at `$.num_blocks`"),
        ({"pipeline_depth": 0}, "CoreConfig.pipeline_depth=0: Invalid enum value 0 - at `$.pipeline_depth`"),
        ({"pipeline_depth": 3}, "CoreConfig.pipeline_depth=3: Invalid enum value 3 - at `$.pipeline_depth`"),
        ({"max_batch_tokens": 3}, "CoreConfig.max_batch_tokens=3 is below max_batch_size=4: a full batch of decode "
                                  "rows would never fit in one step"),
        ({"num_blocks": 8}, "CoreConfig.num_blocks=8 cannot hold one max_seq_len=128 sequence: that takes 9 blocks "
                            "of block_size=16"),
        ({"think_start_token": 100, "think_end_token": 1}, "CoreConfig.think_start_token=100 is outside "
                                                           "vocab_size=100"),
        ({"think_start_token": 1, "think_end_token": -1}, "CoreConfig.think_end_token=-1: Expected `int` >= 0 - at "
                                                          "`$.think_end_token`"),
        ({"think_start_token": 1, "think_end_token": 100}, "CoreConfig.think_end_token=100 is outside "
                                                           "vocab_size=100"),
        ({"think_start_token": 1}, "CoreConfig.think_start_token=1 and think_end_token=None must be set together"),
        ({"think_end_token": 1}, "CoreConfig.think_start_token=None and think_end_token=1 must be set together"),
        ({"eos_token_ids": (1, 100)}, "CoreConfig.eos_token_ids contains 100, outside vocab_size=100"),
        ({"eos_token_ids": (-1,)}, "CoreConfig.eos_token_ids=(-1,): Expected `int` >= 0 - at `$.eos_token_ids[0]`"),
    ],
)
def test_each_bound_is_checked_and_named(change: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        CoreConfig(**{**BASE, **change})  # type: ignore[arg-type]
    assert str(raised.value) == message


def test_a_config_exactly_at_its_bounds_is_valid() -> None:
    CoreConfig(**BASE, admit_watermark=0, preempt_immunity_tokens=0, pipeline_depth=2,  # type: ignore[arg-type]
               think_start_token=0, think_end_token=99, eos_token_ids=(0, 99), max_prefill_tokens=1, max_waiting=1)
