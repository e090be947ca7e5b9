"""The spill store and its actors: tiers, checksums, permissions, and a drop that overtakes its copy."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch
import trio
import trio.testing

from actors.mailbox import Envelope, Outbox, Source
from actors.spill import SpillActor, SpillStore, SwapInActor
from engine.model.types import HostKV
from events import DropSpill, PrefetchSpill, SpillDone, SpillOut, SwapInFailed, SwapInReady


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
    back = store.take("r")
    assert torch.equal(back.k, _kv(1).k) and torch.equal(back.v, _kv(1).v) and back.num_tokens == 40
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
