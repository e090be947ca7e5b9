"""Running a benchmark's requests through an engine: all at once, or one after another."""

from __future__ import annotations

import time
from typing import Any


async def run_jobs(engine: Any, jobs: list[tuple[Any, Any]], concurrent: bool) -> tuple[float, list[list[int]]]:
    """Run ``(prompt, params)`` jobs on ``engine`` (all at once, or one after another); (wall seconds, each
    output's token ids, in job order)."""
    import trio

    outputs: list[list[int]] = [[] for _ in jobs]

    async def one(i: int) -> None:
        prompt, params = jobs[i]
        outputs[i] = list((await engine.complete(prompt, params)).token_ids)

    start = time.perf_counter()
    if concurrent:
        async with trio.open_nursery() as nursery:
            for i in range(len(jobs)):
                nursery.start_soon(one, i)
    else:
        for i in range(len(jobs)):
            await one(i)
    return time.perf_counter() - start, outputs
