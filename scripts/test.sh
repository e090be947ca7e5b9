#!/usr/bin/env bash
# Set up the venv, then lint, type-check and run every test (slow ones included).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
cd "$ROOT"

echo "== ruff"
ruff check .
echo "== mypy"
mypy --strict -p tickloom.events -p tickloom.engine.core
echo "== pytest"
HF_HUB_OFFLINE=1 python -m pytest -q "$@"
