"""The ``tickloom`` command line.

One module per subcommand, in ``tools/commands/`` (a module whose name starts with ``_`` is a helper of those).
Adding a subcommand is adding its module there; each provides::

    NAME: str                                   # the subcommand's name
    HELP: str                                   # one line for ``tickloom --help``
    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...   # the exit status

Keep heavy imports (torch, the engine) inside ``run``, so ``tickloom --help`` stays fast. A subcommand reports a
user error (a bad path, a bad option combination) by raising ``CliError``; usage errors exit with ``EX_USAGE``.
Anything else propagates with its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, Protocol, cast

EX_USAGE = 64
"""Exit status of a usage error (sysexits.h)."""

EX_DATAERR = 65
"""Exit status of bad input data, e.g. a corrupt log (sysexits.h)."""

EX_SOFTWARE = 70
"""Exit status of a failure inside tickloom, e.g. the engine failing under ``serve`` (sysexits.h)."""


def plural(count: int, noun: str) -> str:
    """``1 request``, ``2 requests``, ``0 requests``: a count and its noun (made plural with an ``s``)."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def package_version() -> str:
    """tickloom's version: the installed distribution's, else (a source checkout on ``sys.path``, never installed)
    the one pyproject.toml declares, else ``unknown``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tickloom")
    except PackageNotFoundError:
        pass
    import re
    from pathlib import Path

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(encoding="utf-8"), re.MULTILINE)
    except OSError:
        found = None
    return found.group(1) if found else "unknown"


def subcommand_modules() -> list[str]:
    """The modules of ``tools/commands/`` that each add one subcommand, in ``--help`` order (by name)."""
    from tickloom.tools import commands

    return [f"{commands.__name__}.{info.name}" for info in sorted(pkgutil.iter_modules(commands.__path__),
                                                                  key=lambda info: info.name)
            if not info.name.startswith("_")]


class CliError(Exception):
    """A user-facing error: printed as ``tickloom: error: ...`` without a traceback; exits with ``status``."""

    def __init__(self, message: str, status: int = EX_USAGE) -> None:
        super().__init__(message)
        self.status = status


class Subcommand(Protocol):
    NAME: str
    HELP: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but usage errors exit with ``EX_USAGE`` (64) instead of 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EX_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="tickloom",
        description="tickloom: an LLM inference engine core whose every tick is logged and replayable.",
    )
    parser.add_argument("--version", action="version", version=f"tickloom {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in subcommand_modules():
        module = cast(Subcommand, importlib.import_module(module_name))
        sp = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(sp)
        sp.set_defaults(_run=module.run)
    return parser


class _StderrLines(logging.Handler):
    """Progress lines (model loading, a first run's GGUF conversion) on whatever ``sys.stderr`` is at the time.

    A line ending in "…" starts long work (converting, hashing, loading); on a terminal it shows as a spinner with
    the time elapsed until the next line (or the command's end), then stays as the plain line it is elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self._working: tuple[str, Any] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.finish_work()
        line = self.format(record)
        from tickloom.tools.progress import Progress

        bar = Progress(line)
        if line.endswith("…") and bar.shown:
            self._working = (line, bar.__enter__())
            return
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def finish_work(self) -> None:
        """Stop the spinner of the work under way, if any, leaving its line."""
        if self._working is not None:
            line, bar = self._working
            self._working = None
            bar.__exit__(None, None, None)
            sys.stderr.write(line + "\n")
            sys.stderr.flush()


def show_model_progress() -> None:
    """Show the ``engine.model`` logger's INFO lines on stderr (once per process)."""
    logger = logging.getLogger("tickloom.engine.model")
    if not any(isinstance(h, _StderrLines) for h in logger.handlers):
        handler = _StderrLines()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _finish_model_progress() -> None:
    for handler in logging.getLogger("tickloom.engine.model").handlers:
        if isinstance(handler, _StderrLines):
            handler.finish_work()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "quiet", False):
        show_model_progress()
    try:
        status = args._run(args)
    except CliError as exc:
        _finish_model_progress()
        print(f"tickloom: error: {exc}", file=sys.stderr)
        return exc.status
    except BrokenPipeError:
        _finish_model_progress()
        # The reader went away (`tickloom inspect LOG | head`): not an error of ours. Point stdout at devnull so
        # the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    finally:
        _finish_model_progress()
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
