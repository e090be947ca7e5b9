"""llama.cpp's side of the benches (tools/bench/llamacpp.py): the probe that decides whether llama.cpp runs with its
extra buffer types, which fault on some CPUs (AMX) and would otherwise take the whole bench down."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tickloom.tools.bench import llamacpp


def test_a_clean_exit_means_the_defaults_run() -> None:
    assert llamacpp.probe_outcome(0, "") is True


def test_a_death_by_a_signal_means_they_fault() -> None:
    assert llamacpp.probe_outcome(-11, "") is False  # SIGSEGV: ggml's AMX matmul on an ldtilecfg fault


def test_any_other_failure_is_an_error_that_shows_the_childs_last_lines() -> None:
    stderr = "\n".join(f"line {i}" for i in range(10)) + "\nFileNotFoundError: no such model"
    with pytest.raises(RuntimeError, match="exit 1") as info:
        llamacpp.probe_outcome(1, stderr)
    assert "no such model" in str(info.value) and "line 0" not in str(info.value)


class _Runner:
    def __init__(self, gguf: Path, extra_buffers: bool = True) -> None:
        self.gguf, self.extra_buffers = gguf, extra_buffers


@pytest.mark.parametrize("works", [True, False])
def test_runner_for_keeps_the_defaults_where_they_run_and_says_so_where_not(
        monkeypatch: pytest.MonkeyPatch, works: bool) -> None:
    monkeypatch.setattr(llamacpp, "extra_buffers_work", lambda gguf: works)
    monkeypatch.setattr(llamacpp, "LlamaCppRunner", _Runner)
    runner: Any
    runner, note = llamacpp.runner_for(Path("/m/model.gguf"))
    assert runner.extra_buffers is works
    if works:
        assert note is None
    else:
        assert note is not None and "model.gguf" in note and "use_extra_bufts=False" in note
