"""Spilled KV: a host tier in memory and a disk tier of checksummed files, plus the actors that fill and drain it.

* The device thread copies a victim's blocks to host (``SpillOut``) and hands the copy to ``SpillActor``, which
  keeps it in the host tier if the byte budget allows and otherwise writes it to the disk tier. Then it reports
  ``SpillDone``.
* ``SwapInActor`` answers ``PrefetchSpill``: a copy already in the host tier is ready at once; one on disk is
  read back, its checksum verified, and reported ``SwapInReady`` (or ``SwapInFailed``).
* The device thread takes the host copy for ``SwapIn``; ``DropSpill`` deletes a copy from both tiers.

The disk tier lives in a private directory (0700) whose files are 0600; each file starts with a blake2b
checksum of its payload. The payload is safetensors (never pickle). ``close`` removes everything.

A process that is killed never gets to ``close``, so the private directory's name says who owns it:
``tickloom-spill-<host>-<pid>-<start>-<random>``. ``<host>`` is a short hash of the host name, so a directory on a
shared file system is judged only by processes on its own host; ``<start>`` is the owner's start time (from
``/proc``; 0 where there is none), so a pid reused by a later process, as after a container restart, does not
keep a stale directory alive. A new store first removes every stale one in ``spill_dir``
(``remove_stale_spill_dirs``): a directory, not a symlink, named exactly so, owned by this user, made on this
host by a process that no longer runs. Nothing else is touched.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import trio

from tickloom.actors.mailbox import ChannelOverflow, Outbox
from tickloom.engine.model.types import HostKV
from tickloom.events import Command, DropSpill, PrefetchSpill, SpillDone, SpillOut, SwapInFailed, SwapInReady

_CHECKSUM = 32
_PREFIX = "tickloom-spill-"
_OWNED = re.compile(r"tickloom-spill-(?P<host>[0-9a-f]{8})-(?P<pid>[1-9][0-9]{0,9})-(?P<start>[0-9]{1,20})-[a-z0-9_]+")
"""The private directory's name: host tag, owner pid and start time, and ``mkdtemp``'s random part."""
_PROC = os.path.exists("/proc/self/stat")


def host_tag() -> str:
    """This host's tag in spill directory names: 8 hex digits of a hash of the host name."""
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, from ``/proc``); None if there is no such process.

    0 where ``/proc`` is missing (not Linux): the process exists, its start time is unknown.
    """
    if not _PROC:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return 0  # it exists, owned by another user
        return 0
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):  # none, or it ended while being read
        return None
    return int(data.rsplit(b")", 1)[1].split()[19])  # field 22; the name before ")" may hold spaces


def owner_alive(pid: int, start: int) -> bool:
    """Whether the process that made a spill directory (``pid``, started at ``start``) still runs."""
    now = process_start(pid)
    if now is None:
        return False
    return start == 0 or now == 0 or now == start


def _owner_prefix() -> str:
    """This process's spill directory names start so; the random rest follows."""
    pid = os.getpid()
    return f"{_PREFIX}{host_tag()}-{pid}-{process_start(pid) or 0}-"


def remove_stale_spill_dirs(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove the private spill directories in ``directory`` that killed processes left behind; returns them.

    A directory is removed only if all hold: it is a directory and not a symlink; its name matches
    ``tickloom-spill-<host>-<pid>-<start>-<random>`` exactly; it is owned by this user; ``<host>`` is this host's
    tag; no process ``<pid>`` that started at ``<start>`` runs. To remove it, a store first renames it to a name of
    its own, so two stores starting at once never both remove it, and a store killed while removing leaves a
    directory the next one removes. The removal never follows symlinks.
    """
    root = Path(directory)
    tag, uid = host_tag(), os.getuid()
    removed: list[Path] = []
    with os.scandir(root) as entries:
        candidates = [entry for entry in entries if _OWNED.fullmatch(entry.name)]
    for entry in candidates:
        match = _OWNED.fullmatch(entry.name)
        assert match is not None
        if match["host"] != tag or not entry.is_dir(follow_symlinks=False):
            continue
        if entry.stat(follow_symlinks=False).st_uid != uid or owner_alive(int(match["pid"]), int(match["start"])):
            continue
        claimed = root / f"{_owner_prefix()}{os.urandom(6).hex()}"
        try:
            os.rename(entry.path, claimed)
        except FileNotFoundError:
            continue  # another store starting now claimed it first; it removes it
        shutil.rmtree(claimed)
        removed.append(Path(entry.path))
    return removed


def _make_dirs(directory: Path, made: list[Path]) -> None:
    """``os.makedirs(directory, exist_ok=True)``, appending each directory it makes to ``made`` (outermost first),
    so that exactly those can be removed again."""
    missing: list[Path] = []
    path = directory
    while not os.path.lexists(path) and path.parent != path:  # up to the first thing there, whatever it is
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:
            if not path.is_dir():
                raise
            continue  # made at the same moment by someone else: theirs, not ours
        made.append(path)


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
        self.removed_stale: list[Path] = []
        """Stale spill directories of killed processes that this store removed at start."""
        self._made: list[Path] = []
        """The directories of ``directory``'s path that this store made (outermost first): a failed start removes
        them again (``discard``)."""
        self._files: dict[str, Path] = {}
        if directory is not None:
            try:
                _make_dirs(Path(directory), self._made)
                self.removed_stale = remove_stale_spill_dirs(directory)
                self._dir = Path(tempfile.mkdtemp(prefix=_owner_prefix(), dir=directory))
                os.chmod(self._dir, 0o700)
            except BaseException:
                self.discard()
                raise

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
            # The read ran outside the lock, in the swap-in actor's thread, while the spill actor may have dropped
            # this copy (the request ended: cancelled, timed out). Inserting it now would leave a host copy that
            # nothing will ever drop.
            if self._files.get(request_id) is not path:
                raise KeyError(f"spilled KV for {request_id!r} was dropped while it was being read")
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

    def discard(self) -> None:
        """``close``, then remove the directories this store made for ``spill_dir``: for an engine that never
        started. A directory that is not empty (someone else's files) is kept."""
        try:
            self.close()
        finally:
            for made in reversed(self._made):
                try:
                    made.rmdir()
                except OSError:
                    break  # not empty, or not ours any more: neither it nor its parents are removed
            self._made.clear()

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
    copy is discarded on arrival instead of lingering in a tier until shutdown. The drop still removes what the
    store already holds for the request: an earlier copy, if it was swapped out again before that one was dropped.
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
                # Drop what the store holds even when a copy is in flight: a request swapped in and out again
                # before its first step settled still has its earlier copy here, and only this drop removes it.
                if request_id in pending:
                    doomed.add(request_id)
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
