"""``tickloom bench NAME``: run one benchmark.

Each benchmark is a module listed in ``BENCHES`` with ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``
(see ``tools.cli``). Keep its heavy imports inside ``run``: the parser imports every listed module.
"""

from __future__ import annotations

import argparse
import importlib
from typing import cast

from tools.cli import Subcommand

NAME = "bench"
HELP = "run a benchmark and print its figures"

BENCHES: dict[str, str] = {
    "core": "tools.bench_core",
    "log": "tools.bench_log",
    "replay": "tools.bench_replay",
}
"""Benchmark name -> module. Add ``core``, ``model``, ``engine`` and ``replay`` here as they land."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, module_name in BENCHES.items():
        module = cast(Subcommand, importlib.import_module(module_name))
        sp = sub.add_parser(name, help=module.HELP, description=module.HELP)
        sp.add_argument("--json", action="store_true", help="print one JSON object per line")
        module.add_arguments(sp)
        sp.set_defaults(_bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args))
