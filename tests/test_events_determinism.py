"""Encoding is a pure function of the value: the same bytes in every process, whatever PYTHONHASHSEED is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import hashlib, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from fixtures.make_fixture import HEADER, fixture_snapshot, fixture_ticks
from tickloom.events import SCHEMA_HASH, encode, encode_commands, encode_tick, chain_digest, GENESIS_DIGEST
h = hashlib.sha256()
h.update(SCHEMA_HASH.encode())
h.update(encode(HEADER))
h.update(encode(fixture_snapshot()))
for t in fixture_ticks():
    h.update(encode(t))
    h.update(encode_tick(t.inputs, t.outputs))
    h.update(encode_commands(t.outputs.commands))
    h.update(t.outputs.digest)
print(h.hexdigest())
"""


def _digest_with_hashseed(seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(REPO), str(REPO / "tests")],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def test_encoding_is_identical_across_hash_seeds() -> None:
    digests = {_digest_with_hashseed(seed) for seed in ("0", "1", "4242")}
    assert len(digests) == 1
