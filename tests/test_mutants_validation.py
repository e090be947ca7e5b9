"""Behavioural tests that kill the mutants of the validation boundary (scripts/mutate.sh --area validation):
``tickloom/params.py`` (SamplingParams and the helpers every public input goes through) and the checks of
``tickloom/config.py``. A refusal is part of the API: its class, the name of the struct and field it starts with,
and its bounds are pinned here, exactly at each boundary."""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec
import pytest
from msgspec import Meta

from tickloom.config import EngineConfig, FaultPlan
from tickloom.engine.core import ConfigError
from tickloom.engine.errors import RequestRejected
from tickloom.events import SamplingSpec
from tickloom.events.types import INT64_MAX, Bound, TokenId
from tickloom.params import SamplingParams, _mentions_token_ids
from tickloom.validation import checked, encodable, encodable_all, unencodable, with_bounds

BAD = "\ud800"  # a lone surrogate: UTF-8 cannot encode it


# --- unencodable, checked, encodable -------------------------------------------------------------------------------


def test_unencodable_names_the_path_of_the_first_bad_string() -> None:
    assert unencodable("ok") is None
    assert unencodable(BAD) == ""
    assert unencodable(["a", BAD]) == "[1]"
    assert unencodable(("a", "b", BAD)) == "[2]"
    assert unencodable({"stop": ["x", BAD]}) == ".stop[1]"
    assert unencodable({"not an id": BAD}) == "['not an id']"
    assert unencodable({3: BAD}) == "[3]"
    assert unencodable({"outer": {"inner": BAD}}) == ".outer['inner']"  # only a top-level key is written .key
    assert unencodable({BAD: 1}) == f"[{BAD!r}]"  # a bad key
    assert unencodable({(1, BAD): 1}) == "[(1, '\\ud800')][1]"
    assert unencodable({"a": "ok", "b": BAD}) == ".b"
    assert unencodable(5) is None and unencodable(None) is None
    assert unencodable({BAD}) == "[0]"


def _nest_list(levels: int) -> Any:
    value: Any = BAD
    for _ in range(levels):
        value = [value]
    return value


def _nest_dict(levels: int) -> Any:
    value: Any = BAD
    for _ in range(levels):
        value = {"k": value}
    return value


def _nest_key(levels: int) -> Any:
    """A dict whose key holds the bad string ``levels - 1`` tuples deep."""
    key: Any = BAD
    for _ in range(levels - 1):
        key = (key,)
    return {key: 0}


@pytest.mark.parametrize("nest", [_nest_list, _nest_dict, _nest_key])
def test_unencodable_searches_containers_eight_deep(nest: Any) -> None:
    """A string at depth 8 is still checked; a container at depth 8 is not searched (msgspec refuses the shape)."""
    assert unencodable(nest(8)) is not None
    assert unencodable(nest(9)) is None
    assert unencodable(nest(9), "", 0) is None
    assert unencodable(nest(7), "", 1) is not None and unencodable(nest(8), "", 1) is None


def test_checked_converts_or_refuses_with_the_error_asked_for() -> None:
    assert checked(3, int, "X") == 3
    with pytest.raises(RequestRejected) as info:
        checked(BAD, str, "What")
    assert str(info.value) == "What is not encodable as UTF-8 (a lone surrogate)"
    with pytest.raises(ConfigError) as info2:
        checked({"a": ["x", BAD]}, dict[str, list[str]], "Cfg", ConfigError)
    assert str(info2.value) == "Cfg.a[1] is not encodable as UTF-8 (a lone surrogate)"
    with pytest.raises(ConfigError) as info2:
        checked("x", int, "Cfg", ConfigError)
    assert str(info2.value) == "Cfg: Expected `int`, got `str`"


def test_encodable_names_the_string_and_the_index() -> None:
    encodable("fine", "X")
    with pytest.raises(RequestRejected) as info:
        encodable("ab" + BAD, "X.stop")
    assert str(info.value) == "X.stop is not encodable as UTF-8 (surrogates not allowed at index 2)"
    encodable_all(["a", "b"], "W")
    with pytest.raises(ConfigError) as info2:
        encodable_all(["a", "b", BAD], "W", ConfigError)
    assert str(info2.value) == "W[2] is not encodable as UTF-8 (surrogates not allowed at index 0)"
    with pytest.raises(RequestRejected) as info:
        encodable_all([BAD], "V")
    assert str(info.value) == "V[0] is not encodable as UTF-8 (surrogates not allowed at index 0)"


