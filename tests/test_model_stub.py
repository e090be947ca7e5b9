"""The stub executor: same interface as ModelExecutor, tokens from a pure oracle, no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from model_fixtures import Spec

from tickloom.engine.model.stub import StubExecutor, token_for
from tickloom.engine.model.tables import step_of
from tickloom.events.commands import BindRequest


def test_stub_tokens_follow_oracle() -> None:
    ex = StubExecutor(vocab_size=100)
    ex.bind(BindRequest("a", Spec(), 5, 3, []))
    ex.bind(BindRequest("b", Spec(), 6, 2, []))
    res = ex.run_step(step_of(["a", "b"], [0, 0], [3, 2], [1, 2, 3, 4, 5], [0, -1], [0, 0], [1, 1], [7, 9]))
    assert res.token_ids == [token_for(5, 0, 100)]
    assert ex.block_table("a") == [7] and ex.block_table("b") == [9]
    res = ex.run_step(step_of(["b", "a"], [2, 3], [1, 1], [9, -1], [0, 1], [1, 1], [0, 0], []))
    assert res.token_ids == [token_for(6, 0, 100), token_for(5, 1, 100)]
    host = ex.copy_out("a", [7], 4)
    assert host.num_tokens == 4 and host.nbytes() == 0
    ex.copy_in("a", [3], host)
    assert ex.block_table("a") == [3]
    ex.release("a")
    assert not ex.is_bound("a")


def test_stub_refuses_a_copy_in_into_fewer_blocks_than_were_copied_out() -> None:
    """The rule of the real cache (``PagedKVCache.copy_blocks_in``), kept by the stub for the actor tests."""
    ex = StubExecutor(vocab_size=100)
    ex.bind(BindRequest("a", Spec(), 5, 3, []))
    host = ex.copy_out("a", [7, 8, 9], 40)
    with pytest.raises(ValueError, match="host KV holds 3 blocks, only 2 block ids given"):
        ex.copy_in("a", [1, 2], host)
    host = ex.copy_out("a", [7, 8], 20)
    ex.copy_in("a", [1, 2, 3], host)
    assert ex.block_table("a") == [1, 2, 3]


def test_oracle_is_pure() -> None:
    assert token_for(1, 2) == token_for(1, 2)
    assert len({token_for(1, i) for i in range(50)}) > 40


def test_stub_does_not_import_torch() -> None:
    code = "import sys, engine.model.stub; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
