"""C26: random blast. Seeded random workloads drive the core through every actor's event, checking it each tick.

``BlastHarness`` is the simulator (``replay.sim``) under ``replay.policy.RandomPolicy``: every actor acts at random,
from one seeded ``random.Random``:

- clients (this module): arrivals (shared prefixes, cache salts, priorities, deadlines, min_tokens, stop token
  ids, EOS scripted at random indices), cancellations, client gone, stop-string matches at a streamed token index;
- the deadline actor: ``DeadlineReached`` at about the deadline (sometimes early, as its clock may lead the
  core's ``now_ns``, sometimes never, so only ``now_ns`` passing times the request out). Clients announce a
  deadline to it when they submit;
- the device: a FIFO that completes 0, 1 or 2 ``RunStep``\\ s per tick (so two steps stay in flight at
  ``pipeline_depth`` 2) and fails random steps;
- the spill store: ``SpillDone`` after a random delay, sometimes failed, then ``SwapInReady`` (or rarely
  ``SwapInFailed``) after another random delay;
- sometimes a ``Shutdown`` at the end.

Every tick: ``check_invariants()`` and the client-visible rules (``Simulator``), and liveness. At the end, after
draining: every request ended exactly once with one of the five reasons, its tokens are the oracle's, its usage
adds up, and no block leaked (C21). A failure message names the seed; ``run_blast(seed, ...)`` replays it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest
from core_harness import Harness

from tickloom.engine.core import CoreConfig
from tickloom.engine.core.status import Status
from tickloom.events import (
    FINISH_REASONS,
    NO_SAMPLE,
    BindRequest,
    ClientGone,
    EmitTokens,
    Finish,
    Input,
    RequestArrived,
    RequestCancelled,
    RunStep,
    SamplingSpec,
    Shutdown,
    StopMatched,
    SwapIn,
    TickOutputs,
)
from tickloom.replay.oracle import OracleExecutor, oracle_token
from tickloom.replay.policy import RandomPolicy

EOS = 1
STOP_TOKEN = 2
VOCAB = 1000


class BlastHarness(Harness):
    """A ``Harness`` whose actors act at random (see the module docstring); ``rng`` decides everything."""

    def __init__(self, config: CoreConfig, seed: int, *, fail_rate: float = 0.004, extras: int = 0) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.random_policy = RandomPolicy(
            rng=self.rng, fail_rate=fail_rate,
            step_choices=(0, 1, 1, 1, 2, 2) if config.pipeline_depth == 2 else (0, 1, 1, 1, 1),
        )
        # With proposal slots the oracle also checks that no rejected proposal's KV is ever read or spilled.
        oracle = OracleExecutor(config.vocab_size, avoid=(EOS, STOP_TOKEN), extras=extras,
                                block_size=config.block_size if config.speculative_tokens else None)
        super().__init__(config, oracle=oracle, policy=self.random_policy)
        self.arrived: dict[str, RequestArrived] = {}
        self.stop_sent: set[str] = set()
        self.next_id = 0
        self.prefixes = [[self.rng.randrange(3, VOCAB) for _ in range(96)] for _ in range(3)]

    @property
    def draining(self) -> bool:
        """Draining: the actors answer at once and the device runs one step per tick."""
        return self.random_policy.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.random_policy.draining = value

    @property
    def seeds(self) -> dict[str, int]:
        """Each request's sampling seed, as bound on the device."""
        return {c.request_id: c.seed for _, c in self.commands(BindRequest) if isinstance(c, BindRequest)}

    # -- the clients -----------------------------------------------------------------------------------------
    def live(self) -> list[str]:
        return [rid for rid in self.arrived if rid not in self.finishes]

    def new_arrival(self) -> RequestArrived:
        rng = self.rng
        config = self.core.config
        rid = f"q{self.next_id}"
        self.next_id += 1
        shape = rng.random()
        if shape < 0.4:  # a shared prefix (whole blocks or not), then a private tail
            prefix = rng.choice(self.prefixes)[: rng.choice((16, 32, 33, 48, 64, 96))]
            prompt = prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 20))]
        elif shape < 0.5:
            prompt = list(rng.choice(self.prefixes)[: rng.randint(1, 96)])
        else:
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.choice((1, 5, 15, 16, 17, 31, 40, 70)))]
        if rng.random() < 0.01:
            prompt = [] if rng.random() < 0.5 else [0] * config.max_seq_len  # rejected at arrival
        prompt = prompt[: config.max_seq_len + 1]
        max_tokens = rng.choice((1, 2, 3, 8, 16, 30, 60, 120))
        params = SamplingSpec(
            max_tokens=max_tokens,
            min_tokens=rng.choice((0, 0, 0, 2)) if max_tokens >= 2 else 0,
            stop_token_ids=[STOP_TOKEN] if rng.random() < 0.3 else [],
            ignore_eos=rng.random() < 0.1,
        )
        deadline = self.now_ns + rng.randint(3, 150) * 1_000_000 if rng.random() < 0.25 else None
        if rng.random() < 0.25:
            self.oracle.scripted[rid] = {rng.randint(0, max_tokens): rng.choice((EOS, EOS, STOP_TOKEN))}
        msg = RequestArrived(
            rid, prompt, params,
            seed=rng.randrange(1 << 40) if rng.random() < 0.8 else None,
            priority=rng.choice((0, 0, 0, 1, 2, -1)),
            deadline_ns=deadline,
            cache_salt=rng.choice(("", "", "", "tenant-b")),
        )
        self.arrived[rid] = msg
        if deadline is not None:
            self.deadlines.watch(rid, deadline)  # announced at submit: a rejected request is watched too
        return msg

    def client_inputs(self, arrival_rate: float) -> list[Input]:
        """This tick's client inputs; the simulator adds the deadline reports and shuffles them all."""
        rng = self.rng
        inputs: list[Input] = []
        if rng.random() < arrival_rate:
            inputs += [self.new_arrival() for _ in range(rng.choice((1, 1, 1, 2, 3)))]
        live = self.live()
        if live and rng.random() < 0.04:
            rid = rng.choice(live)
            inputs.append(RequestCancelled(rid) if rng.random() < 0.6 else ClientGone(rid))
        if self.finishes and rng.random() < 0.01:  # a cancel racing a finish: the core ignores it
            inputs.append(RequestCancelled(rng.choice(list(self.finishes))))
        if live and rng.random() < 0.05:
            rid = rng.choice(live)
            streamed = len(self.tokens[rid])
            if streamed and rid not in self.stop_sent:
                self.stop_sent.add(rid)
                inputs.append(StopMatched(rid, rng.randrange(streamed)))
        return inputs


