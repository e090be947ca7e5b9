"""Plays every actor around a ``SchedulerCore`` for the core scenarios: a fixed policy over the simulator.

``Harness`` is ``replay.sim.Simulator`` with ``replay.policy.Policy``: the device is a FIFO of executor commands;
each tick it completes ``steps_per_tick`` RunSteps (the oracle answers them) after ``device_lag`` ticks, and the
results arrive as inputs of the next tick. Spills succeed (unless scripted to fail) and are reported in the next
tick, together with ``SwapInReady`` (unless ``auto_swap_ready`` is off). No ``DeadlineReached`` is sent: the core's
own sweep times requests out. Every tick's outputs are checked against the client-visible rules (exactly one finish
per request, no token after it, no token twice) and, unless turned off, against ``check_invariants()``.
"""

from __future__ import annotations

from collections.abc import Iterable

from tickloom.engine.core import CoreConfig, SchedulerCore
from tickloom.events import RequestArrived, SamplingSpec
from tickloom.replay.oracle import OracleExecutor
from tickloom.replay.policy import Policy
from tickloom.replay.sim import TICK_NS, Simulator

__all__ = ["TICK_NS", "Harness", "arrival"]


def arrival(request_id: str, prompt: list[int] | int, max_tokens: int = 8, **kw: object) -> RequestArrived:
    """An arrival; an int prompt means that many distinct tokens derived from the request id."""
    if isinstance(prompt, int):
        base = 1000 + 97 * sum(map(ord, request_id))
        prompt = [(base + 7 * i) % 800 + 100 for i in range(prompt)]
    params = kw.pop("params", None) or SamplingSpec(max_tokens=max_tokens)
    seed = kw.pop("seed", sum(map(ord, request_id)))
    return RequestArrived(request_id, prompt, params, seed=seed, **kw)  # type: ignore[arg-type]


def default_oracle(config: CoreConfig) -> OracleExecutor:
    """The oracle for ``config``: it never produces EOS or a think marker unless scripted."""
    avoid = tuple(config.eos_token_ids) + tuple(
        t for t in (config.think_start_token, config.think_end_token) if t is not None
    )
    return OracleExecutor(config.vocab_size, avoid=avoid)


class Harness(Simulator):
    """The core tests' driver: ``step(*inputs)`` runs one tick, ``run()`` ticks until idle (``Simulator``)."""

    def __init__(
        self,
        config: CoreConfig,
        *,
        steps_per_tick: int = 1,
        check: bool = True,
        oracle: OracleExecutor | None = None,
        spill_fails: Iterable[str] = (),
        auto_swap_ready: bool = True,
        device_lag: int = 0,
        policy: Policy | None = None,
    ) -> None:
        self.oracle = oracle or default_oracle(config)
        policy = policy or Policy(device_lag=device_lag, steps_per_tick=steps_per_tick,
                                  spill_fails=frozenset(spill_fails), swap_in_ready=auto_swap_ready)
        super().__init__(SchedulerCore(config), self.oracle, policy, check_invariants=check)

    @property
    def check(self) -> bool:
        """Whether ``check_invariants()`` runs after every tick."""
        return self.check_invariants

    @check.setter
    def check(self, value: bool) -> None:
        self.check_invariants = value
