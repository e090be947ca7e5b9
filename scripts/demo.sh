#!/usr/bin/env bash
# Set up the venv, then show what tickloom does today. Later issues make this run the real engine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
cd "$ROOT"

tickloom --help
echo
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
tickloom log demo "$tmp/demo.tlog"
echo
tickloom log info "$tmp/demo.tlog"
