#!/usr/bin/env bash
# Set up the venv, then run the engine on the default model (SmolLM2-135M-Instruct, CPU): three prompts stream at
# once, every tick goes to demo.tlog, and replaying that log on the scheduler core reproduces every decision.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
cd "$ROOT"

# demo.tlog is left in the repository root for you to explore (`tickloom inspect`, `tickloom replay --help`);
# *.tlog is in .gitignore. tickloom never overwrites a log, so the demo removes its own previous demo.tlog first.
rm -f demo.tlog
tickloom generate --max-tokens 48 --temperature 0 --log demo.tlog \
    "What is the capital of France?" \
    "Write a haiku about the sea." \
    "Give me three tips for learning Python."
echo
echo "\$ tickloom replay demo.tlog"
tickloom replay demo.tlog
