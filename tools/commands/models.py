"""``tickloom models``: the models ``--model`` accepts by name, and whether each is installed.

``--cache`` lists the conversion cache instead (``engine.model.registry``: one entry per GGUF content, shared by
every venv of the user); ``--cache --prune`` removes the entries no GGUF file refers to any more (modified, moved
or deleted files; older cache layouts; conversions a killed process left behind), and ``--prune --all`` empties it.
"""

from __future__ import annotations

import argparse
import json
import time

NAME = "models"
HELP = "list the models available by name (a checkpoint directory or .gguf path works too); --cache: the cache"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object per model (or cache entry)")
    parser.add_argument("--cache", action="store_true",
                        help="list the conversion cache ($TICKLOOM_CACHE, else $XDG_CACHE_HOME/tickloom, "
                             "else ~/.cache/tickloom)")
    parser.add_argument("--prune", action="store_true",
                        help="with --cache: remove the entries no model file refers to any more")
    parser.add_argument("--all", action="store_true", help="with --prune: remove every entry")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    raise AssertionError("unreachable")


def run(args: argparse.Namespace) -> int:
    from tickloom.tools.cli import CliError

    if args.prune and not args.cache:
        raise CliError("--prune needs --cache")
    if args.all and not args.prune:
        raise CliError("--all needs --prune")
    if args.cache:
        return _cache(args)
    from tickloom.engine.model.registry import available_models

    rows: list[dict[str, str | bool]] = [
        {"name": m.name, "available": m.available, "description": m.description, "source": m.source}
        for m in available_models()
    ]
    rows.append({"name": "stub", "available": True, "source": "built in",
                 "description": "the core's token oracle with a one-token-per-character tokenizer (tests, benchmarks)"})
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    width = max(len(str(r["name"])) for r in rows)
    for r in rows:
        mark = "yes" if r["available"] else "no "
        print(f"{r['name']:<{width}}  available: {mark}  {r['description']}")
        print(f"{'':<{width}}  source: {r['source']}")
    from tickloom.engine.model.registry import hf_hub_cache

    print("Any checkpoint directory (config.json + safetensors) or .gguf file also works as --model, and so does an\n"
          f"org/name in the local Hugging Face cache ({hf_hub_cache()}; read offline, nothing is downloaded).")
    return 0


def _cache(args: argparse.Namespace) -> int:
    from tickloom.engine.model.registry import CacheEntry, cache_dir, cache_entries, prune_cache, read_index

    root = cache_dir()
    if args.prune:
        def removed(entry: CacheEntry) -> None:
            if args.json:
                print(json.dumps({"removed": entry.to_json()}), flush=True)
            else:
                print(f"removed {entry.path.name} ({entry.name}, {entry.kind}, {_size(entry.size)})", flush=True)

        gone = prune_cache(everything=args.all, on_remove=removed)
        if not args.json:
            print(f"pruned {len(gone)} entries, {_size(sum(e.size for e in gone))} freed, from {root}")
        return 0
    entries = cache_entries()
    if args.json:
        for entry in entries:
            print(json.dumps(entry.to_json()))
        return 0
    remembered = len(read_index()["dirs"])
    print(f"{root}: {len(entries)} entries, {_size(sum(e.size for e in entries))}; weight fingerprints "
          f"remembered for {remembered} checkpoint directories")
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.created))
        state = "in use" if e.referenced else ("unreferenced" if e.kind == "converted" else e.kind)
        print(f"  {e.path.name}  {e.name}  {_size(e.size)}  {when}  {state}")
        for source in e.sources:
            print(f"      from {source}")
    if any(not e.referenced for e in entries):
        print("`tickloom models --cache --prune` removes the entries not in use (--all: every entry)")
    return 0
