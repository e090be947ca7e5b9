"""The router: a sans-I/O state machine that picks a replica for each request, like ``engine.core`` for one engine.

``Router.tick(RouterTickInputs) -> RouterTickOutputs`` is pure: no clock, no I/O, no randomness. Everything that
can change its mind arrives as an input (arrivals with their prompts' block hashes, load reports, finished requests,
replicas going down and coming back); everything it decides leaves as a command (``Route``, ``Refuse``, ``Lost``).
The front end logs both before any request leaves, so ``tickloom replay`` re-runs the router over a router log and
compares every decision.

The policies:

- **affinity** (default): the live replica that holds the longest cached prefix of the prompt, as the router
  remembers it (the block hashes it routed there, least recently routed forgotten first), unless that replica's
  load is more than ``load_slack`` above the least loaded live replica's; otherwise, and when no replica holds any
  of the prefix, the least loaded. Ties: the longer prefix, then the lower load, then more free KV blocks, then the
  lower index.
- **least-loaded**: the lowest load, then more free blocks, then the lower index.
- **round-robin**: the next live replica after the last one chosen.

A replica's load is what it last reported (waiting + running requests in its core) plus the requests routed to it
since that report: reports lag, and without the second term every arrival between two reports would pile onto the
same replica.
"""

from __future__ import annotations

import hashlib

import msgspec

from tickloom.events import Record
from tickloom.fleet.router_events import (
    Arrival,
    Finished,
    LoadReport,
    Lost,
    Reason,
    Refuse,
    ReplicaDown,
    ReplicaUp,
    Route,
    RouterCommand,
    RouterConfig,
    RouterGauges,
    RouterTickInputs,
    RouterTickOutputs,
)

DIGEST_SIZE = 16
GENESIS = bytes(DIGEST_SIZE)
_encoder = msgspec.msgpack.Encoder(order="deterministic")


class ReplicaSnapshot(Record, frozen=True):
    live: bool
    incarnation: int
    waiting: int
    running: int
    free_blocks: int
    routed_since_report: int
    cached: list[bytes]
    """Remembered block hashes, least recently routed first."""


class RouterSnapshot(Record, frozen=True):
    """The router's whole state after ``tick`` (the ``state`` of a router log's snapshot frame)."""

    tick: int
    now_ns: int
    digest: bytes
    config: RouterConfig
    replicas: list[ReplicaSnapshot]
    open: list[tuple[str, int]]
    """Open requests and their replicas, in routing order."""
    turn: int
    """Round-robin: the replica after the last one chosen."""


_snapshot_decoder = msgspec.msgpack.Decoder(RouterSnapshot)


def encode_router_snapshot(snapshot: RouterSnapshot) -> bytes:
    return _encoder.encode(snapshot)


def decode_router_snapshot(data: bytes) -> RouterSnapshot:
    return _snapshot_decoder.decode(data)


class RouterInvariantError(AssertionError):
    """The router's state broke one of its invariants (``Router.check_invariants``)."""


class _Replica:
    __slots__ = ("cached", "free_blocks", "incarnation", "live", "routed_since_report", "running", "waiting")

    def __init__(self) -> None:
        self.live = True
        self.incarnation = 0
        self.waiting = 0
        self.running = 0
        self.free_blocks = 0
        self.routed_since_report = 0
        self.cached: dict[bytes, None] = {}
        """Block hashes in least-recently-routed order (a dict keeps insertion order)."""

    @property
    def load(self) -> int:
        return self.waiting + self.running + self.routed_since_report

    def forget(self) -> None:
        """A replica that went down lost its KV cache and its queues."""
        self.cached.clear()
        self.waiting = self.running = self.free_blocks = self.routed_since_report = 0


