"""Progress for the long commands (``explore``, ``replay --full``, the benches): a ``rich`` bar on stderr, shown only
when both stdout and stderr are terminals and ``--quiet`` is not given, so pipes, logs and tests see none of it.

``rich`` is imported only when a bar is shown, so ``tickloom --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from types import TracebackType
from typing import Any


def add_quiet_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="no progress on stderr (there is none anyway when stdout or stderr is not a terminal)")


def progress_wanted(quiet: bool) -> bool:
    """A bar is shown: not ``--quiet``, and both stdout and stderr are terminals."""
    return not quiet and sys.stdout.isatty() and sys.stderr.isatty()


_active: list[Progress] = []
"""The bars shown now, innermost last: ``progress_note`` writes on the innermost."""


def progress_note(text: str) -> None:
    """Say what the innermost bar shown is doing now (a bench's phase); nothing when no bar is shown."""
    if _active:
        _active[-1].advance(0, description=f"{_active[-1].description}: {text}")


class Progress:
    """``with Progress("seeds", total=n, quiet=args.quiet) as bar: ... bar.advance()``: a transient bar on stderr
    (it disappears when done, leaving the command's own output), or nothing at all when not wanted."""

    def __init__(self, description: str, total: int | None = None, *, unit: str | None = None,
                 quiet: bool = False) -> None:
        """``total`` None: a spinner, the count so far in ``unit`` (if given) and the time elapsed."""
        self.description = description
        self.total = total
        self.unit = unit
        self.shown = progress_wanted(quiet)
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.shown:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
            if self.total is not None:
                columns += [BarColumn(), MofNCompleteColumn()]
            elif self.unit is not None:
                columns.append(TextColumn(f"{{task.completed}} {self.unit}"))
            columns.append(TimeElapsedColumn())
            self._bar = RichProgress(*columns, console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total)
            _active.append(self)
        return self

    def advance(self, steps: int = 1, description: str | None = None) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=steps,
                             **({} if description is None else {"description": description}))

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
            _active.remove(self)