# --- with_bounds and the token-id fields ----------------------------------------------------------------------------


def test_with_bounds_turns_every_bound_into_its_meta() -> None:
    ge1 = Meta(ge=1)
    assert with_bounds(int) is int
    assert with_bounds(Annotated[int, Bound(ge1)]) == Annotated[int, ge1]
    assert with_bounds(Annotated[int, Meta(le=3)]) == Annotated[int, Meta(le=3)]  # a plain Meta stays
    assert with_bounds(Annotated[int, Bound(ge1), "doc"]) == Annotated[int, ge1, "doc"]
    assert with_bounds(list[Annotated[int, Bound(ge1)]]) == list[Annotated[int, ge1]]
    assert with_bounds(dict[str, Annotated[int, Bound(ge1)]]) == dict[str, Annotated[int, ge1]]
    assert with_bounds(tuple[Annotated[int, Bound(ge1)], ...]) == tuple[Annotated[int, ge1], ...]
    assert with_bounds(Annotated[list[Annotated[int, Bound(ge1)]], Bound(Meta(max_length=2))]) == Annotated[
        list[Annotated[int, ge1]], Meta(max_length=2)]
    union = with_bounds(Annotated[int, Bound(ge1)] | None)
    assert union == Annotated[int, ge1] | None
    assert with_bounds(Union[int, Annotated[str, Bound(Meta(min_length=1))]]) == Union[  # noqa: UP007
        int, Annotated[str, Meta(min_length=1)]]
    # and msgspec enforces the result
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert([0], with_bounds(list[Annotated[int, Bound(ge1)]]))
    assert msgspec.convert((1, 2, 3), with_bounds(tuple[Annotated[int, Bound(ge1)], ...])) == (1, 2, 3)


def test_mentions_token_ids_finds_token_id_fields_at_any_depth() -> None:
    assert _mentions_token_ids(TokenId)
    assert _mentions_token_ids(list[TokenId])
    assert _mentions_token_ids(dict[TokenId, float])
    assert _mentions_token_ids(list[TokenId] | None)
    assert _mentions_token_ids(tuple[TokenId, ...])
    assert not _mentions_token_ids(int)
    assert not _mentions_token_ids(Annotated[int, Bound(Meta(ge=0))])
    assert not _mentions_token_ids(Annotated[int, Meta(ge=0)])
    assert not _mentions_token_ids(Annotated[int, "token_ids"])
    assert not _mentions_token_ids(tuple[int, ...])
    assert not _mentions_token_ids(list[str] | None)


def test_every_token_id_field_is_checked_against_the_vocabulary() -> None:
    params = SamplingParams(stop_token_ids=[5], allowed_token_ids=[1, 2], logit_bias={3: 1.0})
    params.check_vocabulary(6)
    for field, value in [("stop_token_ids", [9]), ("allowed_token_ids", [1, 9]), ("logit_bias", {9: 1.0})]:
        with pytest.raises(RequestRejected) as info:
            SamplingParams(**{field: value}).check_vocabulary(9)
        assert str(info.value) == f"SamplingParams.{field} contains 9, outside vocab_size=9"


# --- SamplingParams -----------------------------------------------------------------------------------------------


def test_a_bad_field_is_refused_naming_sampling_params() -> None:
    with pytest.raises(RequestRejected) as info:
        SamplingParams(max_tokens=0)
    assert str(info.value).startswith("SamplingParams.max_tokens=0: Expected `int` >= 1")
    with pytest.raises(RequestRejected) as info:
        SamplingParams(stop=["ok", BAD])
    assert str(info.value) == "SamplingParams.stop[1] is not encodable as UTF-8 (a lone surrogate)"


def test_min_tokens_may_equal_max_tokens() -> None:
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    with pytest.raises(RequestRejected) as info:
        SamplingParams(min_tokens=5, max_tokens=4)
    assert str(info.value) == "SamplingParams.min_tokens=5 must not exceed max_tokens=4"