def _progress(before_preempted: int, out: TickOutputs, after_preempted: int) -> bool:
    """A token emitted, a finish, an admission, a swap-in, a preempted sequence resumed (or ended), or a prefill
    chunk that samples nothing (a long prompt takes several steps before its first token)."""
    if after_preempted < before_preempted:
        return True
    for c in out.commands:
        if isinstance(c, EmitTokens | Finish | BindRequest | SwapIn):
            return True
        if isinstance(c, RunStep) and NO_SAMPLE in c.sample_indices:
            return True
    return False


def _work_queued(h: BlastHarness) -> bool:
    """Work the core could do by itself: waiting, running, preempted, or swapped with its KV ready."""
    state = h.core.state
    return bool(
        state.waiting
        or state.preempted
        or any(seq.status is Status.RUNNING for seq in state.running)
        or any(seq.status is Status.SWAPPED and seq.swap_ready for seq in state.swapping_or_swapped)
    )


def _tick(h: BlastHarness, inputs: Iterable[Input], stall: int) -> int:
    """One tick plus the liveness check; returns the new count of ticks without progress. ``inputs`` are the
    clients' (shuffled with the deadline reports); anything that must come first is in ``h.pending``."""
    drained_before = not h.queue and not any(c.due <= h.tick for c in h.schedule)
    preempted = len(h.core.state.preempted)
    out = h.step(*inputs)
    depth = h.core.config.pipeline_depth
    if _progress(preempted, out, len(h.core.state.preempted)) or not (drained_before and _work_queued(h)):
        return 0
    stall += 1
    assert stall <= depth + 2, (
        f"seed {h.seed}: no progress for {stall} ticks at tick {h.tick - 1} with work queued "
        f"(gauges {out.gauges})"
    )
    return stall


