"""The spill store and its actors: tiers, checksums, permissions, and a drop that overtakes its copy."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trio
import trio.testing

from tickloom.actors.mailbox import Envelope, Outbox, Source
from tickloom.actors.spill import SpillActor, SpillStore, SwapInActor, host_tag, process_start
from tickloom.engine.model.types import HostKV
from tickloom.events import DropSpill, PrefetchSpill, SpillDone, SpillOut, SwapInFailed, SwapInReady


def _kv(seed: int) -> HostKV:
    g = torch.Generator().manual_seed(seed)
    return HostKV(torch.randn(2, 3, 4, 1, 8, generator=g), torch.randn(2, 3, 4, 1, 8, generator=g), 40)


def test_disk_tier_is_private_checksummed_and_removed(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, host_bytes=0)
    store.store("r", _kv(1))
    directory = store.directory
    assert directory is not None and stat.S_IMODE(directory.stat().st_mode) == 0o700
    [spill_file] = list(directory.iterdir())
    assert stat.S_IMODE(spill_file.stat().st_mode) == 0o600
    store.load("r")
    back, want = store.take("r"), _kv(1)
    assert back.k is not None and back.v is not None and want.k is not None and want.v is not None
    assert torch.equal(back.k, want.k) and torch.equal(back.v, want.v) and back.num_tokens == 40
    store.drop("r")
    assert not spill_file.exists()
    store.store("s", _kv(2))
    [path] = list(directory.iterdir())
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(OSError, match="checksum mismatch"):
        store.load("s")
    store.close()
    assert not directory.exists()


def test_a_drop_while_the_swap_in_reads_leaves_no_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The swap-in actor reads a disk copy in its thread while the spill actor drops it (the request ended): the
    read must not put the copy back into the host tier, where nothing would ever drop it."""
    import tickloom.actors.spill as spill_module

    store = SpillStore(tmp_path, host_bytes=0)
    store.store("r", _kv(1))
    real = spill_module._deserialize

    def dropped_meanwhile(payload: bytes) -> HostKV:
        store.drop("r")  # what the spill actor's thread does while this one reads
        return real(payload)

    monkeypatch.setattr(spill_module, "_deserialize", dropped_meanwhile)
    with pytest.raises(KeyError, match="dropped while it was being read"):
        store.load("r")
    assert store.held == 0
    store.close()


def test_host_tier_without_a_directory_refuses_overflow(tmp_path: Path) -> None:
    store = SpillStore(None, host_bytes=100)
    with pytest.raises(OSError, match="host spill tier full"):
        store.store("r", _kv(1))


async def test_a_drop_that_overtakes_its_copy_discards_it(tmp_path: Path,
                                                          autojump_clock: trio.testing.MockClock) -> None:
    send, receive = trio.open_memory_channel[Envelope](16)
    store = SpillStore(tmp_path, host_bytes=1 << 20)
    spill = SpillActor(store, Outbox(Source.SPILL, send), 16)
    swap_in = SwapInActor(store, Outbox(Source.SWAP_IN, send.clone()), 16)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(spill.run)
        nursery.start_soon(swap_in.run)
        spill.submit_nowait(SpillOut("kept", [1, 2], 40))
        spill.accept_nowait("kept", _kv(1))
        spill.submit_nowait(SpillOut("gone", [3, 4], 40))
        spill.submit_nowait(DropSpill("gone"))  # the request ended before the device handed its copy over
        spill.accept_nowait("gone", _kv(2))
        got = [(await receive.receive()).msg]
        swap_in.submit_nowait(PrefetchSpill("kept"))
        swap_in.submit_nowait(PrefetchSpill("gone"))
        got += [(await receive.receive()).msg, (await receive.receive()).msg]
        await trio.sleep(1)
        with pytest.raises(trio.WouldBlock):
            receive.receive_nowait()  # the dropped copy was neither stored nor reported
        nursery.cancel_scope.cancel()
    assert got[0] == SpillDone("kept", True, "", _kv(1).nbytes())
    assert got[1] == SwapInReady("kept")
    assert isinstance(got[2], SwapInFailed) and got[2].request_id == "gone"
    store.close()


