"""Synthetic but realistic tick records for benchmarks and demos (no engine needed).

A steady decode batch: each tick carries the previous step's ``StepDone`` and emits the next ``RunStep`` of one
decode row per running request, with ``EmitTokens`` for the tokens that just arrived, plus a few arrivals and
finishes. Deterministic for a given seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tickloom.events import (
    GENESIS_DIGEST,
    NOT_FED,
    BindRequest,
    Command,
    CoreGauges,
    EmitTokens,
    Finish,
    Input,
    ReleaseRequest,
    RequestArrived,
    RunStep,
    SamplingSpec,
    StepDone,
    TickInputs,
    TickOutputs,
    Usage,
    WatchDeadline,
    chain_digest,
    encode_commands,
)

BLOCK_SIZE = 16
VOCAB = 49152


@dataclass(slots=True)
class _Seq:
    request_id: str
    position: int
    generated: int


def make_ticks(
    n_ticks: int, *, batch: int = 64, arrivals: int = 2, prompt_len: int = 96, seed: int = 0
) -> list[tuple[TickInputs, TickOutputs, bytes]]:
    """``n_ticks`` ticks of a batch of ``batch`` decoding requests: ``(inputs, outputs, encoded_commands)``.

    Every tick ``arrivals`` requests finish and as many new ones arrive (bound now, decoding from the next
    tick), so the batch stays full. The digest chain is computed as the core would.
    """
    rng = random.Random(seed)
    params = SamplingSpec(max_tokens=256, temperature=0.7, top_p=0.9, stop=["\n\n"])
    next_id = 0
    running: list[_Seq] = []
    for _ in range(batch):
        running.append(_Seq(f"req-{next_id:06d}", prompt_len + rng.randrange(200), rng.randrange(100)))
        next_id += 1
    next_block = 0
    digest = GENESIS_DIGEST
    out: list[tuple[TickInputs, TickOutputs, bytes]] = []
    now_ns = 1_000_000_000
    for tick in range(n_ticks):
        now_ns += 25_000_000
        ids = [r.request_id for r in running]
        sampled = [rng.randrange(VOCAB) for _ in running]
        inputs: list[Input] = [StepDone(tick - 1, ids, sampled, step_time_ns=24_000_000)] if tick else []
        commands: list[Command] = []
        if tick:
            commands.append(EmitTokens(ids, sampled, [r.generated - 1 for r in running], [False] * len(running)))
        # Finish the first few, admit as many new ones.
        for r in running[:arrivals]:
            commands.append(Finish(r.request_id, "stop", Usage(prompt_len, 32, r.generated)))
            commands.append(ReleaseRequest(r.request_id))
        running = running[arrivals:]
        for _ in range(arrivals):
            rid = f"req-{next_id:06d}"
            next_id += 1
            prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
            inputs.append(RequestArrived(rid, prompt, params, deadline_ns=now_ns + 30_000_000_000))
            commands.append(BindRequest(rid, params, rng.randrange(2**63), prompt_len, []))
            commands.append(WatchDeadline(rid, now_ns + 30_000_000_000))
            running.append(_Seq(rid, prompt_len, 0))
        positions: list[int] = []
        block_starts: list[int] = []
        num_new: list[int] = []
        new_ids: list[int] = []
        for r in running:
            pos = r.position
            positions.append(pos)
            if pos % BLOCK_SIZE == 0:
                block_starts.append(pos // BLOCK_SIZE)
                num_new.append(1)
                new_ids.append(next_block)
                next_block = (next_block + 1) % 100_000
            else:
                block_starts.append(pos // BLOCK_SIZE + 1)
                num_new.append(0)
            r.position = pos + 1
        n = len(running)
        # A request that arrived this tick starts from a known token; the others are fed from the step in flight.
        fresh = [r.generated == 0 for r in running]
        for r in running:
            r.generated += 1
        commands.append(
            RunStep(
                step_id=tick,
                request_ids=[r.request_id for r in running],
                positions=positions,
                num_tokens=[1] * n,
                token_ids=[rng.randrange(VOCAB) if f else 0 for f in fresh],
                fed_from=[NOT_FED if f or not tick else tick - 1 for f in fresh],
                sample_indices=[r.generated - 1 for r in running],
                block_starts=block_starts,
                num_new_blocks=num_new,
                new_block_ids=new_ids,
            )
        )
        gauges = CoreGauges(waiting=0, running=n, preempted=0, swapped=0, free_blocks=4096, cached_blocks=512)
        encoded = encode_commands(commands)
        digest = chain_digest(digest, encoded, gauges)
        outputs = TickOutputs(tick, commands, needs_tick=True, gauges=gauges, digest=digest)
        out.append((TickInputs(tick, now_ns, inputs), outputs, encoded))
    return out
