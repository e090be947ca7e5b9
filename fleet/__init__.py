"""A fleet of engines on Ray, with a pure, logged router (``tickloom fleet``; README "Fleet").

- ``router_events``: the router's vocabulary (inputs, decisions, its log records), msgspec Structs like ``events``.
- ``router``: the router, a sans-I/O state machine like ``engine.core``: ``Router.tick(inputs) -> outputs``.
- ``router_log``: the router's log, in the engine log's frame format, with its own header kind.
- ``router_replay``: exact replay, bisect and the per-tick table of a router log, and replay of a fleet directory.
- ``replica``: one engine in a Ray actor, with its own log; ``front``: the asyncio front end (``Fleet``).
- ``whatif``: a router log's arrivals re-routed under another policy or replica count, each replica simulated by
  the core-level simulator.

Only ``replica`` and ``front`` import Ray, and only when a fleet is started: the router, its log, replay and the
what-if need neither Ray nor trio nor torch.
"""

from __future__ import annotations