@pytest.mark.parametrize("n", [2, 5, 128])
def test_the_last_choice_seed_must_fit_int64(n: int) -> None:
    highest = INT64_MAX - n + 1
    assert SamplingParams(seed=highest, n=n).seed == highest
    with pytest.raises(RequestRejected) as info:
        SamplingParams(seed=highest + 1, n=n)
    assert str(info.value) == (f"SamplingParams.seed={highest + 1} with n={n}: choice i is seeded seed + i, which must "
                               "stay below 2**63")


def test_top_logprobs_only_mirrors_logprobs() -> None:
    assert SamplingParams(logprobs=3, top_logprobs=3).top_logprobs == 3
    assert SamplingParams(logprobs=3).top_logprobs == 3
    assert SamplingParams(logprobs=3, top_logprobs=0).top_logprobs == 3
    assert SamplingParams().top_logprobs == 0
    for logprobs, top in [(None, 1), (3, 2), (0, 1)]:
        with pytest.raises(RequestRejected) as info:
            SamplingParams(logprobs=logprobs, top_logprobs=top)
        assert str(info.value) == (f"SamplingParams.top_logprobs={top} only mirrors logprobs={logprobs}: set "
                                   "logprobs=k for k top logprobs")


def test_to_spec_is_the_logged_wire_form() -> None:
    params = SamplingParams(stop="Paris", logprobs=2, logit_bias={9: 1.5, 2: -1.0}, allowed_token_ids=[7, 3, 7, 1],
                            stop_token_ids=[4, 4], max_tokens=9, temperature=0.5, seed=3)
    spec = params.to_spec()
    assert isinstance(spec, SamplingSpec)
    assert spec.stop == ["Paris"]
    assert (spec.logprobs, spec.top_logprobs) == (True, 2)
    assert spec.logit_bias == [(2, -1.0), (9, 1.5)]
    assert spec.allowed_token_ids == [1, 3, 7]
    assert spec.stop_token_ids == [4, 4] and spec.stop_token_ids is not params.stop_token_ids
    assert (spec.max_tokens, spec.temperature) == (9, 0.5)
    bare = SamplingParams().to_spec()
    assert (bare.logprobs, bare.top_logprobs, bare.allowed_token_ids, bare.stop, bare.logit_bias) == (
        False, 0, None, [], [])
    listed = SamplingParams(stop=["a", "b"])
    assert listed.to_spec().stop == ["a", "b"] and listed.to_spec().stop is not listed.stop
    zero = SamplingParams(logprobs=0).to_spec()
    assert (zero.logprobs, zero.top_logprobs) == (True, 0)
    # equal params log equal bytes
    assert msgspec.msgpack.encode(SamplingParams(allowed_token_ids=[2, 1, 2]).to_spec()) == msgspec.msgpack.encode(
        SamplingParams(allowed_token_ids=[1, 2]).to_spec())


# --- EngineConfig and FaultPlan -----------------------------------------------------------------------------------


def test_fault_plan_refusals_name_it() -> None:
    with pytest.raises(ConfigError) as info:
        FaultPlan(fail_steps=[-1])
    assert str(info.value).startswith("FaultPlan.fail_steps=[-1]: Expected `int` >= 0")
    plan = FaultPlan(fail_steps=[1, 2], crash_after=1)
    assert plan.crash_after == 1.0 and type(plan.crash_after) is float


def test_engine_config_knob_relations_name_it() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(model="stub", max_batch_size=8, max_batch_tokens=4)
    assert str(info.value) == ("EngineConfig.max_batch_tokens=4 is below max_batch_size=8: a full batch of decode rows "
                               "would never fit in one step")


def test_tensor_parallelism_refusals() -> None:
    assert EngineConfig(model="some/dir", tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ConfigError) as info:
        EngineConfig(model="stub", tensor_parallel_size=2)
    assert str(info.value) == ("EngineConfig.tensor_parallel_size=2: the stub model has no weights to shard; use "
                               "tensor_parallel_size=1 with model='stub'")
    for spill in ({"host_spill_bytes": 1024}, {"spill_dir": "/tmp"}):
        with pytest.raises(ConfigError) as info:
            EngineConfig(model="some/dir", tensor_parallel_size=4, **spill)
        assert str(info.value) == (
            "EngineConfig.tensor_parallel_size=4: KV spill (spill_dir, host_spill_bytes) is not supported with tensor "
            "parallelism (each rank holds a shard of the KV cache); turn spill off or use tensor_parallel_size=1")
    assert EngineConfig(model="stub", host_spill_bytes=1024).spill_enabled
