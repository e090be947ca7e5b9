"""Rooms that match the floors, checked on the source (AST) and in a fresh interpreter.

``engine/`` holds two floors. The API floor (``API_FLOOR``) validates input, wires the actors and hosts the
engine; below it lie the core, the model and the API's two leaf modules, ``engine.outputs`` (the frames a stream
yields) and ``engine.errors``, which the actors use. So:

- no module of ``actors/`` imports the API floor, directly or through any module it imports;
- the API's leaves import nothing of the engine above them;
- no production module imports a test double (anything under ``tests/``);
- in the rooms the engine's API and actors share (``engine/``, ``actors/``), no two classes have one name.

``engine/__init__.py`` runs whenever ``engine.core`` or ``engine.model`` is imported, as their parent package; it
imports nothing at run time (its names load lazily), which is checked here too, so that reaches no API code.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCTION = ("engine", "events", "actors", "replay", "tools")
API_FLOOR = frozenset({"tickloom.engine.api", "tickloom.engine.asyncio", "tickloom.engine.config",
                       "tickloom.engine.params", "tickloom.engine.runtime"})
LEAVES = ("tickloom.engine.outputs", "tickloom.engine.errors")
TEST_DOUBLES = frozenset(p.stem for p in (ROOT / "tests").glob("*.py")) | {"tests", "conftest"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("tickloom", *parts[:-1])) if parts[-1] == "__init__" else ".".join(("tickloom", *parts))


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for room in PRODUCTION for p in (ROOT / room).rglob("*.py")}


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path) -> Iterator[tuple[str, list[str]]]:
    """(module, names) of every import statement that runs (anywhere but under ``if TYPE_CHECKING:``)."""

    def walk(node: ast.AST) -> Iterator[tuple[str, list[str]]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                yield from (item for stmt in child.orelse for item in walk(ast.Module([stmt], [])))
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, []
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module is not None:
                yield child.module, [alias.name for alias in child.names]
            yield from walk(child)

    return walk(ast.parse(path.read_text(), str(path)))


def _reached(modules: dict[str, Path], name: str) -> list[str]:
    """The tickloom modules an import of ``name`` (``from name import ...`` counted by the caller) loads."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in modules]


def _closure(modules: dict[str, Path], start: str) -> dict[str, str]:
    """Every tickloom module importing ``start`` loads, each with the module that imports it."""
    seen: dict[str, str] = {start: ""}
    todo = [start]
    while todo:
        current = todo.pop()
        for module, names in _imports(modules[current]):
            targets = _reached(modules, module)
            targets += [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            for target in targets:
                if target not in seen:
                    seen[target] = current
                    todo.append(target)
    return seen


def _chain(seen: dict[str, str], end: str) -> str:
    chain = [end]
    while seen[chain[-1]]:
        chain.append(seen[chain[-1]])
    return " <- ".join(chain)


def test_no_actor_module_reaches_the_api_floor() -> None:
    modules = _modules()
    actors = [m for m in modules if m.startswith("tickloom.actors.")]
    assert "tickloom.actors.retire" in actors and "tickloom.actors.streams" in actors
    for actor in actors:
        for module, names in _imports(modules[actor]):
            assert not (module == "tickloom.engine" and names), f"{actor} imports the API's names: {names}"
        seen = _closure(modules, actor)
        reached = sorted(API_FLOOR & set(seen))
        assert not reached, f"{actor} reaches the API floor: {_chain(seen, reached[0])}"


def test_the_engine_package_and_the_api_leaves_import_nothing_above_them() -> None:
    modules = _modules()
    init = [m for m, _ in _imports(modules["tickloom.engine"]) if m.startswith("tickloom")]
    assert init == [], f"engine/__init__.py imports {init} at run time: every engine.core import would run them"
    for leaf in LEAVES:
        direct = {m for m, _ in _imports(modules[leaf]) if m.startswith("tickloom")}
        assert direct <= {"tickloom.engine.core.errors"}, f"{leaf} imports {sorted(direct)}"
        assert not API_FLOOR & set(_closure(modules, leaf))


def test_importing_every_actor_loads_no_api_module() -> None:
    """The same, as the interpreter sees it: a fresh process imports every actor and then looks at sys.modules."""
    actors = sorted(m for m in _modules() if m.startswith("tickloom.actors."))
    code = ("import importlib, sys\n"
            f"for name in {actors!r}:\n    importlib.import_module(name)\n"
            f"print(sorted(set({sorted(API_FLOOR)!r}) & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_production_module_imports_a_test_double() -> None:
    assert {"scenarios", "core_harness", "engine_helpers", "model_fixtures"} <= TEST_DOUBLES
    for name, path in _modules().items():
        for module, _ in _imports(path):
            top = module.split(".")[0]
            assert top not in TEST_DOUBLES and not module.startswith("tickloom.tests"), (
                f"{name} imports {module}, which lives under tests/")


def test_each_class_name_in_the_engine_and_the_actors_means_one_thing() -> None:
    where: dict[str, list[str]] = {}
    for name, path in _modules().items():
        if name.startswith(("tickloom.engine", "tickloom.actors")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    where.setdefault(node.name, []).append(name)
    assert {"Engine", "AsyncEngine", "RequestStream", "AsyncRequestStream", "ClientStream"} <= set(where)
    twice = {n: ms for n, ms in where.items() if len(ms) > 1}
    assert not twice, twice


def test_the_public_names_stay() -> None:
    import tickloom
    import tickloom.asyncio
    from tickloom.engine import asyncio as engine_asyncio

    assert tickloom.Engine.__name__ == "Engine" and tickloom.RequestStream.__name__ == "RequestStream"
    assert tickloom.asyncio.Engine is engine_asyncio.AsyncEngine
    assert tickloom.RequestOutput.__module__ == "tickloom.engine.outputs"
