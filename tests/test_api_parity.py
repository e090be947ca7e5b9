"""vLLM's ``SamplingParams`` where users reach first: ``include_stop_str_in_output``, ``logprobs`` (top-k),
``prompt_logprobs``, ``logit_bias``, ``allowed_token_ids`` and ``n``, each clause pinned on the stub engine (under
``MockClock``) and, where real logits matter, on the tiny model; every run's log replays ``identical``.

The engine-level ``n`` tests and the asyncio bridge are in ``tests/test_api_parity_n.py``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from engine_helpers import assert_replays, core_finishes, stub_config

from tickloom import Engine, EngineConfig, RequestOutput, RequestRejected, SamplingParams
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.events import EmitTokens, LogReader, StepDone

STUB_EOS = 95
"""The stub tokenizer's EOS (its vocabulary's last id); ids 0-94 are the characters ' '-'~'."""
TINY_EOS = 2


def tid(ch: str) -> int:
    """The stub tokenizer's id of a printable character."""
    return ord(ch) - 32


async def _frames(engine: Engine, prompt: Any, params: SamplingParams, **kw: Any) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, **kw)]


def _check_top(out: RequestOutput, k: int) -> None:
    """Each token's dict: at most k + 1 entries, the top-k best first, then the sampled token if it is not among them,
    its value the token's logprob."""
    assert out.logprobs is not None and out.top_logprobs is not None
    assert len(out.top_logprobs) == len(out.token_ids) == len(out.logprobs)
    for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert token in top and top[token] == lp
        assert len(top) in (k, k + 1) and len(top) >= 1
        values = list(top.values())
        ranked = values[:k]
        assert ranked == sorted(ranked, reverse=True), "the alternatives come best first"
        if len(top) == k + 1:
            assert list(top)[-1] == token, "a sampled token outside the top-k comes last"
            assert k == 0 or lp <= ranked[-1], "and it is no likelier than the k-th"
        assert all(v <= 0.0 for v in values)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), dtype="float64", seed=3)


def _tiny(model: Path, log: Path, **kw: Any) -> EngineConfig:
    base: dict[str, Any] = dict(model=str(model), dtype="float64", max_seq_len=128, num_blocks=256, block_size=4,
                                max_batch_size=16, log_path=str(log))
    base.update(kw)
    return EngineConfig(**base)


# -- include_stop_str_in_output -----------------------------------------------------------------------------------


