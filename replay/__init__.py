"""Exact replay of tickloom logs: verification, divergence reports, seek and bisect.

Imports the core and ``events`` only; neither trio nor torch (``replay.full`` imports torch when it runs a model).
"""

from tickloom.replay.header import ReplayConfigError, core_config_from_header
from tickloom.replay.verify import ReplayReport, bisect, core_at, format_report, open_log, state_at, verify

__all__ = [
    "ReplayConfigError",
    "ReplayReport",
    "bisect",
    "core_at",
    "core_config_from_header",
    "format_report",
    "open_log",
    "state_at",
    "verify",
]
