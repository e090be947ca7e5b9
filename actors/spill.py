"""Spilled KV: a host tier in memory and a disk tier of checksummed files, plus the actors that fill and drain it.

* The device thread copies a victim's blocks to host (``SpillOut``) and hands the copy to ``SpillActor``, which
  keeps it in the host tier if the byte budget allows and otherwise writes it to the disk tier. Then it reports
  ``SpillDone``.
* ``SwapInActor`` answers ``PrefetchSpill``: a copy already in the host tier is ready at once; one on disk is
  read back, its checksum verified, and reported ``SwapInReady`` (or ``SwapInFailed``).
* The device thread takes the host copy for ``SwapIn``; ``DropSpill`` deletes a copy from both tiers.

The disk tier lives in a private directory (0700) whose files are 0600; each file starts with a blake2b
checksum of its payload. The payload is safetensors (never pickle). ``close`` removes everything.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import trio

from actors.mailbox import ChannelOverflow, Outbox
from engine.model.types import HostKV
from events import Command, DropSpill, PrefetchSpill, SpillDone, SpillOut, SwapInFailed, SwapInReady

_CHECKSUM = 32


class SpillStore:
    """Both tiers; thread-safe, because the device thread takes host copies while the actors work."""

    def __init__(self, directory: str | os.PathLike[str] | None, host_bytes: int) -> None:
        self._lock = threading.Lock()
        self._host: dict[str, HostKV] = {}
        self._host_used = 0
        self.host_bytes = host_bytes
        self.disk_bytes = 0
        self.spilled_bytes = 0
        self._dir: Path | None = None
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix="tickloom-spill-", dir=directory))
            os.chmod(self._dir, 0o700)
        self._files: dict[str, Path] = {}

    @property
    def directory(self) -> Path | None:
        return self._dir

    @property
    def held(self) -> int:
        """Requests with a spilled copy in either tier (0 once every spill has been dropped)."""
        with self._lock:
            return len(self._host.keys() | self._files.keys())

    def store(self, request_id: str, kv: HostKV) -> int:
        """Keep a copy in the host tier if it fits, else write it to disk; returns its size. Blocking."""
        kv.wait()
        size = kv.nbytes()
        with self._lock:
            if self._host_used + size <= self.host_bytes or self._dir is None:
                if self._dir is None and self._host_used + size > self.host_bytes:
                    raise OSError(f"host spill tier full ({self._host_used} + {size} > {self.host_bytes} bytes) "
                                  "and no spill directory is configured")
                self._host[request_id] = kv
                self._host_used += size
                self.spilled_bytes += size
                return size
        payload = _serialize(kv)
        path = self._path(request_id)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, hashlib.blake2b(payload, digest_size=_CHECKSUM).digest())
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        with self._lock:
            self._files[request_id] = path
            self.disk_bytes += len(payload)
            self.spilled_bytes += size
        return size

    def load(self, request_id: str) -> None:
        """Bring a disk copy into the host tier (verifying its checksum). Blocking."""
        with self._lock:
            if request_id in self._host:
                return
            path = self._files.get(request_id)
        if path is None:
            raise KeyError(f"no spilled KV for {request_id!r}")
        data = path.read_bytes()
        checksum, payload = data[:_CHECKSUM], data[_CHECKSUM:]
        if hashlib.blake2b(payload, digest_size=_CHECKSUM).digest() != checksum:
            raise OSError(f"checksum mismatch in spill file {path}")
        kv = _deserialize(payload)
        with self._lock:
            self._host[request_id] = kv
            self._host_used += kv.nbytes()

    def take(self, request_id: str) -> HostKV:
        """Remove and return the host copy for swap-in (the device thread calls this)."""
        with self._lock:
            kv = self._host.pop(request_id)
            self._host_used -= kv.nbytes()
            return kv

    def drop(self, request_id: str) -> None:
        with self._lock:
            kv = self._host.pop(request_id, None)
            if kv is not None:
                self._host_used -= kv.nbytes()
            path = self._files.pop(request_id, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        """Remove every spill file and the private directory."""
        with self._lock:
            paths = list(self._files.values())
            self._files.clear()
            self._host.clear()
            self._host_used = 0
        for path in paths:
            path.unlink(missing_ok=True)
        if self._dir is not None and self._dir.exists():
            for leftover in self._dir.iterdir():
                leftover.unlink()
            self._dir.rmdir()

    def _path(self, request_id: str) -> Path:
        assert self._dir is not None
        name = hashlib.blake2b(request_id.encode(), digest_size=12).hexdigest()
        return self._dir / f"{name}.kv"


def _serialize(kv: HostKV) -> bytes:
    header = str(kv.num_tokens).encode() + b"\n"
    if kv.k is None or kv.v is None:
        return header
    from safetensors.torch import save

    return header + save({"k": kv.k.contiguous(), "v": kv.v.contiguous()})


def _deserialize(payload: bytes) -> HostKV:
    header, _, body = payload.partition(b"\n")
    if not body:
        return HostKV(None, None, int(header))
    from safetensors.torch import load

    tensors = load(body)
    return HostKV(tensors["k"], tensors["v"], int(header))


class SpillActor:
    """Stores host copies the device hands over, and deletes dropped ones; reports ``SpillDone``.

    It hears of each ``SpillOut`` from the step actor when the command is dispatched, before the device can hand
    the copy over. So a ``DropSpill`` that overtakes its copy (the request ended meanwhile) is remembered, and the
    copy is discarded on arrival instead of lingering in a tier until shutdown.
    """

    def __init__(self, store: SpillStore, outbox: Outbox, limit: int,
                 fault: Callable[[str], str | None] | None = None) -> None:
        self.store = store
        self._outbox = outbox
        self._send, self._receive = trio.open_memory_channel[tuple[str, str, HostKV | None, str]](limit)
        self._limit = limit
        self._fault = fault
        """Injected write errors (``FaultPlan.fail_spill``): request id -> error text, or None."""

    def _put(self, kind: str, request_id: str, kv: HostKV | None = None, error: str = "") -> None:
        try:
            self._send.send_nowait((kind, request_id, kv, error))
        except trio.WouldBlock:
            raise ChannelOverflow(f"spill actor overflowed its bound of {self._limit}") from None

    def accept_nowait(self, request_id: str, kv: HostKV | None, error: str = "") -> None:
        """From the device (via the trio token): a finished copy-out, or why it failed."""
        self._put("copy", request_id, kv, error)

    def submit_nowait(self, command: Command) -> None:
        if isinstance(command, SpillOut):
            self._put("pending", command.request_id)
        elif isinstance(command, DropSpill):
            self._put("drop", command.request_id)

    async def run(self) -> None:
        pending: set[str] = set()
        doomed: set[str] = set()
        async for kind, request_id, kv, error in self._receive:
            if kind == "pending":
                pending.add(request_id)
            elif kind == "drop":
                if request_id in pending:
                    doomed.add(request_id)
                else:
                    await trio.to_thread.run_sync(self.store.drop, request_id)
            else:
                pending.discard(request_id)
                if request_id in doomed:
                    doomed.discard(request_id)  # the request ended while its copy was in flight
                elif kv is None:
                    await self._outbox.send(SpillDone(request_id, False, error))
                else:
                    await self._store(request_id, kv)

    async def _store(self, request_id: str, kv: HostKV) -> None:
        injected = self._fault(request_id) if self._fault is not None else None
        try:
            if injected is not None:
                raise OSError(injected)
            size = await trio.to_thread.run_sync(self.store.store, request_id, kv)
        except OSError as exc:
            await self._outbox.send(SpillDone(request_id, False, f"spill write failed: {exc}"))
        else:
            await self._outbox.send(SpillDone(request_id, True, "", size))


class SwapInActor:
    """Prefetches spilled KV into the host tier for resume candidates; reports ready or failed."""

    def __init__(self, store: SpillStore, outbox: Outbox, limit: int,
                 fault: Callable[[str], str | None] | None = None) -> None:
        self.store = store
        self._outbox = outbox
        self._send, self._receive = trio.open_memory_channel[str](limit)
        self._limit = limit
        self._fault = fault

    def submit_nowait(self, command: Command) -> None:
        if isinstance(command, PrefetchSpill):
            try:
                self._send.send_nowait(command.request_id)
            except trio.WouldBlock:
                raise ChannelOverflow(f"swap-in actor overflowed its bound of {self._limit}") from None

    async def run(self) -> None:
        async for request_id in self._receive:
            injected = self._fault(request_id) if self._fault is not None else None
            try:
                if injected is not None:
                    raise OSError(injected)
                await trio.to_thread.run_sync(self.store.load, request_id)
            except (OSError, KeyError) as exc:
                await self._outbox.send(SwapInFailed(request_id, str(exc)))
            else:
                await self._outbox.send(SwapInReady(request_id))
