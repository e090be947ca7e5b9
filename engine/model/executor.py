"""The device executor: model, paged KV cache and per-request state behind a columnar step API."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tickloom.engine.model.batch import RowSpec, build_step_batch
from tickloom.engine.model.host_pool import CopyEngine
from tickloom.engine.model.kv_cache import HostKV, PagedKVCache
from tickloom.engine.model.llama import LlamaModel
from tickloom.engine.model.sampling import SampleOutput, Sampler, SampleRow, has_penalties
from tickloom.engine.model.speculate import Proposer, accepted
from tickloom.engine.model.tables import BoundRequests, proposal_slots, step_inputs
from tickloom.engine.model.types import ConstraintEngine, PendingMasks, StepResult
from tickloom.events import SamplingSpec
from tickloom.events.commands import BindRequest, PromptLogprobs, RunStep


@dataclass(slots=True)
class _RequestState:
    spec: SamplingSpec
    seed: int
    prompt_len: int
    masked_token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # token at each position seen or sampled so far
    prompt: PromptLogprobs | None = None
    """While a request that asks for prompt logprobs prefills: entry p - 1 is prompt position p's, filled chunk by
    chunk (NaN and ``[]`` until computed); handed over with output 0 (then None). Only when ``bind`` was given
    the whole prompt (every ``BindRequest`` since the schema that added prompt logprobs carries it)."""
    prompt_ids: list[int] = field(default_factory=list)


class ModelExecutor(BoundRequests[_RequestState]):
    """Owns the model, its KV blocks and every bound request's state. Not thread-safe: one thread
    (the step actor's executor thread) calls it, in command order."""

    MAX_EXTRAS = 32
    """Forced tokens accepted after one sampled token at most (a long JSON key is a few tokens)."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int = 16,
                 constraints: ConstraintEngine | None = None, proposer: Proposer | None = None) -> None:
        super().__init__(block_size)
        self.constraints = constraints
        """The grammar engine for structured outputs (None: a request with a constraint cannot be bound)."""
        self.proposer = proposer
        """Fills the proposal slots of speculating rows (None: they stay empty, and the rows decode plainly)."""
        self.model = model
        self.kv: PagedKVCache = model.new_kv_cache(num_blocks, block_size)
        self.sampler = Sampler(model.cfg.vocab_size, model.device)
        self.copier = CopyEngine(model.device)
        self._gqa = model.cfg.num_heads // model.cfg.num_kv_heads

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    def bind(self, command: BindRequest) -> None:
        """The command's ``prompt_token_ids`` let rows start past a prefix-cache hit: the skipped tokens are known."""
        prompt_len, prompt_token_ids = command.prompt_len, command.prompt_token_ids
        state = _RequestState(command.params, command.seed, prompt_len, list(command.masked_token_ids))
        state.tokens.extend(prompt_token_ids)
        if command.params.structured is not None:
            if self.constraints is None:
                raise ValueError(f"{command.request_id}: this executor runs no structured outputs")
            self.constraints.bind(command.request_id, command.params.structured)
        if command.params.prompt_logprobs is not None and len(prompt_token_ids) == prompt_len:
            # The prompt is needed whole: a chunk's last row predicts the first token of the next chunk.
            state.prompt_ids = list(prompt_token_ids)
            blanks = max(prompt_len - 1, 0)
            state.prompt = ([math.nan] * blanks, [[] for _ in range(blanks)], [[] for _ in range(blanks)])
        self._requests[command.request_id] = state

    def release(self, request_id: str) -> None:
        super().release(request_id)
        if self.constraints is not None:
            self.constraints.release(request_id)
        if self.proposer is not None:
            self.proposer.release(request_id)

    def run_step(self, step: RunStep) -> StepResult:
        """Run one mixed step. A row fed from a step still in flight when the command was made (``fed_from``)
        takes the token its request sampled for that position.

        A row ending in proposal slots speculates: its input and up to that many proposed tokens run as consecutive
        one-token rows, each position is sampled with its own output index, and the sampled tokens that followed
        right proposals are the row's extras (``speculate.accepted``).

        A sampling row whose next output this executor already holds is void: an earlier step accepted extra
        tokens after its sampled one (a constraint forced them) and the core planned this row, running ahead,
        before it knew. It writes its input's KV as planned, skips the LM head and the sampler, and reports the
        token it holds, which the core discards. A constrained row's mask is computed on worker threads while
        the forward pass runs; after sampling, the tokens its constraint forces next are appended as extras.
        """
        states = self.start_step(step)
        request_ids, positions, num_tokens, sample_indices = (step.request_ids, step.positions, step.num_tokens,
                                                              step.sample_indices)
        tokens = step_inputs(step)
        slots = proposal_slots(step)
        rows: list[RowSpec] = []
        row_states: list[_RequestState] = []  # each forward row's request (a speculating row makes several)
        inputs: list[int] = []  # the forward's input tokens: ``tokens`` with proposals in their slots
        held: dict[int, int] = {}  # void row -> the output it already holds
        proposals: dict[int, list[int]] = {}  # speculating row -> its proposed tokens (maybe none)
        off = 0
        for i, st in enumerate(states):
            p, n = positions[i], num_tokens[i]
            if len(st.tokens) < p:
                raise ValueError(f"{request_ids[i]}: step starts at {p}, only {len(st.tokens)} tokens known")
            known = n - slots[i]
            for j in range(off, off + known):
                if tokens[j] < 0:
                    pos = p + j - off
                    if pos >= len(st.tokens):
                        raise ValueError(f"{request_ids[i]}: no sampled token for position {pos}")
                    tokens[j] = st.tokens[pos]
            samples = sample_indices[i] >= 0
            if slots[i]:
                # The input and the proposals as consecutive one-token rows: each position is computed as a plain
                # decode row computes it. Proposals stand in ``st.tokens`` until sampled (penalties read them).
                del st.tokens[p:]
                st.tokens.append(tokens[off])
                proposed = self._propose(request_ids[i], st, slots[i])
                proposals[i] = proposed
                st.tokens.extend(proposed)
                rows.extend(RowSpec(p + j, 1, st.block_table, True) for j in range(1 + len(proposed)))
                row_states.extend([st] * (1 + len(proposed)))
                inputs.append(tokens[off])
                inputs.extend(proposed)
                off += n
                continue
            if samples and len(st.tokens) > p + n:
                held[i] = st.tokens[p + n]
            else:
                del st.tokens[p:]
                st.tokens.extend(tokens[off : off + n])
            # Logits at every position for a chunk that holds prompt positions whose next token is a prompt token.
            whole = st.prompt is not None and p < st.prompt_len - 1
            rows.append(RowSpec(p, n, st.block_table, samples and i not in held, whole))
            row_states.append(st)
            inputs.extend(tokens[off : off + n])
            off += n
        masks = self._start_masks(step, states, held)
        batch = build_step_batch(rows, inputs, self.block_size, self._gqa, self.model.device)
        self.copier.before_compute()
        logits = self.model.forward(batch, self.kv)
        if any(row.all_logits for row in rows):
            logits = self._prompt_logprobs(rows, row_states, logits)
        mask_rows, allowed = ({}, None) if masks is None else (masks[0], masks[1].wait())
        sample_rows: list[SampleRow] = []
        for i, st in enumerate(states):
            k = sample_indices[i]
            if k < 0 or i in held:
                continue
            end = positions[i] + num_tokens[i] - slots[i]
            penalties = has_penalties(st.spec)
            for j in range(1 + len(proposals.get(i, ()))):
                sample_rows.append(
                    SampleRow(
                        spec=st.spec,
                        seed=st.seed,
                        output_index=k + j,
                        prompt_tokens=st.tokens[: st.prompt_len] if penalties else [],
                        output_tokens=st.tokens[st.prompt_len : end + j] if penalties else [],
                        masked_token_ids=st.masked_token_ids,
                        allowed=None if allowed is None or i not in mask_rows else allowed[mask_rows[i]],
                    )
                )
        out = self.sampler.sample(logits, sample_rows)
        return self._collect(step, states, held, proposals, out)

    def _propose(self, request_id: str, st: _RequestState, most: int) -> list[int]:
        """Up to ``most`` proposals for a speculating row (``st.tokens`` ends with its input); none for a request
        whose constraint forces or masks its tokens (the core gives such rows no slots anyway)."""
        if self.proposer is None or (self.constraints is not None and request_id in self.constraints):
            return []
        return self.proposer.propose(request_id, st.tokens, most)[:most]

    def _start_masks(self, step: RunStep, states: list[_RequestState],
                     held: dict[int, int]) -> tuple[dict[int, int], PendingMasks] | None:
        """Start the masks of the constrained sampling rows: (row -> mask row, the job), or None if there are none.

        A row's mask depends only on its request's output tokens before the sampled position, all known now
        (the fed inputs were resolved above), so it is computed while the forward pass runs."""
        constraints = self.constraints
        if constraints is None:
            return None
        which: dict[int, int] = {}
        wanted: list[tuple[str, list[int]]] = []
        for i, st in enumerate(states):
            rid = step.request_ids[i]
            if step.sample_indices[i] >= 0 and i not in held and rid in constraints:
                which[i] = len(wanted)
                wanted.append((rid, st.tokens[st.prompt_len :]))
        return (which, constraints.start_masks(wanted)) if wanted else None

    def _collect(self, step: RunStep, states: list[_RequestState], held: dict[int, int],
                 proposals: dict[int, list[int]], out: SampleOutput) -> StepResult:
        """The step's result in row order: sampled tokens, held ones for void rows, and each row's extras: a
        speculating row's accepted tokens, or the tokens a constraint forces next."""
        constraints = self.constraints
        tokens: list[int] = []
        extras: list[list[int]] = []
        prompts: list[PromptLogprobs] = []
        logprobs: list[float] = []
        top_ids: list[list[int]] = []
        top_lps: list[list[float]] = []
        t_i = 0
        for i, st in enumerate(states):
            k = step.sample_indices[i]
            if k < 0:
                continue
            if i in held:
                tokens.append(held[i])
                extras.append([])
                prompts.append(([], [], []))
                logprobs.append(0.0)
                top_ids.append([])
                top_lps.append([])
                continue
            token = out.token_ids[t_i]
            if out.logprobs is not None:
                logprobs.append(out.logprobs[t_i])
                top_ids.append(out.top_token_ids[t_i] if out.top_token_ids is not None else [])
                top_lps.append(out.top_logprobs[t_i] if out.top_logprobs is not None else [])
            tokens.append(token)
            forced: list[int] = []
            rid = step.request_ids[i]
            proposed = proposals.get(i)
            if proposed is not None:
                sampled = out.token_ids[t_i : t_i + 1 + len(proposed)]
                forced = sampled[1 : 1 + accepted(proposed, sampled)]
                del st.tokens[step.positions[i] + 1 :]  # the proposals, now replaced by what was sampled
                st.tokens.append(token)
                st.tokens.extend(forced)
                t_i += 1 + len(proposed)
            else:
                st.tokens.append(token)
                t_i += 1
            if proposed is None and constraints is not None and rid in constraints and not _wants_logprobs(st.spec):
                limit = min(self.MAX_EXTRAS, st.spec.max_tokens - k - 1)
                if limit > 0:
                    forced = constraints.forced(rid, st.tokens[st.prompt_len :], limit)
                    st.tokens.extend(forced)
            extras.append(forced)
            if k == 0 and st.prompt is not None:
                prompts.append(st.prompt)
                st.prompt = None
            else:
                prompts.append(([], [], []))
        result = StepResult(tokens)
        if out.logprobs is not None:
            result.logprobs, result.top_token_ids, result.top_logprobs = logprobs, top_ids, top_lps
        if any(p[0] for p in prompts):
            result.prompt_logprobs = [p[0] for p in prompts]
            result.prompt_top_token_ids = [p[1] for p in prompts]
            result.prompt_top_logprobs = [p[2] for p in prompts]
        if any(extras):
            result.extra_token_ids = extras
        if proposals:
            result.proposed = [len(proposals.get(i, ())) for i, k in enumerate(step.sample_indices) if k >= 0]
        return result

    def _prompt_logprobs(self, rows: list[RowSpec], states: list[_RequestState], logits: torch.Tensor) -> torch.Tensor:
        """Record the prompt logprobs of the ``all_logits`` rows; return the logits of the sampling rows alone.

        Row ``q`` of a chunk's logits predicts position ``q + 1``: for positions still inside the prompt, that is
        the prompt token's raw logprob (no penalties, masks or temperature, as vLLM reports prompt logprobs) and
        the top-k alternatives. The chunk's last row, if it samples, goes on to the sampler as usual.
        """
        sample_at: list[int] = []
        cursor = 0
        for row, st in zip(rows, states, strict=True):
            if not row.all_logits:
                if row.wants_logits:
                    sample_at.append(cursor)
                    cursor += 1
                continue
            assert st.prompt is not None
            p, n = row.start, row.num_tokens
            inside = min(p + n, st.prompt_len - 1) - p  # rows whose next position is a prompt token
            k = int(st.spec.prompt_logprobs or 0)
            lp = torch.log_softmax(logits[cursor : cursor + inside].float(), dim=-1)
            nxt = torch.tensor(st.prompt_ids[p + 1 : p + 1 + inside], dtype=torch.long, device=lp.device)
            chosen = lp.gather(1, nxt.unsqueeze(1)).squeeze(1).tolist()
            lps, top_ids, top_lps = st.prompt
            lps[p : p + inside] = [float(x) for x in chosen]
            if k > 0:
                vals, ids = lp.topk(min(k, lp.shape[1]), dim=-1)
                top_ids[p : p + inside] = [[int(t) for t in r] for r in ids.tolist()]
                top_lps[p : p + inside] = [[float(x) for x in r] for r in vals.tolist()]
            if row.wants_logits:
                sample_at.append(cursor + n - 1)
            cursor += n
        return logits.index_select(0, torch.tensor(sample_at, dtype=torch.long, device=logits.device))

    def copy_out(self, request_id: str, block_ids: list[int], num_tokens: int) -> HostKV:
        """A host copy of these blocks' K/V for all layers. On CUDA the copy is asynchronous into
        pinned memory; call ``HostKV.wait()`` (or ``ready()``) before reading it."""
        if request_id not in self._requests:
            raise KeyError(request_id)
        return self.copier.copy_out(self.kv, block_ids, num_tokens)

    def copy_in(self, request_id: str, block_ids: list[int], host_kv: HostKV) -> None:
        """Write a host copy back into (possibly different) device blocks; the request's block
        table becomes ``block_ids``."""
        st = self._requests[request_id]
        if host_kv.k is None or host_kv.v is None:
            raise ValueError("host KV holds no tensors")
        self.copier.copy_in(self.kv, block_ids, host_kv)
        st.block_table[:] = list(block_ids)



def _wants_logprobs(spec: SamplingSpec) -> bool:
    """Forced tokens come without logits, so a request that asks for logprobs samples each one (masked to it)."""
    return spec.logprobs or spec.top_logprobs > 0
