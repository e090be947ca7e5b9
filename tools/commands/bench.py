"""``tickloom bench NAME``: run one benchmark.

Each benchmark is a module listed in ``BENCHES`` with ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``
(see ``tools.cli``). Keep its heavy imports inside ``run``: the parser imports every listed module.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import sys
from collections.abc import Callable
from typing import Any, cast

from tickloom.tools.cli import ArgumentParser, Subcommand
from tickloom.tools.progress import add_quiet_argument

NAME = "bench"
HELP = "run a benchmark and print its figures"

BENCHES: dict[str, str] = {
    "core": "tickloom.tools.bench.core",
    "log": "tickloom.tools.bench.log",
    "replay": "tickloom.tools.bench.replay",
    "engine": "tickloom.tools.bench.engine",
    "serve": "tickloom.tools.bench.serve",
    "fleet": "tickloom.tools.bench.fleet",
    "calibrate": "tickloom.tools.bench.calibrate",
    "structured": "tickloom.tools.bench.structured",
    "speculative": "tickloom.tools.bench.speculative",
}
"""Benchmark name -> module (imported when the parser is built). ``model`` is in ``ROW_BENCHES``."""


ROW_BENCHES: dict[str, tuple[str, str]] = {
    "model": (
        "tickloom.tools.bench.model",
        "the model runner's prefill and decode throughput against transformers generate",
    ),
}
"""Benchmarks imported only when chosen (their modules import torch at the top, and the parser must stay fast),
whose ``run(args)`` returns its rows (a list of dicts) and prints text itself: name -> (module, help). With
``--json`` their text goes to stderr and each row is printed as one JSON line."""


class _BenchParser(ArgumentParser):
    """A bench's parser; for a ``ROW_BENCHES`` entry, its arguments are added when it is about to parse."""

    load: Callable[[_BenchParser], None] | None = None

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self.load is not None:
            load, self.load = self.load, None
            load(self)
        return super().parse_known_args(args, namespace)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True, parser_class=_BenchParser)
    for name, module_name in BENCHES.items():
        module = cast(Subcommand, importlib.import_module(module_name))
        sp = sub.add_parser(name, help=module.HELP, description=module.HELP)
        sp.add_argument("--json", action="store_true", help="print one JSON object per line")
        add_quiet_argument(sp)
        module.add_arguments(sp)
        sp.set_defaults(_bench_run=module.run)
    for name, (module_name, help_text) in ROW_BENCHES.items():
        lazy = sub.add_parser(name, help=help_text, description=help_text)
        lazy.add_argument("--json", action="store_true", help="print one JSON object per line")
        add_quiet_argument(lazy)
        lazy.load = functools.partial(_load_rows_bench, module_name)


def _load_rows_bench(module_name: str, parser: argparse.ArgumentParser) -> None:
    module = importlib.import_module(module_name)
    module.add_arguments(parser)
    parser.set_defaults(_bench_run=functools.partial(_run_rows, module.run))


def _run_rows(bench_run: Callable[[argparse.Namespace], list[dict[str, Any]]], args: argparse.Namespace) -> int:
    if not args.json:
        bench_run(args)
        return 0
    with contextlib.redirect_stdout(sys.stderr):
        rows = bench_run(args)
    for row in rows:
        print(json.dumps(row), flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    from tickloom.tools.progress import Progress

    with Progress(f"tickloom bench {args.bench}", quiet=args.quiet):
        return int(args._bench_run(args))
