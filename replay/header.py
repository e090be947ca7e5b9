"""What replay needs from a log header: the core configuration, and the compatibility checks."""

from __future__ import annotations

import json

import msgspec

from tickloom.engine.core import CoreConfig
from tickloom.engine.core.errors import ConfigError
from tickloom.events import DIGEST_VERSION, LogHeader


class ReplayConfigError(ValueError):
    """The header's configuration cannot give a core configuration."""


CORE_LIMITS: dict[str, int] = {
    "num_blocks": 1 << 22,
    "block_size": 1 << 16,
    "max_seq_len": 1 << 24,
    "vocab_size": 1 << 24,
    "max_batch_size": 1 << 16,
    "max_prefill_tokens": 1 << 24,
    "max_batch_tokens": 1 << 24,
    "max_waiting": 1 << 24,
}
"""The largest values replay accepts from a log. A log may come from elsewhere, and the core's block pool is built
from ``num_blocks`` before a single tick runs (about 140 bytes a block: 1 << 22 blocks is some 600 MB), so a
header is checked against these before any core is built from it. Generous for any real deployment."""

MAX_EOS_TOKENS = 1 << 10


def check_core_limits(config: CoreConfig) -> CoreConfig:
    """``config`` if every size in it is within ``CORE_LIMITS``; raises ``ReplayConfigError`` otherwise."""
    for field, limit in CORE_LIMITS.items():
        value = getattr(config, field)
        if value > limit:
            raise ReplayConfigError(f"{field}={value} is over replay's limit of {limit}")
    if len(config.eos_token_ids) > MAX_EOS_TOKENS:
        raise ReplayConfigError(f"{len(config.eos_token_ids)} eos_token_ids is over replay's limit of "
                                f"{MAX_EOS_TOKENS}")
    return config


def core_config_from_header(header: LogHeader) -> CoreConfig:
    """The ``CoreConfig`` a log was written with, validated and within ``CORE_LIMITS``.

    ``header.config_json`` is either the engine configuration, a JSON object whose ``"core"`` key holds the core
    configuration, or the core configuration itself.
    """
    try:
        data = json.loads(header.config_json)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ReplayConfigError(f"config_json is not JSON: {type(exc).__name__}: {exc}") from exc
    if not isinstance(data, dict):
        raise ReplayConfigError("config_json is not a JSON object")
    core = data.get("core", data)
    if not isinstance(core, dict):
        raise ReplayConfigError('config_json["core"] is not a JSON object')
    try:
        config = CoreConfig.from_json(json.dumps(core))
    except (ConfigError, msgspec.MsgspecError, RecursionError) as exc:  # MsgspecError: e.g. NaN in the JSON
        raise ReplayConfigError(str(exc)) from exc
    return check_core_limits(config)


def digest_problem(header: LogHeader) -> str | None:
    """Why this build cannot check the log's digests, or None."""
    if header.digest_version != DIGEST_VERSION:
        return (
            f"the log's digest version is {header.digest_version}, this build computes version {DIGEST_VERSION}: "
            "its digests cannot be compared"
        )
    return None

