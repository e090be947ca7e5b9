"""Turns one step's rows (start position, tokens, block table) into the forward's index tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttnGroup:
    """Rows attended together: ``rows`` rows of ``q_len`` queries over ``block_index`` blocks.

    Queries are the flat tokens ``start:end`` when ``token_index`` is None, else ``token_index``.
    ``mask`` is a bool ``rows x 1 x (G * q_len or 1) x ctx`` mask (True = attend). ``lengths``: each query's
    context length (its own position included), one per row in a decode group (``q_len`` 1), one per query of
    the row in a longer one. ``query_tables``: ``block_index`` once per query, for kernels that take a table per
    query; the same for every layer, so the first layer that needs it builds it.
    """

    rows: int
    q_len: int
    start: int
    end: int
    token_index: torch.Tensor | None
    block_index: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor | None = None
    query_tables: torch.Tensor | None = None


@dataclass(slots=True)
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    logit_index: torch.Tensor | None
    groups: list[AttnGroup]
    max_position: int


@dataclass(slots=True)
class RowSpec:
    """One row: ``num_tokens`` inputs at positions ``start..start+num_tokens-1``."""

    start: int
    num_tokens: int
    block_table: list[int]
    wants_logits: bool
    all_logits: bool = False
    """Logits at every position of the row (for prompt logprobs), not only at its last one."""


def _blocks_needed(end_pos: int, block_size: int) -> int:
    return (end_pos + block_size - 1) // block_size


def build_step_batch(
    rows: list[RowSpec],
    token_ids: list[int],
    block_size: int,
    gqa_groups: int,
    device: torch.device,
) -> StepBatch:
    """Index tensors for one mixed step. Rows of one token share a batched group; longer rows
    (prefill chunks) get a group each, attending to cached context plus themselves causally.

    ``logit_index`` lists, row by row, the last position of a row that wants logits, or every position of an
    ``all_logits`` row."""
    positions: list[int] = []
    slots: list[int] = []
    logit_index: list[int] = []
    decode_rows: list[int] = []
    groups: list[AttnGroup] = []
    offsets: list[int] = []
    off = 0
    max_pos = 0
    for r_i, row in enumerate(rows):
        offsets.append(off)
        p, n, table = row.start, row.num_tokens, row.block_table
        if n <= 0:
            raise ValueError(f"row {r_i} has {n} tokens")
        if _blocks_needed(p + n, block_size) > len(table):
            raise ValueError(
                f"row {r_i}: positions up to {p + n - 1} need {_blocks_needed(p + n, block_size)} "
                f"blocks, block table has {len(table)}"
            )
        for q in range(p, p + n):
            positions.append(q)
            slots.append(table[q // block_size] * block_size + q % block_size)
        max_pos = max(max_pos, p + n - 1)
        if n == 1:
            decode_rows.append(r_i)
        if row.all_logits:
            logit_index.extend(range(off, off + n))
        elif row.wants_logits:
            logit_index.append(off + n - 1)
        off += n
    total = off
    if len(token_ids) != total:
        raise ValueError(f"{len(token_ids)} token ids given, rows hold {total} tokens")

    if decode_rows:
        nb = max(_blocks_needed(rows[r].start + 1, block_size) for r in decode_rows)
        bidx: list[int] = []
        last: list[int] = []
        for r in decode_rows:
            table = rows[r].block_table
            need = _blocks_needed(rows[r].start + 1, block_size)
            bidx.extend(table[:need])
            bidx.extend([table[0]] * (nb - need))
            last.append(rows[r].start)
        toks = [offsets[r] for r in decode_rows]
        contiguous = toks == list(range(toks[0], toks[0] + len(toks)))
        ar = torch.arange(nb * block_size, device=device)
        lim = torch.tensor(last, device=device)
        mask = (ar.unsqueeze(0) <= lim.unsqueeze(1)).view(len(decode_rows), 1, 1, -1)
        groups.append(
            AttnGroup(
                rows=len(decode_rows),
                q_len=1,
                start=toks[0],
                end=toks[0] + len(toks),
                token_index=None if contiguous else torch.tensor(toks, device=device),
                block_index=torch.tensor(bidx, dtype=torch.long, device=device),
                mask=mask,
                lengths=lim + 1,
            )
        )
    for r_i, row in enumerate(rows):
        if row.num_tokens == 1:
            continue
        p, n = row.start, row.num_tokens
        need = _blocks_needed(p + n, block_size)
        ar = torch.arange(need * block_size, device=device)
        qpos = torch.arange(p, p + n, device=device)
        mask = ar.unsqueeze(0) <= qpos.unsqueeze(1)
        if gqa_groups > 1:
            mask = mask.repeat(gqa_groups, 1)
        groups.append(
            AttnGroup(
                rows=1,
                q_len=n,
                start=offsets[r_i],
                end=offsets[r_i] + n,
                token_index=None,
                block_index=torch.tensor(row.block_table[:need], dtype=torch.long, device=device),
                mask=mask.view(1, 1, gqa_groups * n, -1),
                lengths=qpos + 1,
            )
        )
    return StepBatch(
        input_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        write_slots=torch.tensor(slots, dtype=torch.long, device=device),
        logit_index=torch.tensor(logit_index, dtype=torch.long, device=device),
        groups=groups,
        max_position=max_pos,
    )
