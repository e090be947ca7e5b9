"""Errors the core raises. Bad requests are not errors here: they are answered with ``Finish(error)``."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration; the message names the fields and their values."""


class InvariantViolation(AssertionError):
    """The core's state broke an invariant, or an input contradicted what the core knows.

    Raised by ``SchedulerCore.check_invariants()`` and when a ``StepDone`` does not match the step it settles.
    The message names the invariant and the requests or blocks involved.
    """

    def __init__(self, invariant: str, detail: str) -> None:
        self.invariant = invariant
        self.detail = detail
        super().__init__(f"{invariant}: {detail}")