async def test_include_stop_str_in_output_keeps_or_drops_the_stop_string(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    async with Engine.open(stub_config(tmp_path / "run.tlog")) as engine:
        free = (await engine.complete("hello", SamplingParams(max_tokens=20, seed=7, ignore_eos=True))).text_delta
        at = next(i for i in range(2, 15) if free.find(free[i:i + 2]) == i)  # a stop string first seen at ``at``
        stop = free[at:at + 2]
        dropped = await engine.complete("hello", SamplingParams(max_tokens=20, seed=7, stop=stop))
        kept = await engine.complete("hello", SamplingParams(max_tokens=20, seed=7, stop=stop,
                                                             include_stop_str_in_output=True))
    assert dropped.text_delta == free[:at] and dropped.finish_reason == "stop"
    assert kept.text_delta == free[:at + 2] and kept.finish_reason == "stop"
    assert kept.token_ids == dropped.token_ids, "the same tokens: only the text differs"
    assert_replays(tmp_path / "run.tlog")


# -- logprobs: the sampled token's and the top-k -----------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 5, 20])
async def test_logprobs_k_gives_the_top_k_and_the_sampled_token(
        k: int, tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    async with Engine.open(stub_config(tmp_path / "run.tlog")) as engine:
        frames = await _frames(engine, "hello", SamplingParams(max_tokens=12, seed=3, logprobs=k, ignore_eos=True))
        whole = await engine.complete("hello", SamplingParams(max_tokens=12, seed=3, logprobs=k, ignore_eos=True))
    for out in frames[:-1]:
        _check_top(out, k)
    assert frames[-1].token_ids == [] and frames[-1].top_logprobs is None
    _check_top(whole, k)
    assert whole.top_logprobs == [d for f in frames for d in (f.top_logprobs or [])], "complete() keeps them"
    assert len(whole.token_ids) == 12
    if k:
        # The stub samples its distribution's mode: the sampled token is the best alternative.
        assert all(next(iter(top)) == t for t, top in zip(whole.token_ids, whole.top_logprobs or [], strict=True))
    assert_replays(tmp_path / "run.tlog")


async def test_without_logprobs_there_are_none_even_batched_with_a_request_that_asks(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    results: dict[str, RequestOutput] = {}
    async with Engine.open(stub_config(tmp_path / "run.tlog")) as engine:
        async def run(rid: str, params: SamplingParams) -> None:
            results[rid] = await engine.complete("hello", params, request_id=rid)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "asks", SamplingParams(max_tokens=6, seed=1, logprobs=2))
            nursery.start_soon(run, "plain", SamplingParams(max_tokens=6, seed=2))
    with LogReader(tmp_path / "run.tlog") as reader:
        done = [i for t in reader.ticks() for i in t.inputs.inputs
                if isinstance(i, StepDone) and len(i.request_ids) > 1]
    assert done and all(d.logprobs is not None for d in done), "the step computed logprobs for both rows"
    assert results["plain"].logprobs is None and results["plain"].top_logprobs is None
    _check_top(results["asks"], 2)
    assert_replays(tmp_path / "run.tlog")


async def test_top_logprobs_on_the_tiny_model(tiny_model: Path, tmp_path: Path) -> None:
    async with Engine.open(_tiny(tiny_model, tmp_path / "run.tlog")) as engine:
        out = await engine.complete([5, 9, 40, 7], SamplingParams(max_tokens=8, seed=4, temperature=1.0, logprobs=5,
                                                                  ignore_eos=True))
    _check_top(out, 5)
    assert out.top_logprobs is not None
    assert all(sum(math.exp(v) for v in list(top.values())[:5]) <= 1.0 + 1e-9 for top in out.top_logprobs)
    assert_replays(tmp_path / "run.tlog")


# -- logit_bias and allowed_token_ids ----------------------------------------------------------------------------


async def test_logit_bias_forces_and_bans_tokens_on_the_stub(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    async with Engine.open(stub_config(tmp_path / "run.tlog")) as engine:
        free = await engine.complete("hi", SamplingParams(max_tokens=10, seed=5))
        forced = await engine.complete("hi", SamplingParams(max_tokens=10, seed=5, logit_bias={tid("z"): 100.0}))
        banned = await engine.complete("hi", SamplingParams(max_tokens=10, seed=5,
                                                            logit_bias={t: -100.0 for t in free.token_ids}))
    assert forced.text_delta == "z" * 10
    assert not set(banned.token_ids) & set(free.token_ids) and len(banned.token_ids) == 10
    assert_replays(tmp_path / "run.tlog")


async def test_allowed_token_ids_restrict_every_token_on_the_stub(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    allowed = [tid(c) for c in "abc"]
    async with Engine.open(stub_config(tmp_path / "run.tlog")) as engine:
        outs = [await engine.complete("hi", SamplingParams(max_tokens=16, seed=s, allowed_token_ids=allowed,
                                                           logprobs=2)) for s in range(4)]
        both = await engine.complete("hi", SamplingParams(max_tokens=8, seed=1, allowed_token_ids=allowed,
                                                          logit_bias={tid("c"): 100.0, tid("z"): 100.0}))
        only_eos = await engine.complete("hi", SamplingParams(max_tokens=8, seed=1, allowed_token_ids=[STUB_EOS]))
    for out in outs:
        assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == 16
        assert out.top_logprobs is not None and all(set(top) <= set(allowed) for top in out.top_logprobs)
        assert out.logprobs is not None and all(lp <= 0.0 for lp in out.logprobs)
    assert len({tuple(o.token_ids) for o in outs}) > 1, "seeds still vary the tokens inside the allowed set"
    assert both.text_delta == "c" * 8, "a bias outside the allowed set cannot bring its token back"
    assert only_eos.token_ids == [STUB_EOS] and only_eos.finish_reason == "stop"
    assert_replays(tmp_path / "run.tlog")


async def test_logit_bias_and_allowed_tokens_on_the_tiny_model(tiny_model: Path, tmp_path: Path) -> None:
    prompt = [5, 9, 40, 7, 11]
    allowed = [30, 31, 32, TINY_EOS]
    async with Engine.open(_tiny(tiny_model, tmp_path / "run.tlog")) as engine:
        greedy = await engine.complete(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        forced = await engine.complete(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                              logit_bias={77: 100.0}))
        first = greedy.token_ids[0]
        banned = await engine.complete(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                              logit_bias={first: -100.0}, logprobs=3))
        sampled = [await engine.complete(prompt, SamplingParams(max_tokens=12, temperature=1.5, seed=s,
                                                                allowed_token_ids=allowed, min_tokens=4))
                   for s in range(4)]
        eos_only = await engine.complete(prompt, SamplingParams(max_tokens=6, temperature=0, min_tokens=2,
                                                                allowed_token_ids=[TINY_EOS]))
    assert forced.token_ids == [77] * 6, "greedy picks the argmax after the bias"
    assert banned.token_ids[0] != first and first not in (banned.top_logprobs or [{}])[0]
    for out in sampled:
        assert set(out.token_ids) <= set(allowed)
        assert TINY_EOS not in out.token_ids[:4], "min_tokens masks EOS inside the allowed set"
        assert out.finish_reason == "length" or out.token_ids[-1] == TINY_EOS
    assert len({tuple(o.token_ids) for o in sampled}) > 1
    # Every allowed token is masked while min_tokens lasts: the row falls back to the allowed set (EOS), which
    # stops the request once min_tokens is reached.
    assert eos_only.token_ids == [TINY_EOS, TINY_EOS] and eos_only.finish_reason == "stop"
    assert_replays(tmp_path / "run.tlog")


# -- prompt_logprobs ---------------------------------------------------------------------------------------------


def _check_prompt(out: RequestOutput, prompt: list[int], k: int) -> None:
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(prompt) and pl[0] is None
    for token, entry in zip(prompt[1:], pl[1:], strict=True):
        assert entry is not None and token in entry and len(entry) <= k + 1
        ranked = list(entry.values())[:k]
        assert ranked == sorted(ranked, reverse=True) and all(v <= 0.0 for v in entry.values())


def _prompt_values(out: RequestOutput, prompt: list[int]) -> list[float | None]:
    """Each prompt token's own logprob (None for the first)."""
    assert out.prompt_logprobs is not None
    return [None if e is None else e[t] for t, e in zip(prompt, out.prompt_logprobs, strict=True)]


async def test_prompt_logprobs_come_once_on_the_first_frame(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    prompt = [tid(c) for c in "the prompt"]
    async with Engine.open(stub_config(tmp_path / "run.tlog")) as engine:
        frames = await _frames(engine, prompt, SamplingParams(max_tokens=6, seed=1, prompt_logprobs=3))
        whole = await engine.complete(prompt, SamplingParams(max_tokens=6, seed=1, prompt_logprobs=0))
        one = await engine.complete([tid("x")], SamplingParams(max_tokens=2, seed=1, prompt_logprobs=2))
        none = await engine.complete(prompt, SamplingParams(max_tokens=2, seed=1))
    assert frames[0].token_ids, "the first frame carries a token"
    _check_prompt(frames[0], prompt, 3)
    assert all(f.prompt_logprobs is None for f in frames[1:])
    _check_prompt(whole, prompt, 0)
    assert all(len(e or {}) == 1 for e in (whole.prompt_logprobs or [])[1:]), "k = 0: the prompt token alone"
    assert _prompt_values(whole, prompt) == _prompt_values(frames[0], prompt), "the same logprobs whatever k"
    assert one.prompt_logprobs == [None]
    assert none.prompt_logprobs is None
    assert_replays(tmp_path / "run.tlog")


async def test_prompt_logprobs_on_the_tiny_model_chunked_or_not_and_past_a_cached_prefix(
        tiny_model: Path, tmp_path: Path) -> None:
    prompt = [(7 * j + 3) % 500 + 5 for j in range(30)]
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=4, ignore_eos=True)
    async with Engine.open(_tiny(tiny_model, tmp_path / "whole.tlog")) as engine:
        whole = await engine.complete(prompt, params)
        again = await engine.complete(prompt, params)  # its prompt is cached now: it must not skip it
        plain = await engine.complete(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    chunks: dict[int, RequestOutput] = {}
    for size in (1, 7):  # one token a chunk runs every prompt position through the decode attention path
        async with Engine.open(_tiny(tiny_model, tmp_path / f"chunked{size}.tlog", max_prefill_tokens=size)) as engine:
            chunks[size] = await engine.complete(prompt, params)
        assert_replays(tmp_path / f"chunked{size}.tlog")
    chunked = chunks[7]
    _check_prompt(whole, prompt, 4)
    assert again.prompt_logprobs == whole.prompt_logprobs
    assert again.usage is not None and again.usage.cached_prompt_tokens == 0
    assert plain.usage is not None and plain.usage.cached_prompt_tokens > 0, "the cache was there to hit"
    assert chunked.token_ids == whole.token_ids == plain.token_ids == chunks[1].token_ids
    assert whole.prompt_logprobs is not None
    for other in chunks.values():
        assert other.prompt_logprobs is not None
        for a, b in zip(whole.prompt_logprobs[1:], other.prompt_logprobs[1:], strict=True):
            assert a is not None and b is not None and list(a) == list(b)
            assert all(abs(a[t] - b[t]) < 1e-9 for t in a), "chunks of 1 or 7 give the one chunk's logprobs"
    with LogReader(tmp_path / "chunked7.tlog") as reader:
        emits = [c for t in reader.ticks() for c in t.outputs.commands if isinstance(c, EmitTokens)]
    assert sum(1 for e in emits for lps in (e.prompt_logprobs or []) if lps) == 1, "logged once"
    assert_replays(tmp_path / "whole.tlog")


# -- every new field: refused naming it --------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("include_stop_str_in_output", 1), ("logprobs", -1), ("logprobs", 21), ("logprobs", True), ("logprobs", 1.5),
    ("prompt_logprobs", -1), ("prompt_logprobs", 21), ("prompt_logprobs", False),
    ("logit_bias", {1: 100.5}), ("logit_bias", {1: -101.0}), ("logit_bias", {1: math.nan}),
    ("logit_bias", {1: math.inf}), ("logit_bias", {-1: 0.0}), ("logit_bias", {"1": 0.0}), ("logit_bias", [1]),
    ("logit_bias", {2**31: 0.0}), ("allowed_token_ids", []), ("allowed_token_ids", [-1]),
    ("allowed_token_ids", [2**31]), ("allowed_token_ids", [True]), ("allowed_token_ids", 3),
    ("n", 0), ("n", 129), ("n", True), ("n", 2.0), ("n", None),
])
def test_each_new_field_out_of_bounds_is_rejected_naming_it(field: str, value: Any) -> None:
    with pytest.raises(RequestRejected, match=rf"SamplingParams\.{field}\b") as raised:
        SamplingParams(**{field: value})
    assert "`$." + field in str(raised.value), "msgspec's path names the field too"


def test_the_old_names_are_gone() -> None:
    with pytest.raises(TypeError):
        SamplingParams(include_stop_str=True)  # type: ignore[call-arg]


def test_top_logprobs_only_mirrors_logprobs() -> None:
    """The log's form of ``logprobs=k`` is ``logprobs=True, top_logprobs=k``; the public field mirrors ``logprobs``."""
    with pytest.raises(RequestRejected, match=r"SamplingParams\.top_logprobs=2 only mirrors logprobs=None"):
        SamplingParams(top_logprobs=2)
    with pytest.raises(RequestRejected, match=r"SamplingParams\.top_logprobs=2 only mirrors logprobs=3"):
        SamplingParams(top_logprobs=2, logprobs=3)
    assert SamplingParams(logprobs=3).top_logprobs == SamplingParams(logprobs=3, top_logprobs=3).top_logprobs == 3
    assert SamplingParams(logprobs=0).top_logprobs == SamplingParams().top_logprobs == 0


def test_seeds_of_n_choices_must_fit() -> None:
    SamplingParams(seed=2**63 - 3, n=3)
    with pytest.raises(RequestRejected, match=r"SamplingParams\.seed=.* with n=4"):
        SamplingParams(seed=2**63 - 3, n=4)


def test_the_wire_form() -> None:
    spec = SamplingParams(logprobs=3, prompt_logprobs=0, logit_bias={9: 1, 2: -0.5}, allowed_token_ids=[5, 3, 5],
                          include_stop_str_in_output=True).to_spec()
    assert (spec.logprobs, spec.top_logprobs, spec.prompt_logprobs) == (True, 3, 0)
    assert spec.logit_bias == [(2, -0.5), (9, 1.0)] and type(spec.logit_bias[1][1]) is float
    assert spec.allowed_token_ids == [3, 5] and spec.include_stop_str_in_output
    plain = SamplingParams().to_spec()
    assert (plain.logprobs, plain.top_logprobs, plain.prompt_logprobs) == (False, 0, None)
    assert plain.logit_bias == [] and plain.allowed_token_ids is None


async def test_token_ids_outside_the_vocabulary_are_rejected_at_submit(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    async with Engine.open(stub_config(tmp_path / "run.tlog")) as engine:
        for field, value in [("logit_bias", {96: 1.0}), ("allowed_token_ids", [3, 96]), ("stop_token_ids", [96])]:
            with pytest.raises(RequestRejected, match=rf"SamplingParams\.{field} contains 96, outside vocab_size=96"):
                engine.generate("hi", SamplingParams(**{field: value}))
    assert core_finishes(tmp_path / "run.tlog") == {}
    async with Engine.open(stub_config(tmp_path / "small.tlog", max_waiting=3, max_batch_size=1)) as engine:
        with pytest.raises(RequestRejected, match=r"SamplingParams\.n=4 is more than the engine holds open at once"):
            engine.generate("hi", SamplingParams(n=4))
        outs = await engine.complete_n("hi", SamplingParams(n=3, max_tokens=2))
    assert [o.index for o in outs] == [0, 1, 2]
    assert_replays(tmp_path / "small.tlog")


# -- the pieces: the sampler's bias and masks, the oracle's distribution -----------------------------------------


def test_the_sampler_applies_bias_then_the_allowed_mask_then_min_tokens() -> None:
    import torch
    from model_fixtures import Spec

    from tickloom.engine.model.sampling import Sampler, SampleRow

    sampler = Sampler(8, torch.device("cpu"))
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]] * 5, dtype=torch.float64)
    rows = [
        SampleRow(Spec(logit_bias=[(0, 100.0)]), 1, 0),  # greedy: the bias wins
        SampleRow(Spec(logit_bias=[(7, -100.0), (99, 5.0)]), 1, 0),  # banned; an id outside the vocabulary: ignored
        SampleRow(Spec(allowed_token_ids=[1, 2], logprobs=True, top_logprobs=3), 1, 0),
        SampleRow(Spec(allowed_token_ids=[2, 3], min_tokens=1), 1, 0, masked_token_ids=[3]),
        SampleRow(Spec(allowed_token_ids=[3], min_tokens=1), 1, 0, masked_token_ids=[3]),  # all masked: fallback
    ]
    out = sampler.sample(logits, rows)
    assert out.token_ids == [0, 6, 2, 2, 3]
    assert out.top_token_ids is not None and out.top_token_ids[2][:2] == [2, 1], "only allowed tokens rank"
    assert out.top_logprobs is not None and out.top_logprobs[2][2] == -math.inf
    assert out.logprobs is not None and abs(math.exp(out.logprobs[2]) + math.exp(out.top_logprobs[2][1]) - 1) < 1e-6
    sampled = sampler.sample(logits[:1].repeat(64, 1), [SampleRow(Spec(temperature=2.0, allowed_token_ids=[1, 4]),
                                                                  s, 0) for s in range(64)])
    assert set(sampled.token_ids) == {1, 4}, "sampling (not only greedy) stays inside the allowed set"


