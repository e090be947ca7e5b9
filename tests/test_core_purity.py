"""engine/core is a pure state machine: no concurrency, clocks, randomness or I/O, and no ``hash()``."""

from __future__ import annotations

import ast

from purity import REPO, assert_package_pure

CORE = REPO / "engine" / "core"
CORE_BANNED = {
    "trio", "torch", "time", "random", "threading", "asyncio", "multiprocessing", "concurrent", "os", "io",
    "socket", "pathlib", "subprocess", "shutil", "tempfile", "mmap", "sys", "datetime", "uuid", "secrets",
    "numpy", "cupy", "tickloom.engine.model", "tickloom.actors", "tickloom.replay", "tickloom.tools",
}
IMPURE_CALLS = {"open", "print", "input", "hash", "id", "exec", "eval", "breakpoint"}


def test_core_imports_nothing_impure() -> None:
    assert_package_pure(CORE, CORE_BANNED)


def test_core_calls_no_impure_builtins() -> None:
    found = []
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in IMPURE_CALLS:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.func.id}()")
    assert found == [], "engine/core must not do I/O or depend on hash()/id() values:\n" + "\n".join(found)
