"""``tickloom serve --quiet`` (``-q``), as the other engine commands' ``--quiet``: no progress lines on stderr while
the model loads or converts; the access and stats lines keep their own switches."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

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
