from __future__ import annotations

from pathlib import Path

import pytest
from purity import REPO, assert_package_pure, banned_imports

EVENTS_BANNED = {"trio", "torch", "time", "random", "threading", "asyncio"}


def test_events_imports_nothing_banned() -> None:
    assert_package_pure(REPO / "events", EVENTS_BANNED)


def test_checker_finds_every_kind_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import os\nfrom . import sub\n")
    (pkg / "sub" / "__init__.py").write_text(
        "def f():\n    import time\n    from torch.nn import functional\n"
        "import importlib\nimportlib.import_module('trio')\n__import__('random')\nimport timeit\n"
    )
    found = banned_imports(pkg, EVENTS_BANNED)
    assert [f.rsplit(": ", 1)[1] for f in found] == ["time", "torch.nn", "trio", "random"]
    with pytest.raises(AssertionError, match=r"torch\.nn"):
        assert_package_pure(pkg, EVENTS_BANNED)


def test_checker_rejects_an_empty_path(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="no Python files"):
        banned_imports(tmp_path, EVENTS_BANNED)
