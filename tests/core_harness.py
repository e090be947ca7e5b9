"""Plays every actor around a ``SchedulerCore`` for the core scenarios: device, spill store, clients.

The device is a FIFO of executor commands; each tick it completes ``steps_per_tick`` RunSteps (the oracle
answers them) and the results arrive as inputs of the next tick. Spills succeed (unless scripted to fail) and
are reported in the next tick, together with ``SwapInReady``. Every tick's outputs are checked against the
client-visible rules (exactly one finish per request, no token after it, no token twice) and, unless turned
off, against ``check_invariants()``.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable

from engine.core import CoreConfig, SchedulerCore
from engine.core.oracle import OracleExecutor
from events import (
    BindRequest,
    Command,
    EmitTokens,
    Finish,
    Input,
    PrefetchSpill,
    ReleaseRequest,
    RequestArrived,
    RunStep,
    SamplingSpec,
    SpillDone,
    SpillOut,
    SwapIn,
    SwapInReady,
    TickInputs,
    TickOutputs,
)

TICK_NS = 1_000_000


def arrival(request_id: str, prompt: list[int] | int, max_tokens: int = 8, **kw: object) -> RequestArrived:
    """An arrival; an int prompt means that many distinct tokens derived from the request id."""
    if isinstance(prompt, int):
        base = 1000 + 97 * sum(map(ord, request_id))
        prompt = [(base + 7 * i) % 800 + 100 for i in range(prompt)]
    params = kw.pop("params", None) or SamplingSpec(max_tokens=max_tokens)
    seed = kw.pop("seed", sum(map(ord, request_id)))
    return RequestArrived(request_id, prompt, params, seed=seed, **kw)  # type: ignore[arg-type]


class Harness:
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
    ) -> None:
        self.core = SchedulerCore(config)
        avoid = tuple(config.eos_token_ids) + tuple(
            t for t in (config.think_start_token, config.think_end_token) if t is not None
        )
        self.oracle = oracle or OracleExecutor(config.vocab_size, avoid=avoid)
        self.steps_per_tick = steps_per_tick
        self.check = check
        self.spill_fails = set(spill_fails)
        self.auto_swap_ready = auto_swap_ready
        self.device_lag = device_lag
        """Ticks a command waits in the device before it runs: 1 keeps two steps in flight at depth 2."""
        self.tick = 0
        self.now_ns = 0
        self.device: deque[tuple[int, Command]] = deque()
        self.pending: list[Input] = []
        self.outputs: list[TickOutputs] = []
        self.inputs: list[TickInputs] = []
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.reasoning: dict[str, list[bool]] = defaultdict(list)
        self.finishes: dict[str, Finish] = {}
        self.needs_tick = False

    # -- driving ---------------------------------------------------------------------------------------------
    def step(self, *inputs: Input, advance_ns: int = TICK_NS) -> TickOutputs:
        """Run one tick with the actors' pending inputs plus ``inputs``, then play the actors."""
        tick_inputs = TickInputs(self.tick, self.now_ns, [*self.pending, *inputs])
        self.pending = []
        out = self.core.tick(tick_inputs)
        self.inputs.append(tick_inputs)
        self.outputs.append(out)
        self.needs_tick = out.needs_tick
        self._observe(out)
        if self.check:
            self.core.check_invariants()
        self._play_actors(out.commands)
        self.tick += 1
        self.now_ns += advance_ns
        return out

    def run(self, max_ticks: int = 10_000) -> None:
        """Tick until nothing is pending, in flight or asked for."""
        for _ in range(max_ticks):
            if not (self.pending or self.device or self.needs_tick):
                return
            self.step()
        raise AssertionError(f"still busy after {max_ticks} ticks")

    def _play_actors(self, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, BindRequest | RunStep | SwapIn | ReleaseRequest):
                self.device.append((self.tick, command))
            elif isinstance(command, SpillOut):
                ok = command.request_id not in self.spill_fails
                self.pending.append(SpillDone(command.request_id, ok, "" if ok else "disk full", 0))
            elif isinstance(command, PrefetchSpill) and self.auto_swap_ready:
                self.pending.append(SwapInReady(command.request_id))
        done = 0
        due = self.tick - self.device_lag
        while self.device and self.device[0][0] <= due and done < self.steps_per_tick:
            _, command = self.device.popleft()
            self.pending += self.oracle.handle([command])
            done += isinstance(command, RunStep)
        while self.device and self.device[0][0] <= due and not isinstance(self.device[0][1], RunStep):
            self.pending += self.oracle.handle([self.device.popleft()[1]])

    # -- what the clients saw --------------------------------------------------------------------------------
    def _observe(self, out: TickOutputs) -> None:
        for command in out.commands:
            if isinstance(command, EmitTokens):
                for rid, token, index, reasoning in zip(
                    command.request_ids, command.token_ids, command.token_indices, command.reasoning, strict=True
                ):
                    assert rid not in self.finishes, f"token for {rid} after its finish"
                    assert index == len(self.tokens[rid]), f"{rid}: token index {index} streamed out of order"
                    self.tokens[rid].append(token)
                    self.reasoning[rid].append(reasoning)
            elif isinstance(command, Finish):
                assert command.request_id not in self.finishes, f"{command.request_id} finished twice"
                self.finishes[command.request_id] = command

    def commands(self, kind: type | None = None) -> list[tuple[int, Command]]:
        """(tick, command) for every command so far, optionally of one type."""
        return [
            (out.tick, c) for out in self.outputs for c in out.commands if kind is None or isinstance(c, kind)
        ]

    def output(self, request_id: str) -> list[int]:
        """The client's tokens: what was streamed, truncated to the finish's completion count."""
        finish = self.finishes[request_id]
        return self.tokens[request_id][: finish.usage.completion_tokens]

    def reason(self, request_id: str) -> str:
        return self.finishes[request_id].reason
