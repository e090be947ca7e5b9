"""The deterministic scheduler core: a pure state machine, ``SchedulerCore.tick(TickInputs) -> TickOutputs``.

Imports only ``events``, attrs and the standard library: no trio, torch, clocks, randomness, threads or I/O.
"""

from tickloom.engine.core.config import CoreConfig
from tickloom.engine.core.errors import ConfigError, InvariantViolation
from tickloom.engine.core.scheduler import SchedulerCore

__all__ = ["ConfigError", "CoreConfig", "InvariantViolation", "SchedulerCore"]
