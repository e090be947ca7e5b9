"""``tickloom serve --quiet`` (``-q``), as the other engine commands' ``--quiet``: no progress lines on stderr while
the model loads or converts; the access and stats lines keep their own switches."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tickloom.engine.model.tiny import write_tiny_model
from tickloom.tools.cli import main
from tickloom.tools.serve import server

LINES = ["loading tiny…", "loaded tiny in 1.0 s"]


@pytest.fixture
def model_logger(monkeypatch: pytest.MonkeyPatch) -> Iterator[logging.Logger]:
    """The model loaders' logger with no handler yet (as in a fresh process); put back as it was afterwards."""
    logger = logging.getLogger("tickloom.engine.model")
    level = logger.level
    monkeypatch.setattr(logger, "handlers", [])
    try:
        yield logger
    finally:
        logger.setLevel(level)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``server.run`` replaced by one that logs what loading a model logs, and records its config."""
    configs: list[Any] = []

    def run(config: Any, options: Any, fleet: Any = None) -> None:
        configs.append(config)
        loader = logging.getLogger("tickloom.engine.model.loaders")
        for line in LINES:
            loader.info(line)

    monkeypatch.setattr(server, "run", run)
    return configs


@pytest.mark.parametrize("flag", ["--quiet", "-q"])
def test_serve_quiet_shows_no_model_loading_lines(flag: str, model_logger: logging.Logger, served: list[Any],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "stub", "--no-log", flag]) == 0
    assert len(served) == 1 and capsys.readouterr().err == ""


def test_serve_without_quiet_shows_them(model_logger: logging.Logger, served: list[Any],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "stub", "--no-log"]) == 0
    assert len(served) == 1 and capsys.readouterr().err.splitlines() == LINES


def test_serve_quiet_in_its_own_process_starts_with_the_listening_line(tmp_path: Path) -> None:
    """A real model (a tiny checkpoint) loaded by ``tickloom serve``: without ``--quiet`` stderr says so first."""
    model = write_tiny_model(tmp_path / "tiny", seed=1)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    first: dict[str, str] = {}
    for quiet in (["--quiet"], []):
        proc = subprocess.Popen([sys.executable, "-m", "tickloom", "serve", "--model", str(model), "--port", "0",
                                 "--no-log", "--num-blocks", "64", "--max-seq-len", "256", *quiet],
                                cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stderr is not None
            first[" ".join(quiet)] = proc.stderr.readline()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    assert " on http://" in first["--quiet"], first
    assert first[""].startswith(f"loading {model}"), first
