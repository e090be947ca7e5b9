"""What replay needs from a log header: the core configuration, and the compatibility checks."""

from __future__ import annotations

import json

from engine.core import CoreConfig
from engine.core.errors import ConfigError
from events import DIGEST_VERSION, LogHeader


class ReplayConfigError(ValueError):
    """The header's configuration cannot give a core configuration."""


def core_config_from_header(header: LogHeader) -> CoreConfig:
    """The ``CoreConfig`` a log was written with.

    ``header.config_json`` is either the engine configuration, a JSON object whose ``"core"`` key holds the core
    configuration, or the core configuration itself.
    """
    try:
        data = json.loads(header.config_json)
    except json.JSONDecodeError as exc:
        raise ReplayConfigError(f"config_json is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ReplayConfigError("config_json is not a JSON object")
    core = data.get("core", data)
    if not isinstance(core, dict):
        raise ReplayConfigError('config_json["core"] is not a JSON object')
    try:
        return CoreConfig.from_json(json.dumps(core))
    except ConfigError as exc:
        raise ReplayConfigError(str(exc)) from exc


def digest_problem(header: LogHeader) -> str | None:
    """Why this build cannot check the log's digests, or None."""
    if header.digest_version != DIGEST_VERSION:
        return (
            f"the log's digest version is {header.digest_version}, this build computes version {DIGEST_VERSION}: "
            "its digests cannot be compared"
        )
    return None
