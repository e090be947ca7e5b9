"""A safety net for optimising the core: fixed workloads must give byte-identical ``TickOutputs``, tick by tick.

Each workload hashes every tick's ``events.encode(outputs)`` (commands, gauges and the chained digest) into one
blake2b digest. The expected digests were recorded from the core before any performance work; any change to a
decision, an order, a gauge or a command's bytes changes them. If a change is *meant* to alter decisions, record
new digests (``python tests/test_core_golden_bytes.py`` prints them) and say why in the commit.

Workloads: random blasts (``test_core_blast.run_blast``) across depth 1 and 2, spill, prefix caching and small
pools; random-config blasts; ``tickloom bench core``'s steady-state workload at small N; and a thinking-budget
workload with logprobs and scripted markers, which the blasts do not exercise.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable

import pytest
from core_harness import Harness
from test_core_blast import blast_config, random_config, run_blast

from tickloom.engine.core import CoreConfig
from tickloom.events import Command, Input, RequestArrived, SamplingSpec, StepDone, TickInputs, TickOutputs, encode
from tickloom.replay.oracle import OracleExecutor


def _digest(outputs: list[TickOutputs]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for out in outputs:
        h.update(hashlib.blake2b(encode(out), digest_size=16).digest())
    return f"{len(outputs)}:{h.hexdigest()}"


def _blast(seed: int, ticks: int, depth: int, spill: bool, caching: bool, blocks: int, shutdown: bool) -> str:
    return _digest(run_blast(seed, ticks, blast_config(depth, spill, caching, blocks), shutdown=shutdown).outputs)


def _random_blast(seed: int) -> str:
    return _digest(run_blast(seed, 400, random_config(seed), shutdown=seed % 3 == 0).outputs)


def _bench(batch: int, depth: int, ticks: int) -> str:
    from tickloom.tools.bench.core import _Workload

    work = _Workload(batch, depth, seed=7)
    outputs: list[TickOutputs] = []
    tick = work.core.tick

    def recording(tick_inputs: TickInputs) -> TickOutputs:
        out = tick(tick_inputs)
        outputs.append(out)
        return out

    work.core.tick = recording  # type: ignore[method-assign]
    for _ in range(ticks):
        work.step(None)
    return _digest(outputs)


class _LogprobOracle(OracleExecutor):
    """The oracle, with logprobs on the results of odd-numbered steps."""

    def handle(self, commands: Iterable[Command]) -> list[Input]:
        return [
            StepDone(r.step_id, r.request_ids, r.token_ids, r.step_time_ns,
                     [-0.25 * (i % 7) for i in range(len(r.token_ids))])
            if isinstance(r, StepDone) and r.step_id % 2 else r
            for r in super().handle(commands)
        ]


def _thinking(depth: int) -> str:
    """Think markers (scripted), thinking budgets, min_tokens, stop ids and logprobs on every other step."""
    config = CoreConfig(num_blocks=48, block_size=8, max_batch_size=6, max_seq_len=96, max_prefill_tokens=32,
                        max_batch_tokens=48, pipeline_depth=depth, think_start_token=5, think_end_token=6,
                        eos_token_ids=(1,), vocab_size=500, spill_enabled=depth == 2, preempt_immunity_tokens=4)
    h = Harness(config, steps_per_tick=depth, oracle=_LogprobOracle(config.vocab_size, avoid=(1, 5, 6)))
    rng = random.Random(depth)
    for i in range(300):
        arrivals = []
        if i < 240 and rng.random() < 0.3:
            rid = f"t{i}"
            prompt = [rng.randrange(10, 500) for _ in range(rng.randint(1, 30))]
            if rng.random() < 0.5:
                prompt.append(5)
            max_tokens = rng.choice((1, 4, 12, 30))
            params = SamplingSpec(
                max_tokens=max_tokens, min_tokens=rng.choice((0, 0, min(3, max_tokens))),
                thinking_budget=rng.choice((None, 0, 2, 5)), stop_token_ids=rng.choice(([], [7])),
                ignore_eos=rng.random() < 0.2,
            )
            script = {rng.randint(0, max_tokens): rng.choice((1, 5, 6, 7)) for _ in range(rng.randint(0, 3))}
            h.oracle.scripted[rid] = script
            arrivals.append(RequestArrived(rid, prompt, params, seed=i))
        h.step(*arrivals)
    h.run()
    return _digest(h.outputs)


WORKLOADS: dict[str, Callable[[], str]] = {
    "blast-2601-d1-spill-cache-24": lambda: _blast(2601, 1500, 1, True, True, 24, False),
    "blast-2602-d2-spill-cache-24-shutdown": lambda: _blast(2602, 1500, 2, True, True, 24, True),
    "blast-2603-d2-cache-20": lambda: _blast(2603, 1200, 2, False, True, 20, False),
    "blast-2605-d2-spill-nocache-32": lambda: _blast(2605, 1200, 2, True, False, 32, False),
    "blast-2606-d1-nocache-16": lambda: _blast(2606, 1000, 1, False, False, 16, True),
    "random-2700": lambda: _random_blast(2700),
    "random-2701": lambda: _random_blast(2701),
    "random-2705": lambda: _random_blast(2705),
    "random-2710": lambda: _random_blast(2710),
    "bench-n16-d1": lambda: _bench(16, 1, 400),
    "bench-n48-d2": lambda: _bench(48, 2, 300),
    "thinking-d1": lambda: _thinking(1),
    "thinking-d2": lambda: _thinking(2),
}

EXPECTED: dict[str, str] = {
    'blast-2601-d1-spill-cache-24': '1500:cb4578d45321ce6eb35aa478b2e94e3a',
    'blast-2602-d2-spill-cache-24-shutdown': '1501:a3b7cad214fcf99d9bf3c066486af484',
    'blast-2603-d2-cache-20': '1324:92e11eefa59a7ad2610230f2b85031ef',
    'blast-2605-d2-spill-nocache-32': '1251:55bfd9a0ad7ab413125c6513f053e96a',
    'blast-2606-d1-nocache-16': '1001:da76e9d0be41d397f40651451fb4690a',
    'random-2700': '401:a26b978f30977d75b2e76221fd04230d',
    'random-2701': '400:b35bfce1345492fa93a1b31e526ea1c5',
    'random-2705': '400:d129206bd086582ea11dfbe2cbfd51c8',
    'random-2710': '402:d7b512aaa4d1467ebda4fad71d0d8cf3',
    'bench-n16-d1': '400:e63122b7e5b9faa019d760679f82de63',
    'bench-n48-d2': '300:760b9f99ddb99fe2a511e622dd3f28ef',
    'thinking-d1': '300:ff418e9dc4c5d2a3d80a2bf17dae86d5',
    'thinking-d2': '300:2de2920bc054685399895bf1ed31cbf8',
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_outputs_are_byte_identical_to_the_recorded_core(name: str) -> None:
    assert WORKLOADS[name]() == EXPECTED[name], f"{name}: the core's outputs changed"


if __name__ == "__main__":
    for key, run in WORKLOADS.items():
        print(f"    {key!r}: {run()!r},")