async def test_a_drop_while_a_second_copy_is_in_flight_also_drops_the_first(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """Soak regression: a request swapped in, then swapped out again before its first step settled (its first copy
    is still on disk), then cancelled while the second copy was in flight. The drop must remove the first copy as
    well as discard the second, or the first outlives the request."""
    send, receive = trio.open_memory_channel[Envelope](16)
    store = SpillStore(tmp_path, host_bytes=0)
    spill = SpillActor(store, Outbox(Source.SPILL, send), 16)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(spill.run)
        spill.submit_nowait(SpillOut("r", [1, 2], 40))
        spill.accept_nowait("r", _kv(1))
        assert (await receive.receive()).msg == SpillDone("r", True, "", _kv(1).nbytes())
        spill.submit_nowait(SpillOut("r", [3, 4], 40))  # swapped out again; the first copy is still held
        spill.submit_nowait(DropSpill("r"))  # cancelled before the device hands the second copy over
        spill.accept_nowait("r", _kv(2))
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    with pytest.raises(trio.WouldBlock):
        receive.receive_nowait()  # the second copy was neither stored nor reported
    assert store.held == 0, "neither copy outlives the request"
    assert store.directory is not None and not list(store.directory.iterdir())
    store.close()


def _dead_pid() -> int:
    """The id of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_start(child.pid) is None
    return child.pid


def _spill_dir(root: Path, pid: int, start: int, *, host: str | None = None, suffix: str = "abc123_z") -> Path:
    path = root / f"tickloom-spill-{host or host_tag()}-{pid}-{start}-{suffix}"
    path.mkdir(mode=0o700)
    (path / "0123.kv").write_bytes(b"spilled")
    return path


def test_the_private_directory_names_its_owner(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, host_bytes=0)
    assert store.directory is not None
    match = re.fullmatch(r"tickloom-spill-([0-9a-f]{8})-(\d+)-(\d+)-[a-z0-9_]+", store.directory.name)
    assert match is not None
    assert match.groups() == (host_tag(), str(os.getpid()), str(process_start(os.getpid())))
    store.close()


def test_stale_spill_directories_of_dead_processes_are_removed_at_start(tmp_path: Path) -> None:
    me = os.getpid()
    my_start = process_start(me)
    assert my_start is not None
    dead = _dead_pid()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep me")
    stale = _spill_dir(tmp_path, dead, 12345)
    (stale / "link").symlink_to(outside, target_is_directory=True)  # removed as a link, never followed
    stale_nested = _spill_dir(tmp_path, dead, 0, suffix="q")
    (stale_nested / "sub").mkdir()
    reused = _spill_dir(tmp_path, me, my_start + 1)  # our pid, but an earlier process's start time
    kept = [
        _spill_dir(tmp_path, me, my_start),  # another live store of this process
        _spill_dir(tmp_path, os.getppid(), 0),  # a live process (start time unknown)
        _spill_dir(tmp_path, dead, 12345, host="0badc0de" if host_tag() != "0badc0de" else "0badc0df"),
        _spill_dir(tmp_path, dead, 12345, suffix="Not-Ours"),  # not our naming pattern
    ]
    unrelated = tmp_path / f"unrelated-{dead}"
    unrelated.mkdir()
    like_a_file = tmp_path / f"tickloom-spill-{host_tag()}-{dead}-1-file"
    like_a_file.write_bytes(b"a file, not a directory")
    like_a_link = tmp_path / f"tickloom-spill-{host_tag()}-{dead}-1-link"
    like_a_link.symlink_to(outside, target_is_directory=True)

    store = SpillStore(tmp_path, host_bytes=0)
    assert sorted(store.removed_stale) == sorted([stale, stale_nested, reused])
    for path in (stale, stale_nested, reused):
        assert not os.path.lexists(path)
    for path in kept:
        assert (path / "0123.kv").read_bytes() == b"spilled"
    assert unrelated.is_dir() and like_a_file.read_bytes() == b"a file, not a directory"
    assert like_a_link.is_symlink() and (outside / "precious").read_bytes() == b"keep me"
    assert store.directory is not None and store.directory.is_dir()
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {p.name for p in [*kept, unrelated, like_a_file, like_a_link, outside, store.directory]}
    store.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another user")
def test_a_stale_directory_of_another_user_is_kept(tmp_path: Path) -> None:
    other = _spill_dir(tmp_path, _dead_pid(), 1)
    os.chown(other, 54321, 54321)
    store = SpillStore(tmp_path, host_bytes=0)
    assert store.removed_stale == [] and (other / "0123.kv").read_bytes() == b"spilled"
    store.close()
