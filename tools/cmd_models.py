"""``tickloom models``: the models ``--model`` accepts by name, and whether each is installed."""

from __future__ import annotations

import argparse
import json

NAME = "models"
HELP = "list the models available by name (a checkpoint directory or .gguf path works too)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object per model")


def run(args: argparse.Namespace) -> int:
    from engine.model import available_models

    rows: list[dict[str, str | bool]] = [
        {"name": m.name, "available": m.available, "description": m.description, "source": m.source}
        for m in available_models()
    ]
    rows.append({"name": "stub", "available": True, "source": "built in",
                 "description": "the core's token oracle with a printable-ASCII tokenizer (tests, benchmarks)"})
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    width = max(len(str(r["name"])) for r in rows)
    for r in rows:
        mark = "yes" if r["available"] else "no "
        print(f"{r['name']:<{width}}  available: {mark}  {r['description']}")
        print(f"{'':<{width}}  source: {r['source']}")
    print("Any Llama/Qwen2-style checkpoint directory (config.json + safetensors) or .gguf file also works as --model.")
    return 0
