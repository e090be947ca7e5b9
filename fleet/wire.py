"""What crosses Ray between the front end and a replica: msgspec Structs as msgpack bytes, never pickled objects.

Ray ships its own control messages (and, once, the actor class) inside the cluster; every tickloom value travels as
bytes encoded here and is decoded with its type on the other side, so a malformed message is an error that names
the field, never an arbitrary object.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from tickloom import RequestOutput
from tickloom.request import Request


class ReplicaInfo(msgspec.Struct, frozen=True):
    """A replica's answer to ``start``: which replica, which start of it, where its log is."""

    index: int
    incarnation: int
    pid: int
    node: str
    log_path: str
    block_size: int
    num_blocks: int


class Load(msgspec.Struct, frozen=True):
    incarnation: int
    waiting: int
    running: int
    free_blocks: int


class Submit(msgspec.Struct, frozen=True):
    """One request for a replica's engine (``generate_request``): its prompt token ids, its id given."""

    request: Request
    incarnation: int
    """The incarnation the router chose: a replica that restarted since refuses the request (``Submitted.stale``)."""


class Submitted(msgspec.Struct, frozen=True):
    incarnation: int
    stale: bool = False
    rejected: str | None = None
    """The engine refused the request at submit (``RequestRejected``): the message."""
    overloaded: str | None = None


class Pulled(msgspec.Struct, frozen=True):
    """Up to ``max_frames`` frames of one request. ``unknown``: this incarnation never had the request (the replica
    restarted); ``error``: the engine's stream raised."""

    incarnation: int
    frames: list[RequestOutput] = []
    unknown: bool = False
    error: str | None = None


T = TypeVar("T")
_encoder = msgspec.msgpack.Encoder()


def encode(value: msgspec.Struct) -> bytes:
    return _encoder.encode(value)


def decode(data: bytes, kind: type[T]) -> T:
    return msgspec.msgpack.decode(data, type=kind)
