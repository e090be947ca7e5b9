"""The running digest: one short hash that changes whenever any decision of any tick changes.

``digest[t] = blake2b(digest[t-1] || encoded commands of tick t || gauges of tick t)``. It is computed from the
bytes encoded for the log anyway, so it costs one hash over a few hundred bytes per tick. Replay compares digests
first and only diffs commands when they differ. ``DIGEST_VERSION`` goes in the log header, so a new digest
definition never makes an old log look divergent: replay recomputes with the version the log names.
"""

from __future__ import annotations

import hashlib
import struct

from tickloom.events.types import CoreGauges

DIGEST_VERSION = 1
DIGEST_SIZE = 16
GENESIS_DIGEST = bytes(DIGEST_SIZE)
"""The digest before tick 0."""

_gauges = struct.Struct("<6q")


def chain_digest(previous: bytes, encoded_commands: bytes, gauges: CoreGauges) -> bytes:
    """The next digest in the chain (see the module docstring)."""
    h = hashlib.blake2b(previous, digest_size=DIGEST_SIZE)
    h.update(encoded_commands)
    h.update(
        _gauges.pack(
            gauges.waiting,
            gauges.running,
            gauges.preempted,
            gauges.swapped,
            gauges.free_blocks,
            gauges.cached_blocks,
        )
    )
    return h.digest()