def run_blast(seed: int, ticks: int, config: CoreConfig, *, shutdown: bool = False, extras: int = 0) -> BlastHarness:
    """``ticks`` random ticks, then drain (or shut down and drain); checks everything C26 asks for. With ``extras``
    the oracle accepts up to that many extra tokens per row (``OracleExecutor.extras``)."""
    h = BlastHarness(config, seed, extras=extras)
    rng = h.rng
    stall = 0
    try:
        for i in range(ticks):
            rate = 0.2 if (i // 400) % 3 else 0.04  # bursts fill the pool, lulls drain it
            stall = _tick(h, h.client_inputs(rate), stall)
        h.draining = True
        final: list[Input] = [Shutdown("blast over")] if shutdown else []
        if shutdown and rng.random() < 0.5:
            final.append(h.new_arrival())  # after the shutdown: rejected
        for _ in range(5_000):
            if not (h.busy or final or h.core.state.seqs):
                break
            h.expedite()
            h.pending += final  # before the clients' inputs, unshuffled
            stall = _tick(h, h.client_inputs(0.0), stall)
            final = []
        else:
            raise AssertionError(f"seed {seed}: still busy after draining for 5000 ticks")
    except Exception as exc:
        raise AssertionError(f"seed {seed}: {type(exc).__name__} at tick {h.tick}: {exc}") from exc
    check_outcome(h)
    return h


def check_outcome(h: BlastHarness) -> None:
    """Every request ended once, with one of the five reasons and the oracle's tokens; nothing leaked (C21)."""
    state = h.core.state
    seed = h.seed
    pool = state.pool
    assert not state.seqs and not state.steps and not state.fences, f"seed {seed}: requests or fences left"
    assert not (state.waiting or state.preempted or state.swapping_or_swapped), f"seed {seed}: requests still queued"
    # ``running`` is pruned lazily (by ``plan_step``, which a shut-down core skips): only finished entries remain.
    assert all(seq.status is Status.FINISHED for seq in state.running), f"seed {seed}: requests still running"
    assert pool.num_free + pool.num_cached == pool.num_blocks, f"seed {seed}: leaked blocks"
    assert not any(pool.ref), f"seed {seed}: referenced blocks after draining"
    h.core.check_invariants()
    config = h.core.config
    for rid, msg in h.arrived.items():
        finish = h.finishes.get(rid)
        assert finish is not None, f"seed {seed}: {rid} never finished"
        assert finish.reason in FINISH_REASONS, f"seed {seed}: {rid} finished as {finish.reason}"
        usage = finish.usage
        streamed = h.tokens[rid]
        assert usage.prompt_tokens == len(msg.prompt_token_ids), f"seed {seed}: {rid} usage {usage}"
        assert usage.completion_tokens <= len(streamed), f"seed {seed}: {rid} counts tokens it never streamed"
        if rid not in h.stop_sent:
            assert usage.completion_tokens == len(streamed), f"seed {seed}: {rid} streamed uncounted tokens"
        assert usage.completion_tokens <= msg.params.max_tokens
        assert usage.prompt_tokens + usage.completion_tokens <= config.max_seq_len or not streamed
        if finish.reason == "length":
            assert usage.completion_tokens == min(msg.params.max_tokens, config.max_seq_len - usage.prompt_tokens)
        if streamed:
            seed_of = h.seeds[rid]
            script = h.oracle.scripted.get(rid, {})
            expected = [script.get(i, oracle_token(seed_of, i, VOCAB, h.oracle.avoid)) for i in range(len(streamed))]
            assert streamed == expected, f"seed {seed}: {rid} streamed tokens that are not the oracle's"


BLAST_RUNS = [
    # (seed, ticks, pipeline depth, spill, prefix caching, blocks, shutdown)
    (2601, 5_000, 1, True, True, 24, False),
    (2602, 5_000, 2, True, True, 24, True),
    (2603, 4_000, 2, False, True, 20, False),
    (2604, 3_000, 1, False, True, 40, True),
    (2605, 3_000, 2, True, False, 32, False),
]
assert sum(run[1] for run in BLAST_RUNS) == 20_000


def blast_config(depth: int, spill: bool, caching: bool, blocks: int) -> CoreConfig:
    return CoreConfig(
        num_blocks=blocks, block_size=16, max_batch_size=6, max_seq_len=192, max_prefill_tokens=48,
        max_batch_tokens=64, admit_watermark=4, pipeline_depth=depth, spill_enabled=spill,
        preempt_immunity_tokens=8, eos_token_ids=(EOS,), vocab_size=VOCAB, prefix_caching=caching,
        max_waiting=40,
    )


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "ticks", "depth", "spill", "caching", "blocks", "shutdown"), BLAST_RUNS)
def test_c26_random_blast(
    seed: int, ticks: int, depth: int, spill: bool, caching: bool, blocks: int, shutdown: bool
) -> None:
    h = run_blast(seed, ticks, blast_config(depth, spill, caching, blocks), shutdown=shutdown)
    kinds = {type(c).__name__ for out in h.outputs for c in out.commands}
    reasons = {f.reason for f in h.finishes.values()}
    assert {"Preempted", "RunStep", "Finish"} <= kinds, f"seed {seed}: the workload missed pressure: {kinds}"
    assert spill <= ("SpillOut" in kinds and "SwapIn" in kinds), f"seed {seed}: no swapping: {kinds}"
    assert set(FINISH_REASONS) <= reasons, f"seed {seed}: reasons seen {reasons}"


def random_config(seed: int) -> CoreConfig:
    """A random small configuration: block sizes, tight prefill and batch budgets, watermarks, immunity."""
    rng = random.Random(seed)
    block_size = rng.choice((4, 8, 16))
    min_blocks = 192 // block_size + 1
    return CoreConfig(
        num_blocks=rng.randint(min_blocks, 3 * min_blocks), block_size=block_size,
        max_batch_size=rng.choice((1, 2, 4, 8)), max_seq_len=192, max_prefill_tokens=rng.choice((16, 48, 128)),
        max_batch_tokens=rng.choice((16, 64, 256)), admit_watermark=rng.choice((0, 4, 32)),
        pipeline_depth=rng.choice((1, 2)), spill_enabled=rng.random() < 0.6,
        preempt_immunity_tokens=rng.choice((0, 8, 64)), eos_token_ids=(EOS,), vocab_size=VOCAB,
        prefix_caching=rng.random() < 0.8, max_waiting=rng.choice((5, 40)),
    )


@pytest.mark.parametrize("seed", range(2700, 2712))
def test_c26_random_blast_random_configs(seed: int) -> None:
    """Extra to the 20,000 ticks above: short blasts under random configurations."""
    run_blast(seed, 600, random_config(seed), shutdown=seed % 3 == 0)
