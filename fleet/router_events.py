"""The router's vocabulary: its configuration, its inputs, its decisions and its log records.

Like ``events``, every Struct is frozen, ``array_like`` (field order is the wire layout: append new fields at the end,
with a default) and tagged with a pinned tag. The router's log reuses the engine log's ``LogHeader`` (its own
``magic``, ``ROUTER_MAGIC``, and its own schema hash) and ``SnapshotRecord``; only its tick record is its own.
"""

from __future__ import annotations

from importlib import resources
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from tickloom.events import LogHeader, Record, SnapshotRecord
from tickloom.events.codec import schema_hash

Policy = Literal["affinity", "round-robin", "least-loaded"]
POLICIES: tuple[Policy, ...] = ("affinity", "round-robin", "least-loaded")

MAX_REPLICAS = 1024
ROUTER_MAGIC = "tickloom-router-log"
"""``LogHeader.magic`` of a router log (an engine log's is ``tickloom-log``)."""

Count = Annotated[int, Meta(ge=0, le=2**40)]
Replica = Annotated[int, Meta(ge=0, lt=MAX_REPLICAS)]


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the router decides. Checked by ``msgspec.convert`` (``RouterConfig.checked``); logged in the header."""

    replicas: Annotated[int, Meta(ge=1, le=MAX_REPLICAS)]
    policy: Policy = "affinity"
    block_size: Annotated[int, Meta(ge=1, le=1 << 16)] = 16
    """The replicas' KV block size: a prompt's affinity key is the core's hash chain over its full blocks."""
    affinity_blocks: Annotated[int, Meta(ge=1, le=4096)] = 64
    """Hash at most this many leading full blocks of a prompt."""
    cache_blocks: Annotated[int, Meta(ge=1, le=1 << 22)] = 4096
    """Block hashes remembered per replica (least recently routed forgotten first): about its prefix cache."""
    load_slack: Annotated[int, Meta(ge=0, le=1 << 20)] = 4
    """Affinity keeps a request on the replica holding its prefix while that replica's load is at most this much
    above the least loaded live replica's; past that, load wins."""

    @staticmethod
    def checked(data: object) -> RouterConfig:
        """``data`` (a dict, JSON bytes or a ``RouterConfig``) validated; ``ValueError`` names the bad field."""
        try:
            if isinstance(data, bytes | str):
                return msgspec.json.decode(data, type=RouterConfig)
            if isinstance(data, RouterConfig):
                data = msgspec.structs.asdict(data)
            return msgspec.convert(data, RouterConfig)
        except msgspec.ValidationError as exc:
            raise ValueError(f"RouterConfig: {exc}") from None
        except msgspec.DecodeError as exc:
            raise ValueError(f"RouterConfig: not JSON: {exc}") from None


# -- inputs ---------------------------------------------------------------------------------------------------
class Arrival(Record, frozen=True, tag="arrival"):
    """A request to route: its prompt's block hashes (``engine.core.blocks.chain_hashes`` with its cache salt,
    at most ``affinity_blocks``) and its prompt's length."""

    request_id: str
    block_hashes: list[bytes]
    prompt_tokens: int


class LoadReport(Record, frozen=True, tag="load"):
    """A replica's reported load: its core's queue depths and free KV blocks."""

    replica: int
    waiting: int
    running: int
    free_blocks: int


class Finished(Record, frozen=True, tag="finished"):
    """A routed request ended (its stream's last frame reached the front end)."""

    request_id: str


class ReplicaDown(Record, frozen=True, tag="down"):
    """A replica died: stop routing to it; its open requests are lost."""

    replica: int
    reason: str


class ReplicaUp(Record, frozen=True, tag="up"):
    """A replica (re)joined: ``incarnation`` counts its starts (0 first)."""

    replica: int
    incarnation: int


RouterInput = Arrival | LoadReport | Finished | ReplicaDown | ReplicaUp


# -- decisions ------------------------------------------------------------------------------------------------
Reason = Literal["affinity", "load", "round-robin"]


class Route(Record, frozen=True, tag="route"):
    """Send ``request_id`` to ``replica``. ``matched_blocks``: leading prompt blocks the router believes that
    replica caches; ``reason``: what decided (the prefix, the load, or the turn)."""

    request_id: str
    replica: int
    matched_blocks: int
    reason: Reason


class Refuse(Record, frozen=True, tag="refuse"):
    """No replica can take ``request_id`` (none is live)."""

    request_id: str
    reason: str


class Lost(Record, frozen=True, tag="lost"):
    """``replica`` went down with these requests open on it: they fail."""

    replica: int
    request_ids: list[str]


RouterCommand = Route | Refuse | Lost


class RouterGauges(Record, frozen=True):
    """Counters logged with every tick and folded into the digest."""

    live: int
    open: int


# -- the log records ------------------------------------------------------------------------------------------
class RouterTickInputs(Record, frozen=True):
    tick: int
    now_ns: int
    inputs: list[RouterInput]


class RouterTickOutputs(Record, frozen=True):
    tick: int
    commands: list[RouterCommand]
    gauges: RouterGauges
    digest: bytes


class RouterTickRecord(Record, frozen=True, tag="router-tick"):
    """The payload of one tick frame of a router log."""

    inputs: RouterTickInputs
    outputs: RouterTickOutputs


RouterFrame = LogHeader | RouterTickRecord | SnapshotRecord


def compute_router_schema_hash() -> str:
    """Hash of the router log's wire schema (field order, types, defaults, tags; not docs)."""
    return schema_hash([RouterFrame, RouterConfig])


ROUTER_SCHEMA_HASH = compute_router_schema_hash()


def known_router_schemas() -> tuple[str, ...]:
    """Router schema hashes this build reads, from the append-only ``known_router_schemas.txt``."""
    text = resources.files(__package__).joinpath("known_router_schemas.txt").read_text(encoding="utf-8")
    lines = (line.split("#", 1)[0].split() for line in text.splitlines())
    return tuple(parts[0] for parts in lines if parts)
