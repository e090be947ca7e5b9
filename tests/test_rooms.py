"""Every production folder is one room on one floor, and imports only from the floors below it.

The floors, from the bottom (ARCHITECTURE.md draws the same table):

    events        the typed events, the log and its reader              imports no other room
    engine/core   the pure scheduler                                    events
    engine/model  the device side                                       events
    engine        outputs.py, errors.py: leaves the actors share        events, engine/core
    replay        exact replay, verify, bisect, the simulator, what-if  events, engine/*
    actors        the trio actors                                       events, engine/*
    api           tickloom/*.py: Engine, AsyncEngine, the runtime,      events, engine/*, actors, replay
                  configuration, validation, prompts
    fleet         replicas and the router                               every room below it
    tools         the command line, benchmarks, the server, explorer    every room below it

A module's room is read from its name, its imports from its source (every import statement that runs, inside
functions too, but not those under ``if TYPE_CHECKING:``). ``tickloom/__main__.py`` is the command's entry point
and sits with ``tools``. Two more rules: no two modules import each other, directly or round a circle, and no
production module imports a test double.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("engine", "events", "actors", "replay", "tools", "fleet")
MAY_IMPORT: dict[str, frozenset[str]] = {
    "events": frozenset(),
    "engine/core": frozenset({"events"}),
    "engine/model": frozenset({"events"}),
    "engine": frozenset({"events", "engine/core"}),
    "replay": frozenset({"events", "engine/core", "engine/model", "engine"}),
    "actors": frozenset({"events", "engine/core", "engine/model", "engine"}),
    "api": frozenset({"events", "engine/core", "engine/model", "engine", "actors", "replay"}),
    "fleet": frozenset({"events", "engine/core", "engine/model", "engine", "actors", "replay", "api"}),
    "tools": frozenset({"events", "engine/core", "engine/model", "engine", "actors", "replay", "api", "fleet"}),
}
TEST_DOUBLES = frozenset(p.stem for p in (ROOT / "tests").glob("*.py")) | {"tests", "conftest"}


def room_of(module: str) -> str | None:
    """The room of a ``tickloom`` module (None for the package itself, whose export table loads lazily)."""
    parts = module.split(".")
    if parts[0] != "tickloom" or len(parts) == 1:
        return None
    if parts[1] == "__main__":
        return "tools"
    if parts[1] == "engine" and len(parts) > 2 and parts[2] in ("core", "model"):
        return f"engine/{parts[2]}"
    return parts[1] if parts[1] in FOLDERS else "api"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "tickloom":
        parts = parts[1:]
    return ".".join(("tickloom", *parts[:-1])) if parts[-1] == "__init__" else ".".join(("tickloom", *parts))


def _modules() -> dict[str, Path]:
    files = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")]
    files += [p for p in (ROOT / "tickloom").glob("*.py")]  # the API floor (the links are the folders above)
    return {_module_name(p): p for p in files}


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


def _targets(modules: dict[str, Path], importer: str) -> set[str]:
    """The tickloom modules ``importer`` imports by name (``from a.b import c`` names ``a.b``, and ``a.b.c`` if
    that is a module). A package an import passes through on its way down is not counted: its ``__init__`` runs,
    but it is the submodule that is used."""
    found: set[str] = set()
    for module, names in _imports(modules[importer]):
        if module in modules:
            found.add(module)
        found.update(f"{module}.{n}" for n in names if f"{module}.{n}" in modules)
    return {t for t in found if t != importer and not importer.startswith(t + ".")}


def test_every_module_has_a_room_and_every_room_has_modules() -> None:
    modules = _modules()
    rooms = {room_of(m) for m in modules} - {None}
    assert rooms == set(MAY_IMPORT), rooms ^ set(MAY_IMPORT)
    assert room_of("tickloom.api") == "api" and room_of("tickloom.engine.outputs") == "engine"
    assert room_of("tickloom.engine.core.tick_end") == "engine/core" and room_of("tickloom.fleet.front") == "fleet"


def test_each_room_imports_only_the_rooms_below_it() -> None:
    modules = _modules()
    wrong = []
    for importer in sorted(modules):
        mine = room_of(importer)
        assert mine is not None or importer == "tickloom", importer
        for target in sorted(_targets(modules, importer)):
            theirs = room_of(target)
            if mine is not None and theirs is not None and theirs != mine and theirs not in MAY_IMPORT[mine]:
                wrong.append(f"{importer} ({mine}) imports {target} ({theirs})")
    assert wrong == [], "\n".join(wrong)


def test_the_floor_rule_is_a_strict_order() -> None:
    """No two rooms may import each other, so the floors can be drawn one above the other."""
    for room, below in MAY_IMPORT.items():
        assert room not in below
        for other in below:
            assert room not in MAY_IMPORT[other], (room, other)
            assert MAY_IMPORT[other] <= below, f"{room} may import {other} but not all that {other} may"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_between_modules() -> None:
    modules = _modules()
    graph = {m: _targets(modules, m) & set(modules) for m in modules}
    assert _circles(graph) == []


def test_the_package_roots_below_the_api_import_nothing_at_run_time() -> None:
    """``engine/__init__.py`` runs whenever ``engine.core`` is imported; the one export table is the top
    package's, and it loads lazily, so ``import tickloom.engine.core`` reaches no API code."""
    modules = _modules()
    for package in ("tickloom.engine", "tickloom.engine.model", "tickloom.actors"):
        assert not [m for m, _ in _imports(modules[package]) if m.startswith("tickloom")], package
    top = [m for m, _ in _imports(ROOT / "tickloom" / "__init__.py") if m.startswith("tickloom")]
    assert top == [], top


def test_importing_every_actor_loads_no_api_module() -> None:
    """The floor rule as the interpreter sees it: a fresh process imports every actor, then looks at sys.modules."""
    modules = _modules()
    actors = sorted(m for m in modules if room_of(m) == "actors")
    api = sorted(m for m in modules if room_of(m) == "api")
    assert "tickloom.actors.retire" in actors and "tickloom.runtime" in api
    code = ("import importlib, sys\n"
            f"for name in {actors!r}:\n    importlib.import_module(name)\n"
            f"print(sorted(set({api!r}) & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_production_module_imports_a_test_double() -> None:
    assert {"scenarios", "core_harness", "engine_helpers", "model_fixtures"} <= TEST_DOUBLES
    for name, path in _modules().items():
        for module, _ in _imports(path):
            top = module.split(".")[0]
            assert top not in TEST_DOUBLES and not module.startswith("tickloom.tests"), (
                f"{name} imports {module}, which lives under tests/")


def test_each_class_name_below_the_tools_means_one_thing() -> None:
    where: dict[str, list[str]] = {}
    for name, path in _modules().items():
        if room_of(name) in ("engine", "engine/core", "engine/model", "actors", "api"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    where.setdefault(node.name, []).append(name)
    assert {"Engine", "AsyncEngine", "RequestStream", "AsyncRequestStream", "ClientStream"} <= set(where)
    twice = {n: ms for n, ms in where.items() if len(ms) > 1}
    assert not twice, twice


def test_the_public_names_stay() -> None:
    import tickloom
    import tickloom.asyncio
    from tickloom import asyncio as engine_asyncio

    assert tickloom.Engine.__name__ == "Engine" and tickloom.RequestStream.__name__ == "RequestStream"
    assert tickloom.asyncio.Engine is engine_asyncio.AsyncEngine
    assert tickloom.RequestOutput.__module__ == "tickloom.engine.outputs"
