"""tickloom installs one import name, ``tickloom``, so it can live next to an app's own ``events``, ``engine`` or
``tools`` (and next to PyPI packages with those names)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from purity import REPO, imports_of

OLD_TOP_LEVEL = {"engine", "events", "actors", "replay", "tools", "fleet"}
"""The repository's folders, importable only as ``tickloom.<folder>``."""


def test_nothing_imports_the_folders_as_top_level_names() -> None:
    """One module imported under two names would be two modules, with two copies of every class and table."""
    found = []
    for folder in (*sorted(OLD_TOP_LEVEL), "tests", "tickloom"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for line, module in imports_of(path.read_text(encoding="utf-8"), str(path)):
                if module.split(".")[0] in OLD_TOP_LEVEL:
                    found.append(f"{path.relative_to(REPO)}:{line}: {module}")
    assert found == [], "import these as tickloom.<name>:\n" + "\n".join(found)


def test_the_public_api_is_at_the_top() -> None:
    import tickloom
    from tickloom.api import Engine
    from tickloom.asyncio import Engine as AsyncioEngine

    assert tickloom.Engine is Engine and AsyncioEngine.__module__ == "tickloom.asyncio"
    for name in tickloom.__all__:  # the one export table: every name resolves, to an object of that name
        assert getattr(tickloom, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = tickloom.Nope
    # no second table below: the subpackages export nothing of their own
    import tickloom.engine
    import tickloom.engine.model

    assert not hasattr(tickloom.engine, "Engine") and not hasattr(tickloom.engine.model, "StubExecutor")


def test_a_checkout_without_links_is_told_how_to_fix_it(tmp_path: Path) -> None:
    """git with core.symlinks=false writes each link as a text file holding its target: importing tickloom then
    fails with the fix, instead of importing the repository root as the package."""
    pkg = tmp_path / "tickloom"
    pkg.mkdir()
    shutil.copy(REPO / "tickloom" / "__init__.py", pkg / "__init__.py")
    for name in OLD_TOP_LEVEL:
        (pkg / name).write_text(f"../{name}")
    (tmp_path / "engine").mkdir()  # the real folder beside it, as in such a checkout
    (tmp_path / "engine" / "__init__.py").write_text("")
    run = subprocess.run([sys.executable, "-c", "import tickloom.engine"], cwd=tmp_path, capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    assert run.returncode == 1
    assert "holds its symbolic links as plain files" in run.stderr and "core.symlinks true" in run.stderr


def _source_copy(dest: Path) -> Path:
    """The checkout without its build products, links kept as links (as a fresh clone has them)."""
    skip = shutil.ignore_patterns(".venv", ".git", "mutants", "build", "dist", "*.egg-info", "__pycache__",
                                  ".*_cache", ".hypothesis", "*.tlog")
    shutil.copytree(REPO, dest, symlinks=True, ignore=skip)
    return dest


@pytest.mark.slow
def test_the_wheel_runs_next_to_an_app_with_the_same_names(tmp_path: Path) -> None:
    """Build the wheel, install it into a fresh venv, and run a request from an app directory that has its own
    ``events.py``, ``engine/`` and ``tools.py``: the app keeps its modules and tickloom works."""
    src = _source_copy(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("tickloom-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
        names = set(zf.namelist())
    assert tops == {"tickloom", next(t for t in tops if t.endswith(".dist-info"))}, tops
    assert {"tickloom/engine/core/scheduler.py", "tickloom/events/known_schemas.txt", "tickloom/py.typed"} <= names
    with zipfile.ZipFile(wheel) as zf:
        (metadata,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        requires = [line.split(": ", 1)[1] for line in zf.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist: trio")]
    # An app pinned to the trio release before the one the actor-level explorer is checked against installs
    # tickloom; only the `explore` extra asks for that exact release.
    plain = [Requirement(r) for r in requires if "extra ==" not in r]
    assert len(plain) == 1 and plain[0].specifier.contains("0.34.0") and plain[0].specifier.contains("0.35.0"), plain
    extra = [Requirement(r) for r in requires if 'extra == "explore"' in r]
    assert len(extra) == 1 and str(extra[0].specifier) == "==0.35.0", extra

    # A fresh venv that borrows this one's third-party packages (a .pth line adds the directory but runs none of
    # its own .pth files, so this checkout's editable install does not come along) and gets tickloom only from
    # the wheel.
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    (site,) = env.glob("lib/python*/site-packages")
    borrowed = [p for p in sys.path if p.endswith("site-packages")]
    (site / "borrowed.pth").write_text("\n".join(borrowed) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "--no-deps",
                    "--no-index", "-q", str(wheel)], check=True, capture_output=True)

    app = tmp_path / "app"
    (app / "engine").mkdir(parents=True)
    (app / "engine" / "__init__.py").write_text("WHOSE = 'the app'\n")
    (app / "events.py").write_text("Command = 'the app'\n")
    (app / "tools.py").write_text("def helper() -> str:\n    return 'the app'\n")
    (app / "main.py").write_text(textwrap.dedent("""
        import trio

        import engine
        import events
        import tools
        import tickloom
        from tickloom import Engine, EngineConfig, SamplingParams
        from tickloom.events import LogReader

        async def main() -> None:
            async with Engine.open(EngineConfig(model="stub", log_path="app.tlog")) as eng:
                out = await eng.complete("hello", SamplingParams(max_tokens=5, seed=1))
            print(out.finish_reason, len(out.token_ids))

        trio.run(main)
        print(engine.WHOSE, events.Command, tools.helper(), LogReader.__module__, tickloom.__file__)
    """))
    run = subprocess.run([str(env / "bin" / "python"), "main.py"], cwd=app, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr
    finished, apps = run.stdout.splitlines()
    assert finished == "length 5"
    *whose, reader_module, tickloom_file = apps.split(" ")
    assert " ".join(whose) == "the app the app the app"
    assert reader_module.startswith("tickloom.events")
    assert tickloom_file.startswith(str(site)), "tickloom came from the wheel, not from this checkout"
    replay = subprocess.run([str(env / "bin" / "tickloom"), "replay", "app.tlog"], cwd=app, capture_output=True,
                            text=True, env={"PATH": "/usr/bin:/bin"})
    assert replay.returncode == 0 and "identical" in replay.stdout, replay.stdout + replay.stderr
