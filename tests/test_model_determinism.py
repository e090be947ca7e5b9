"""Counter-based sampling: a request's tokens do not depend on batch, preemption, copies or re-runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import Driver, Spec, make_executor, prompts

from tickloom.engine.model.tables import step_of
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.events.commands import BindRequest

torch.set_num_threads(1)
SPEC = Spec(temperature=0.8)
N_NEW = 16


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny64"), seed=11, dtype="float64", vocab_size=320)


def alone(model_dir: Path, prompt: list[int], seed: int) -> list[int]:
    drv = Driver(make_executor(model_dir, dtype="float64", num_blocks=64), seed=5)
    drv.add("x", prompt, SPEC, seed)
    return drv.generate(["x"], N_NEW)["x"]


def test_alone_vs_batch_of_16(tiny64: Path) -> None:
    ps = prompts(16, 6, vocab=300, seed=4)
    drv = Driver(make_executor(tiny64, dtype="float64", num_blocks=512), seed=9)
    for i, p in enumerate(ps):
        spec = Spec(temperature=0.8, top_p=0.95) if i % 3 == 0 else SPEC
        drv.add(f"r{i}", p, spec if i else SPEC, seed=1000 + i)
    batch = drv.generate([f"r{i}" for i in range(16)], N_NEW, chunk=4)
    assert batch["r0"] == alone(tiny64, ps[0], 1000)
    assert batch["r5"] == alone(tiny64, ps[5], 1005)
    assert len({tuple(v) for v in batch.values()}) == 16
    # sampling is not greedy: some token differs from the argmax path
    greedy = Driver(make_executor(tiny64, dtype="float64", num_blocks=64), seed=1)
    greedy.add("g", ps[0], Spec(), 1000)
    assert greedy.generate(["g"], N_NEW)["g"] != batch["r0"]


def test_seed_changes_tokens(tiny64: Path) -> None:
    p = prompts(1, 8, vocab=300, seed=2)[0]
    assert alone(tiny64, p, 1) != alone(tiny64, p, 2)


def test_copy_out_and_back_in(tiny64: Path) -> None:
    p = prompts(1, 10, vocab=300, seed=6)[0]
    expect = alone(tiny64, p, 77)
    ex = make_executor(tiny64, dtype="float64", num_blocks=64)
    drv = Driver(ex, seed=2)
    drv.add("x", p, SPEC, 77)
    drv.add("filler", prompts(1, 5, vocab=300, seed=8)[0], SPEC, 3)
    drv.generate(["x", "filler"], 6)
    r = drv.reqs["x"]
    ctx = r.pos
    host = ex.copy_out("x", list(r.table), ctx)
    assert host.k is not None and host.k.shape[1] == len(r.table)
    # free the old blocks, scribble over them, restore into different blocks
    old = list(r.table)
    for b in old:
        for layer in range(ex.kv.num_layers):
            ex.kv.k[layer][b].normal_()
            ex.kv.v[layer][b].normal_()
    new = [drv.free.pop() for _ in old]
    drv.free.extend(old)
    ex.copy_in("x", new, host)
    r.table = new
    assert ex.block_table("x") == new
    out = drv.generate(["x"], N_NEW)["x"]
    assert out == expect


def test_preempt_and_recompute(tiny64: Path) -> None:
    p = prompts(1, 7, vocab=300, seed=12)[0]
    expect = alone(tiny64, p, 5)
    ex = make_executor(tiny64, dtype="float64", num_blocks=64)
    drv = Driver(ex, seed=4)
    drv.add("x", p, SPEC, 5)
    first = drv.generate(["x"], 5)["x"]
    # preempt: drop KV, then recompute prompt + outputs so far as a new prefill in other blocks
    drv.release("x")
    drv.add("x", p + first, SPEC, 5)
    drv.reqs["x"].prompt = list(p)
    drv.reqs["x"].out = list(first)
    ex.bind(BindRequest("x", SPEC, 5, len(p), []))
    out = drv.generate(["x"], N_NEW, chunk=3)["x"]
    assert out == expect


def test_step_rerun(tiny64: Path) -> None:
    """Re-running a step (same positions, same blocks) yields the same token."""
    p = prompts(1, 9, vocab=300, seed=13)[0]
    expect = alone(tiny64, p, 21)
    ex = make_executor(tiny64, dtype="float64", num_blocks=64)
    drv = Driver(ex, seed=6)
    drv.add("x", p, SPEC, 21)
    drv.generate(["x"], 4)
    r = drv.reqs["x"]
    pos, tok = r.pos, r.out[-1]
    need = -(-(pos + 1) // ex.block_size) - len(r.table)
    new = [drv.free.pop() for _ in range(need)]
    r.table.extend(new)
    a = ex.run_step(step_of(["x"], [pos], [1], [tok], [len(r.out)], [len(r.table) - len(new)], [len(new)], new))
    b = ex.run_step(step_of(["x"], [pos], [1], [tok], [len(r.out)], [len(r.table)], [0], []))
    assert a.token_ids == b.token_ids
    r.out.append(a.token_ids[0])
    r.pos += 1
    assert drv.generate(["x"], N_NEW)["x"] == expect


def test_placeholder_input_uses_sampled_token(tiny64: Path) -> None:
    """A row fed from an in-flight step passes -1; the executor substitutes the sampled token."""
    p = prompts(1, 6, vocab=300, seed=14)[0]
    expect = alone(tiny64, p, 8)
    ex = make_executor(tiny64, dtype="float64", num_blocks=64)
    drv = Driver(ex, seed=7)
    drv.add("x", p, SPEC, 8)
    drv.generate(["x"], 1)
    r = drv.reqs["x"]
    res = ex.run_step(step_of(["x"], [r.pos], [1], [-1], [1], [len(r.table)], [0], []))
    r.out.append(res.token_ids[0])
    r.pos += 1
    assert drv.generate(["x"], N_NEW)["x"] == expect


def test_penalties_and_logprobs_through_executor(tiny64: Path) -> None:
    spec = Spec(temperature=0.8, repetition_penalty=1.5, presence_penalty=50.0, logprobs=True, top_logprobs=3)
    ps = prompts(4, 6, vocab=300, seed=15)
    ex = make_executor(tiny64, dtype="float64", num_blocks=128)
    drv = Driver(ex, seed=8)
    for i, p in enumerate(ps):
        drv.add(f"r{i}", p, spec if i != 1 else SPEC, seed=40 + i)
    res = drv.step([f"r{i}" for i in range(4)], chunk=3)
    assert res.token_ids == [] and res.logprobs is None  # no row finished its prompt yet
    res = drv.step([f"r{i}" for i in range(4)])
    assert len(res.token_ids) == 4
    assert res.logprobs is not None and all(lp <= 0.0 for lp in res.logprobs)
    assert res.top_token_ids is not None and [len(t) for t in res.top_token_ids] == [3, 0, 3, 3]
    batch = drv.generate([f"r{i}" for i in range(4)], N_NEW)
    solo = Driver(make_executor(tiny64, dtype="float64", num_blocks=64), seed=1)
    solo.add("x", ps[2], spec, 42)
    assert solo.generate(["x"], N_NEW)["x"] == batch["r2"]
    for rid in ("r0", "r2", "r3"):  # a presence penalty of 50 forbids repeats
        assert len(set(batch[rid])) == len(batch[rid])
