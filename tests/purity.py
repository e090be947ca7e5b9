"""Check that a package imports none of a list of banned modules, by parsing its source with ``ast``.

Reusable for any package: ``assert_package_pure(Path("engine/core"), {"trio", "torch", ...})``. It finds
``import x``, ``from x import y`` (at any depth, inside functions too), ``importlib.import_module("x")`` and
``__import__("x")`` with a literal name. A banned name matches itself and its submodules (``torch`` bans
``torch.nn``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def imports_of(source: str, filename: str = "<source>") -> Iterator[tuple[int, str]]:
    """(line, absolute module name) for every import in ``source``; relative imports are skipped (they stay
    inside the package)."""
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                yield node.lineno, node.module
        elif isinstance(node, ast.Call):
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else None
            )
            if (
                name in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                yield node.lineno, node.args[0].value


def banned_imports(package_dir: Path, banned: Iterable[str]) -> list[str]:
    """``"path:line: module"`` for each import of a banned module in any ``.py`` file under ``package_dir``."""
    banned = set(banned)
    found = []
    files = sorted(package_dir.rglob("*.py"))
    if not files:
        raise AssertionError(f"{package_dir} holds no Python files: wrong path?")
    for path in files:
        for line, module in imports_of(path.read_text(encoding="utf-8"), str(path)):
            parts = module.split(".")
            if any(".".join(parts[:k]) in banned for k in range(1, len(parts) + 1)):
                found.append(f"{path.relative_to(package_dir.parent)}:{line}: {module}")
    return found


def assert_package_pure(package_dir: Path, banned: Iterable[str]) -> None:
    """Fail, listing every offending import, if ``package_dir`` imports any of ``banned``."""
    found = banned_imports(package_dir, banned)
    assert not found, f"{package_dir.name} must not import {sorted(set(banned))}:\n" + "\n".join(found)
