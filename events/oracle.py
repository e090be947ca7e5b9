"""The oracle's token: a pure function of (request seed, output index) that stands in for a model's sampler.

Several rooms must agree on it bit for bit: the stub executor (``engine/model/stub.py``) and the stub device
(``actors/device.py``) produce it, and the simulator's ``OracleExecutor`` (``replay/oracle.py``) produces and checks
it, so that a stub engine's log replays against the oracle. ``events/`` is the one room all of them may import
(like the digest helper, it is a stable hash over the standard library), and the scheduler core never uses it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection


def oracle_token(seed: int, index: int, vocab_size: int, avoid: Collection[int] = ()) -> int:
    """The oracle's token for output ``index`` of a request with ``seed``; never one of ``avoid``."""
    raw = hashlib.blake2b(seed.to_bytes(8, "little", signed=True) + index.to_bytes(8, "little"), digest_size=8)
    token = int.from_bytes(raw.digest(), "little") % vocab_size
    while token in avoid:
        token = (token + 1) % vocab_size
    return token