class Router:
    """See the module docstring. All replicas start live, at incarnation 0."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.tick_no = -1
        self.now_ns = 0
        self.digest = GENESIS
        self.replicas = [_Replica() for _ in range(config.replicas)]
        self.open: dict[str, int] = {}
        self.turn = 0
        self.last_encoded_commands = b""

    # -- one tick -------------------------------------------------------------------------------------------------
    def tick(self, inputs: RouterTickInputs) -> RouterTickOutputs:
        """Apply ``inputs`` in order; return the decisions, the gauges and the running digest."""
        if inputs.tick != self.tick_no + 1:
            raise ValueError(f"router tick {inputs.tick} after tick {self.tick_no}")
        self.tick_no = inputs.tick
        self.now_ns = inputs.now_ns
        commands: list[RouterCommand] = []
        for item in inputs.inputs:
            if type(item) is Arrival:
                commands.append(self._arrive(item))
            elif type(item) is LoadReport:
                self._report(item)
            elif type(item) is Finished:
                self.open.pop(item.request_id, None)
            elif type(item) is ReplicaDown:
                self._down(item.replica, commands)
            elif type(item) is ReplicaUp:
                self._up(item, commands)
            else:
                raise TypeError(f"not a router input: {type(item).__name__}")
        gauges = self.gauges()
        encoded = _encoder.encode(commands)
        self.last_encoded_commands = encoded
        h = hashlib.blake2b(self.digest, digest_size=DIGEST_SIZE)
        h.update(encoded)
        h.update(_encoder.encode(gauges))
        self.digest = h.digest()
        return RouterTickOutputs(inputs.tick, commands, gauges, self.digest)

    def gauges(self) -> RouterGauges:
        return RouterGauges(sum(r.live for r in self.replicas), len(self.open))

    def _replica(self, index: int) -> _Replica | None:
        return self.replicas[index] if 0 <= index < len(self.replicas) else None

    def _arrive(self, arrival: Arrival) -> RouterCommand:
        rid = arrival.request_id
        if rid in self.open:
            return Refuse(rid, f"request id {rid!r} is already open on replica {self.open[rid]}")
        live = [i for i, r in enumerate(self.replicas) if r.live]
        if not live:
            return Refuse(rid, "no replica is live")
        hashes = arrival.block_hashes[: self.config.affinity_blocks]
        matched = {i: self._matched(self.replicas[i], hashes) for i in live}
        policy = self.config.policy
        reason: Reason
        if policy == "round-robin":
            n = len(self.replicas)
            chosen = next(i % n for i in range(self.turn, self.turn + n) if self.replicas[i % n].live)
            reason = "round-robin"
        else:
            chosen = min(live, key=self._load_key)
            reason = "load"
            if policy == "affinity":
                bound = self.replicas[chosen].load + self.config.load_slack
                holders = [i for i in live if matched[i] > 0 and self.replicas[i].load <= bound]
                if holders:
                    chosen = min(holders, key=lambda i: (-matched[i], *self._load_key(i)))
                    reason = "affinity"
        self.turn = (chosen + 1) % len(self.replicas)
        replica = self.replicas[chosen]
        replica.routed_since_report += 1
        self._remember(replica, hashes)
        self.open[rid] = chosen
        return Route(rid, chosen, matched[chosen], reason)

    def _load_key(self, index: int) -> tuple[int, int, int]:
        r = self.replicas[index]
        return r.load, -r.free_blocks, index

    @staticmethod
    def _matched(replica: _Replica, hashes: list[bytes]) -> int:
        """Leading blocks of ``hashes`` the replica is believed to cache. Each hash chains over everything before
        it, so the first miss ends the prefix."""
        n = 0
        for h in hashes:
            if h not in replica.cached:
                break
            n += 1
        return n

    def _remember(self, replica: _Replica, hashes: list[bytes]) -> None:
        cached = replica.cached
        for h in hashes:
            cached.pop(h, None)
            cached[h] = None
        excess = len(cached) - self.config.cache_blocks
        if excess > 0:
            for h in list(cached)[:excess]:
                del cached[h]

    def _report(self, report: LoadReport) -> None:
        replica = self._replica(report.replica)
        if replica is None or not replica.live:
            return  # a late report of a replica already down, or one from outside the fleet: nothing to believe
        replica.waiting, replica.running, replica.free_blocks = report.waiting, report.running, report.free_blocks
        replica.routed_since_report = 0

    def _lose_open(self, index: int, commands: list[RouterCommand]) -> None:
        lost = [rid for rid, r in self.open.items() if r == index]
        for rid in lost:
            del self.open[rid]
        if lost:
            commands.append(Lost(index, lost))

    def _down(self, index: int, commands: list[RouterCommand]) -> None:
        replica = self._replica(index)
        if replica is None or not replica.live:
            return
        replica.live = False
        replica.forget()
        self._lose_open(index, commands)

    def _up(self, up: ReplicaUp, commands: list[RouterCommand]) -> None:
        replica = self._replica(up.replica)
        if replica is None or up.incarnation < replica.incarnation:
            return
        if up.incarnation == replica.incarnation and replica.live:
            return  # already known live in this incarnation
        # A new incarnation lost whatever the old one held, even where its going down was never reported.
        self._lose_open(up.replica, commands)
        replica.forget()
        replica.live = True
        replica.incarnation = up.incarnation

    # -- snapshots and invariants -----------------------------------------------------------------------------------
    def snapshot(self) -> RouterSnapshot:
        return RouterSnapshot(
            self.tick_no, self.now_ns, self.digest, self.config,
            [ReplicaSnapshot(r.live, r.incarnation, r.waiting, r.running, r.free_blocks, r.routed_since_report,
                             list(r.cached)) for r in self.replicas],
            list(self.open.items()), self.turn,
        )

    @classmethod
    def from_snapshot(cls, snapshot: RouterSnapshot) -> Router:
        router = cls(snapshot.config)
        if len(snapshot.replicas) != snapshot.config.replicas:
            raise ValueError(f"the snapshot holds {len(snapshot.replicas)} replicas, its configuration "
                             f"{snapshot.config.replicas}")
        router.tick_no, router.now_ns, router.digest = snapshot.tick, snapshot.now_ns, snapshot.digest
        for replica, saved in zip(router.replicas, snapshot.replicas, strict=True):
            replica.live, replica.incarnation = saved.live, saved.incarnation
            replica.waiting, replica.running, replica.free_blocks = saved.waiting, saved.running, saved.free_blocks
            replica.routed_since_report = saved.routed_since_report
            replica.cached = dict.fromkeys(saved.cached)
        router.open = dict(snapshot.open)
        router.turn = snapshot.turn
        return router

    def check_invariants(self) -> None:
        """Raise ``RouterInvariantError`` naming the first broken rule."""
        n = len(self.replicas)
        for rid, index in self.open.items():
            if not 0 <= index < n:
                raise RouterInvariantError(f"request {rid!r} is open on replica {index}, outside the fleet of {n}")
            if not self.replicas[index].live:
                raise RouterInvariantError(f"request {rid!r} is open on replica {index}, which is down")
        for index, replica in enumerate(self.replicas):
            if len(replica.cached) > self.config.cache_blocks:
                raise RouterInvariantError(f"replica {index} remembers {len(replica.cached)} blocks, over "
                                           f"cache_blocks={self.config.cache_blocks}")
            if not replica.live and (replica.cached or replica.load):
                raise RouterInvariantError(f"replica {index} is down but keeps a cache or a load")
            if min(replica.waiting, replica.running, replica.free_blocks, replica.routed_since_report) < 0:
                raise RouterInvariantError(f"replica {index} has a negative load or free block count")
        if not 0 <= self.turn < n:
            raise RouterInvariantError(f"the round-robin turn {self.turn} is outside the fleet of {n}")
