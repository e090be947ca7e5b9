"""A step being planned, as the columns of its ``RunStep`` plus what the core keeps of it while in flight."""

from __future__ import annotations

import attrs

from tickloom.engine.core.state import Seq


@attrs.define(slots=True, eq=False)
class StepColumns:
    """A step being planned: the ``RunStep`` columns plus what ``InflightStep`` keeps, decode rows first."""

    step_id: int
    seqs: list[Seq]
    """Every row's sequence, in row order (``RunStep.request_ids`` names them)."""
    positions: list[int]
    num_tokens: list[int]
    token_ids: list[int]
    fed_from: list[int]
    sample_indices: list[int]
    block_starts: list[int]
    num_new_blocks: list[int]
    new_block_ids: list[int]
    samplers: list[Seq]
    sampler_indices: list[int]
    """The output index each of ``samplers`` samples: ``sample_indices`` without the rows that sample nothing."""
    kv_ends: list[int]
    registered: list[int] = attrs.Factory(list)
    ending: list[int] = attrs.Factory(list)
    """Indices into ``samplers`` of the rows that sample a sequence's last token by its length limit."""
