"""The tests' fixed workloads for ``replay.record.record_core_run`` (a ``Scenario`` each)."""

from __future__ import annotations

from tickloom.engine.core import CoreConfig
from tickloom.events import Input, RequestCancelled
from tickloom.replay.record import TICK_NS, Scenario, arrival


def everything_scenario() -> Scenario:
    """A small run with swap, requeue, running ahead, deadlines, cancellations, stop matches, EOS and step failures."""
    config = CoreConfig(
        num_blocks=40, block_size=4, max_batch_size=8, max_seq_len=96, max_prefill_tokens=32,
        max_batch_tokens=64, pipeline_depth=2, spill_enabled=True, preempt_immunity_tokens=4,
        eos_token_ids=(2,), vocab_size=512,
    )
    script: dict[int, list[Input]] = {}
    for i in range(14):
        rid = f"r{i:02d}"
        kw: dict[str, object] = {}
        if i == 5:
            kw["deadline_ns"] = 9 * TICK_NS
        if i == 11:
            kw["priority"] = -1
        script.setdefault(i // 2, []).append(arrival(rid, 8 + (i * 5) % 13, 24 + (i * 7) % 17, **kw))
    script.setdefault(9, []).append(RequestCancelled("r12"))
    return Scenario(
        config=config,
        script=script,
        spill_fails=("r01",),
        stop_at={"r07": 3},
        fail_steps=frozenset({40}),
        scripted={"r09": {5: 2}},
        device_lag=1,
    )
