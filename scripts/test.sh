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
# One worker per core (TICKLOOM_TEST_WORKERS overrides; 0 runs in this process). The tests are independent, and
# the fleet tests, which start a local Ray each, share one worker (conftest.py's "ray" group).
HF_HUB_OFFLINE=1 python -m pytest -q -n "${TICKLOOM_TEST_WORKERS:-auto}" --dist loadgroup --durations=15 "$@"