def test_the_oracle_distribution_matches_its_token_and_sums_to_one() -> None:
    from tickloom.events.oracle import oracle_sample, oracle_token

    vocab = 40
    for seed in range(30):
        for avoid in ((), (39,), (3, 4, 5)):
            plain = oracle_sample(seed, seed % 7, vocab, avoid, top_k=vocab)
            assert plain.token == oracle_token(seed, seed % 7, vocab, avoid)
            assert abs(sum(math.exp(v) for v in plain.top_logprobs) - 1.0) < 1e-12
            assert len(plain.top_ids) == vocab - len(avoid) and not set(plain.top_ids) & set(avoid)
            bias = [(seed % vocab, 3.0), ((seed * 7) % vocab, -2.0)]
            shaped = oracle_sample(seed, 1, vocab, avoid, logit_bias=bias, top_k=vocab)
            assert abs(sum(math.exp(v) for v in shaped.top_logprobs) - 1.0) < 1e-12
            assert shaped.token == shaped.top_ids[0] and shaped.logprob == shaped.top_logprobs[0]
            assert shaped.top_logprobs == sorted(shaped.top_logprobs, reverse=True)
            allowed = oracle_sample(seed, 1, vocab, avoid, allowed=[1, 2, 39], logit_bias=bias, top_k=5)
            assert set(allowed.top_ids) == {1, 2, 39} - set(avoid)
            assert abs(sum(math.exp(v) for v in allowed.top_logprobs) - 1.0) < 1e-12
