"""Tensor parallelism as an engine option (``EngineConfig.tensor_parallel_size``): two ranks of the tiny model, rank 0
in the test's process and rank 1 a worker process the engine starts, give the tokens of one rank for concurrent
greedy and seeded requests; the log replays; closing leaves no worker; a worker killed mid-run fails the engine
instead of hanging it; what cannot be sharded is refused naming the field."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import trio
from engine_helpers import assert_replays

from tickloom import ConfigError, Engine, EngineConfig, EngineError, SamplingParams
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.events import LogReader


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)


def _config(model: Path, log: Path | None, tp: int, **kw: object) -> EngineConfig:
    base: dict[str, object] = dict(model=str(model), dtype="float32", threads=1, num_blocks=96, max_seq_len=256,
                                   max_batch_size=8, max_prefill_tokens=48, tensor_parallel_size=tp,
                                   log_path=None if log is None else str(log))
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def _prompt(i: int) -> list[int]:
    return [3 + (7 * j) % 200 for j in range(16)] + [10 + (i * 31 + 5 * j) % 400 for j in range(9 + 13 * i)]


def _params(i: int, max_tokens: int = 12) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i,
                          ignore_eos=True)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _run(config: EngineConfig, requests: int) -> tuple[dict[int, list[int]], list[int]]:
    tokens: dict[int, list[int]] = {}
    async with Engine.open(config) as engine:
        pids = engine.runtime.ranks.pids if engine.runtime.ranks is not None else []
        assert all(not _gone(pid) for pid in pids)
        async with trio.open_nursery() as nursery:
            async def one(i: int) -> None:
                out = await engine.complete(_prompt(i), _params(i), request_id=f"r{i}")
                assert out.finish_reason == "length"
                tokens[i] = out.token_ids

            for i in range(requests):
                nursery.start_soon(one, i)
    return tokens, pids


@pytest.mark.slow
async def test_two_ranks_give_the_tokens_of_one_and_the_log_replays(tiny: Path, tmp_path: Path) -> None:
    one, _ = await _run(_config(tiny, tmp_path / "one.tlog", 1), 6)
    two, pids = await _run(_config(tiny, tmp_path / "two.tlog", 2), 6)
    assert sorted(two) == list(range(6)) and all(len(t) == 12 for t in two.values())
    assert two == one
    assert len(pids) == 1 and all(_gone(pid) for pid in pids), "closing the engine stops its workers"
    with LogReader(tmp_path / "two.tlog") as reader:
        assert json.loads(reader.header.config_json)["engine"]["tensor_parallel_size"] == 2
    assert_replays(tmp_path / "two.tlog")


@pytest.mark.slow
async def test_an_error_in_the_block_still_stops_the_workers(tiny: Path) -> None:
    pids: list[int] = []
    with pytest.raises(KeyError, match="from the block"):
        async with Engine.open(_config(tiny, None, 2)) as engine:
            assert engine.runtime.ranks is not None
            pids = engine.runtime.ranks.pids
            await engine.complete(_prompt(0), _params(1, max_tokens=2))
            raise KeyError("from the block")
    assert pids and all(_gone(pid) for pid in pids)


@pytest.mark.slow
async def test_a_worker_killed_mid_run_fails_the_engine_instead_of_hanging(tiny: Path, tmp_path: Path) -> None:
    log = tmp_path / "killed.tlog"
    pids: list[int] = []
    failures: list[BaseException | str] = []
    with trio.fail_after(120), pytest.raises(EngineError, match=r"tensor-parallel rank 1 .* signal SIGKILL"):
        async with Engine.open(_config(tiny, log, 2, max_seq_len=2048, num_blocks=512)) as engine:
            assert engine.runtime.ranks is not None
            pids = engine.runtime.ranks.pids

            async def one(i: int) -> None:
                try:
                    async for out in engine.generate(_prompt(i), _params(i, max_tokens=1500), request_id=f"r{i}"):
                        if out.finish_reason is not None:
                            failures.append(out.finish_reason)  # the failed step ended it ("error")
                except EngineError as exc:  # or the engine failed first
                    failures.append(exc)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
                while engine.stats()["tokens"] < 10:
                    await trio.sleep(0.01)
                os.kill(pids[0], signal.SIGKILL)
    assert len(failures) == 3 and all(f == "error" or isinstance(f, EngineError) for f in failures), failures
    assert all(_gone(pid) for pid in pids)
    assert_replays(log)


async def test_a_model_whose_heads_do_not_divide_is_refused_at_open(tiny: Path) -> None:
    with pytest.raises(ConfigError, match=r"EngineConfig.tensor_parallel_size=3: .*num_heads=4 divisible by 3"):
        async with Engine.open(_config(tiny, None, 3)):
            pass


def test_what_tensor_parallelism_cannot_run_is_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"EngineConfig.tensor_parallel_size=2: KV spill"):
        EngineConfig(model="x", tensor_parallel_size=2, host_spill_bytes=1 << 20)
    with pytest.raises(ConfigError, match=r"EngineConfig.tensor_parallel_size=2: KV spill"):
        EngineConfig(model="x", tensor_parallel_size=2, spill_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"EngineConfig.tensor_parallel_size=2: the stub model"):
        EngineConfig(model="stub", tensor_parallel_size=2)
    for bad in (0, 65, 1.5, "2"):
        with pytest.raises(ConfigError, match=r"^EngineConfig.*tensor_parallel_size"):
            EngineConfig(tensor_parallel_size=bad)  # type: ignore[arg-type]


@pytest.mark.slow
async def test_a_cancelled_engine_still_stops_the_workers(tiny: Path) -> None:
    pids: list[int] = []
    with trio.move_on_after(60) as scope:
        async with Engine.open(_config(tiny, None, 2, max_seq_len=2048, num_blocks=512)) as engine:
            assert engine.runtime.ranks is not None
            pids = engine.runtime.ranks.pids
            async for out in engine.generate(_prompt(1), _params(1, max_tokens=1500)):
                if out.token_ids:
                    scope.cancel()
    assert scope.cancelled_caught
    assert pids and all(_gone(pid) for pid in pids)


@pytest.mark.slow
def test_the_command_line_runs_and_replays_a_tensor_parallel_engine(tiny: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from tickloom.tools.cli import EX_USAGE, main

    log = tmp_path / "cli.tlog"
    assert main(["generate", "--model", str(tiny), "--dtype", "float32", "--tensor-parallel-size", "2",
                 "--max-tokens", "6", "--temperature", "0", "--log", str(log), "--max-seq-len", "256",
                 "hello", "world"]) == 0
    assert main(["replay", str(log)]) == 0
    assert "identical" in capsys.readouterr().out
    assert main(["generate", "--model", "stub", "--tensor-parallel-size", "2", "x"]) == EX_USAGE
    assert "tensor_parallel_size=2: the stub model" in capsys.readouterr().err
