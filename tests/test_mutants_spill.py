"""Behavioural tests that kill mutants of the spill store and its actors (scripts/mutate.sh --area actors) that their
own tests leave alive: owners and their start times, the files and directories the store makes, the host and disk
tiers, and the spill and swap-in actors' injected errors and bounds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
import trio.testing

import tickloom.actors.spill as spill_module
from tickloom.actors.mailbox import ChannelOverflow, Envelope, Outbox, Source
from tickloom.actors.spill import SpillActor, SpillStore, host_tag, owner_alive, process_start
from tickloom.engine.model.types import HostKV
from tickloom.events import (
    DropSpill,
    PrefetchSpill,
    SpillDone,
    SpillOut,
    SwapInFailed,
    SwapInReady,
)

# --- the spill store: owners, files, the directories it makes --------------------------------------------------------




def test_the_host_tag_is_a_hash_of_the_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spill_module.socket, "gethostname", lambda: "alpha")
    alpha = host_tag()
    monkeypatch.setattr(spill_module.socket, "gethostname", lambda: "beta")
    assert host_tag() != alpha and len(alpha) == 8 and int(alpha, 16) >= 0
    monkeypatch.setattr(spill_module.socket, "gethostname", lambda: "alpha")
    assert host_tag() == alpha


def _uptime_ticks() -> float:
    return float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_a_process_start_is_its_start_time_in_ticks_even_with_a_parenthesis_in_its_name() -> None:
    """The start time is field 22 of /proc/PID/stat; the process's name before it may hold ") " and spaces."""
    rename = ("import ctypes, sys, time; ctypes.CDLL(None).prctl(15, b'x) 1 2 (3)', 0, 0, 0); "
              "print(flush=True); time.sleep(60)")
    before = _uptime_ticks()
    child = subprocess.Popen([sys.executable, "-c", rename], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"\n"  # renamed
        after = _uptime_ticks()
        assert b"x) 1 2 (3)" in Path(f"/proc/{child.pid}/stat").read_bytes()
        started = process_start(child.pid)
        assert started is not None and before - 1 <= started <= after + 1
        me = process_start(os.getpid())
        assert me is not None and me <= started
    finally:
        child.kill()
        child.wait()
    assert process_start(child.pid) is None


def test_without_proc_a_process_exists_with_an_unknown_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where there is no /proc (not Linux) a live process's start is 0, unknown; a live owner is then alive
    whatever start its directory names."""
    monkeypatch.setattr(spill_module, "_PROC", False)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_start(os.getpid()) == 0
    assert process_start(child.pid) is None
    assert owner_alive(os.getpid(), 12345) and not owner_alive(child.pid, 12345)
    assert spill_module._owner_prefix() == f"tickloom-spill-{host_tag()}-{os.getpid()}-0-"


def test_an_owner_is_alive_only_with_its_start_time_or_an_unknown_one() -> None:
    me = process_start(os.getpid())
    assert me is not None and me > 0
    assert owner_alive(os.getpid(), me) and owner_alive(os.getpid(), 0)
    assert not owner_alive(os.getpid(), me + 1), "a reused pid"


def test_disk_copies_of_two_requests_are_two_files(tmp_path: Path) -> None:
    import torch

    store = SpillStore(tmp_path, host_bytes=0)
    kvs = {rid: HostKV(torch.full((1, 1, 2, 1, 2), float(i)), torch.full((1, 1, 2, 1, 2), -float(i)), 10 + i)
           for i, rid in enumerate(["r1", "r2", "../r3"])}
    for rid, kv in kvs.items():
        store.store(rid, kv)
    assert store.directory is not None and len(list(store.directory.iterdir())) == 3, "inside the directory"
    for rid, kv in kvs.items():
        store.load(rid)
        back = store.take(rid)
        assert back.num_tokens == kv.num_tokens and back.k is not None and kv.k is not None
        assert torch.equal(back.k, kv.k)
    store.close()


def test_the_disk_format_round_trips_a_copy_without_tensors() -> None:
    back = spill_module._deserialize(spill_module._serialize(HostKV(None, None, 37)))
    assert (back.k, back.v, back.num_tokens) == (None, None, 37)


def test_discard_removes_exactly_the_directories_the_store_made(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    store = SpillStore(tmp_path / "a" / "b" / "c", host_bytes=0)
    assert (tmp_path / "a" / "b" / "c").is_dir()
    store.discard()
    assert [p.name for p in tmp_path.iterdir()] == ["a"] and not list((tmp_path / "a").iterdir())
    kept = SpillStore(tmp_path / "x" / "y", host_bytes=0)
    (tmp_path / "x" / "theirs").write_bytes(b"someone else's")
    kept.discard()
    kept.discard()
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["theirs"], "y removed, x kept (not empty)"


def test_a_store_that_cannot_start_removes_what_it_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_bytes(b"not a directory")
    with pytest.raises(OSError):
        SpillStore(tmp_path / "file" / "spill", host_bytes=0)

    def full(**_: object) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spill_module.tempfile, "mkdtemp", full)
    with pytest.raises(OSError, match="No space left"):
        SpillStore(tmp_path / "made" / "here", host_bytes=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"], "the directories it made are gone"



# --- the spill store's tiers and the spill actor --------------------------------------------------------------------


def _sized(n: int, seed: int) -> HostKV:
    import torch

    return HostKV(torch.full((n,), float(seed)), torch.full((n,), -float(seed)), seed)


@pytest.mark.parametrize("seed", range(6))
def test_the_tiers_follow_the_host_byte_budget(tmp_path: Path, seed: int) -> None:
    """Random stores, loads, takes and drops against a model of the two tiers: a copy stays in the host tier while
    the budget allows (a copy that fits exactly too), a copy read back from disk counts against it, and what leaves
    the host tier frees its bytes."""
    import random

    rng = random.Random(seed)
    store = SpillStore(tmp_path, host_bytes=4 * 64)
    host: dict[str, int] = {}
    disk: set[str] = set()
    spilled = disk_bytes = 0
    sizes: dict[str, int] = {}
    for i in range(40):
        op = rng.choice(["store", "store", "load", "take", "drop"])
        if op == "store":
            rid, kv = f"r{i}", _sized(rng.choice([8, 16, 32]), i)
            size = kv.nbytes()
            assert store.store(rid, kv) == size
            sizes[rid] = size
            spilled += size
            if sum(host.values()) + size <= 4 * 64:
                host[rid] = size
            else:
                disk.add(rid)
                disk_bytes += len(spill_module._serialize(kv))
        elif op == "load" and disk - host.keys():
            rid = rng.choice(sorted(disk - host.keys()))
            store.load(rid)
            host[rid] = sizes[rid]
        elif op == "take" and host:
            rid = rng.choice(sorted(host))
            assert store.take(rid).nbytes() == host.pop(rid)
        elif op == "drop" and host.keys() | disk:
            rid = rng.choice(sorted(host.keys() | disk))
            store.drop(rid)
            host.pop(rid, None)
            disk.discard(rid)
        assert store.directory is not None and len(list(store.directory.iterdir())) == len(disk)
        assert store.held == len(host.keys() | disk)
        assert (store.spilled_bytes, store.disk_bytes) == (spilled, disk_bytes)
    store.close()


def test_the_host_tier_alone_refuses_a_copy_past_its_budget_naming_both_sizes() -> None:
    store = SpillStore(None, host_bytes=128)
    store.store("a", _sized(8, 1))  # 64 bytes
    store.store("b", _sized(8, 2))  # exactly full
    with pytest.raises(OSError) as info:
        store.store("c", _sized(1, 3))
    assert str(info.value) == ("host spill tier full (128 + 8 > 128 bytes) and no spill directory is configured")
    store.take("a")
    store.store("c", _sized(8, 3))
    assert store.held == 2 and store.spilled_bytes == 192


def test_loading_an_unknown_copy_names_the_request(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, host_bytes=0)
    with pytest.raises(KeyError) as info:
        store.load("gone")
    assert info.value.args == ("no spilled KV for 'gone'",)
    store.close()


def test_a_spill_file_removed_behind_the_stores_back_is_no_error(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, host_bytes=0)
    store.store("a", _sized(4, 1))
    store.store("b", _sized(4, 2))
    assert store.directory is not None
    for path in store.directory.iterdir():
        path.unlink()  # a temporary-file cleaner
    store.drop("a")
    store.close()
    assert not tmp_path.joinpath(store.directory.name).exists()


def test_a_directory_made_by_someone_else_meanwhile_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the store's look and its mkdir, another process makes the same directory: it is theirs, so the
    store goes on below it, and a failed start leaves it."""
    theirs = tmp_path / "theirs"
    real = os.path.lexists

    def racing(path: object) -> bool:
        if Path(str(path)) == theirs and not real(theirs):
            theirs.mkdir()  # made at the same moment
            return False
        return real(path)  # type: ignore[arg-type]

    monkeypatch.setattr(spill_module.os.path, "lexists", racing)
    store = SpillStore(theirs / "mine", host_bytes=0)
    store.discard()
    assert theirs.is_dir() and not (theirs / "mine").exists()
    blocked = tmp_path / "blocked"

    def file_meanwhile(path: object) -> bool:
        if Path(str(path)) == blocked and not real(blocked):
            blocked.write_bytes(b"a file")
            return False
        return real(path)  # type: ignore[arg-type]

    monkeypatch.setattr(spill_module.os.path, "lexists", file_meanwhile)
    with pytest.raises(FileExistsError):
        SpillStore(blocked / "mine", host_bytes=0)
    assert blocked.read_bytes() == b"a file"


async def test_the_spill_actor_reports_injected_write_errors_and_is_bounded(
        autojump_clock: trio.testing.MockClock) -> None:
    send, receive = trio.open_memory_channel[Envelope](16)
    store = SpillStore(None, host_bytes=1 << 20)
    spill = SpillActor(store, Outbox(Source.SPILL, send), 2,
                       fault=lambda rid: "disk on fire" if rid == "bad" else None)
    spill.submit_nowait(SpillOut("ok", [1], 16))
    spill.submit_nowait(SpillOut("bad", [2], 16))
    with pytest.raises(ChannelOverflow, match=r"^spill actor overflowed its bound of 2$"):
        spill.accept_nowait("ok", _sized(4, 1))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(spill.run)
        await trio.testing.wait_all_tasks_blocked()
        spill.accept_nowait("ok", _sized(4, 1))
        spill.accept_nowait("bad", _sized(4, 2))
        got = [(await receive.receive()).msg, (await receive.receive()).msg]
        nursery.cancel_scope.cancel()
    assert got == [SpillDone("ok", True, "", 32), SpillDone("bad", False, "spill write failed: disk on fire")]
    assert store.held == 1


async def test_a_request_id_used_again_after_its_drop_spills_normally(autojump_clock: trio.testing.MockClock) -> None:
    """A client may reuse a request id once the request has ended: the earlier drop, which overtook its copy, must
    not discard the new request's copy."""
    send, receive = trio.open_memory_channel[Envelope](16)
    store = SpillStore(None, host_bytes=1 << 20)
    spill = SpillActor(store, Outbox(Source.SPILL, send), 16)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(spill.run)
        spill.submit_nowait(SpillOut("r", [1], 16))
        spill.submit_nowait(DropSpill("r"))
        spill.accept_nowait("r", _sized(4, 1))  # discarded: the request ended
        spill.submit_nowait(SpillOut("r", [2], 16))  # the id, used again by a new request
        spill.accept_nowait("r", _sized(4, 2))
        got = (await receive.receive()).msg
        nursery.cancel_scope.cancel()
    assert got == SpillDone("r", True, "", 32) and store.take("r").num_tokens == 2



async def test_the_swap_in_actor_reports_injected_read_errors_and_is_bounded(
        autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    from tickloom.actors.spill import SwapInActor

    send, receive = trio.open_memory_channel[Envelope](16)
    store = SpillStore(tmp_path, host_bytes=0)
    store.store("ok", _sized(4, 1))
    store.store("bad", _sized(4, 2))
    swap_in = SwapInActor(store, Outbox(Source.SWAP_IN, send), 1,
                          fault=lambda rid: "sector unreadable" if rid == "bad" else None)
    swap_in.submit_nowait(PrefetchSpill("bad"))
    with pytest.raises(ChannelOverflow, match=r"^swap-in actor overflowed its bound of 1$"):
        swap_in.submit_nowait(PrefetchSpill("ok"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(swap_in.run)
        await trio.testing.wait_all_tasks_blocked()
        swap_in.submit_nowait(PrefetchSpill("ok"))
        got = [(await receive.receive()).msg, (await receive.receive()).msg]
        nursery.cancel_scope.cancel()
    assert got == [SwapInFailed("bad", "sector unreadable"), SwapInReady("ok")]
    assert store.take("ok").num_tokens == 1
    store.close()


def test_a_request_spilled_to_disk_again_reads_back_its_newer_copy(tmp_path: Path) -> None:
    """Swapped in, then out again before its first copy was dropped: the second, smaller copy overwrites the
    file, and reads back whole."""
    import torch

    store = SpillStore(tmp_path, host_bytes=0)
    store.store("r", _sized(64, 1))
    store.load("r")
    store.take("r")
    store.store("r", _sized(2, 2))
    store.load("r")
    back = store.take("r")
    assert back.num_tokens == 2 and back.k is not None and torch.equal(back.k, _sized(2, 2).k)  # type: ignore[arg-type]
    store.close()


def test_a_store_without_a_directory_removed_nothing() -> None:
    assert SpillStore(None, host_bytes=0).removed_stale == []


def test_probing_a_process_without_proc_never_signals_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spill_module, "_PROC", False)
    script = "import signal, time; signal.signal(signal.SIGHUP, signal.SIG_DFL); print(flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"\n"
        assert process_start(child.pid) == 0
        time.sleep(0.2)
        assert child.poll() is None, "still running"
    finally:
        child.kill()
        child.wait()

    def not_yours(pid: int, signal: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(spill_module.os, "kill", not_yours)
    assert process_start(child.pid) == 0, "another user's process exists"


def test_a_stale_directory_claimed_by_another_store_first_does_not_stop_the_sweep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    stale = []
    for suffix in ("a", "b"):
        path = tmp_path / f"tickloom-spill-{host_tag()}-{child.pid}-7-{suffix}"
        path.mkdir()
        stale.append(path)
    real = os.rename
    calls: list[str] = []

    def raced(src: str, dst: object) -> None:
        calls.append(src)
        if len(calls) == 1:
            shutil.rmtree(src)  # the other store renamed (and removed) it first
            raise FileNotFoundError(2, "No such file or directory")
        real(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(spill_module.os, "rename", raced)
    store = SpillStore(tmp_path, host_bytes=0)
    assert len(calls) == 2 and len(store.removed_stale) == 1 and not any(p.exists() for p in stale)
    store.close()
