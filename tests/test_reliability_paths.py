"""Paths a user configures or hands to a reader, when the operating system says no.

* ``spill_dir``, ``log_path`` and ``model``: any OS error from a configured path is a ``ConfigError`` naming the
  field and the OS reason, and a failed start leaves nothing behind (no spill directory, no log file).
* A log whose header cannot be written (a full disk) is removed again, so the path is free for a retry; only the
  file the writer created is ever removed.
* Every log reader of the command line (``log info``, ``replay``, ``inspect``, ``whatif``) exits 2 with one line
  naming the problem for a missing path, a directory, an unreadable file, an empty file and garbage; a fleet
  directory is still ``replay``'s legitimate input.
* A log followed by a zero tail of any size (space the file holds but nothing was written to) reads in bounded
  memory, as its torn end: the replay verdict of the good part is unchanged.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio
from engine_helpers import stub_config

from tickloom import ConfigError, Engine, EngineConfig, SamplingParams
from tickloom.engine.core import SchedulerCore
from tickloom.events import FORMAT_VERSION, SCHEMA_HASH, LogHeader, LogReader, LogWriter, TickRecord, recover_log
from tickloom.events.digest import DIGEST_VERSION
from tickloom.events.frames import HEADER_SIZE
from tickloom.replay import verify
from tickloom.tools.cli import main

HEADER = LogHeader(FORMAT_VERSION, SCHEMA_HASH, DIGEST_VERSION, "test", '{"test": true}')
ROOT = os.geteuid() == 0
GiB = 1 << 30


async def _serve(config: EngineConfig, requests: int = 3) -> None:
    async with Engine.open(config) as engine, trio.open_nursery() as nursery:
        for i in range(requests):

            async def one(i: int = i) -> None:
                async for _ in engine.generate([1, 2, 3, 4 + i], SamplingParams(max_tokens=6)):
                    pass

            nursery.start_soon(one)



def unprivileged(why_root_differs: str) -> list[str]:
    """The command prefix that runs a child without root's file-permission override (none when not root)."""
    if not ROOT:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip(f"{why_root_differs}, and there is no setpriv to drop that here")
    drop = "-dac_override,-dac_read_search"
    return [setpriv, f"--inh-caps={drop}", f"--bounding-set={drop}", "--"]

def _open_fails(config: EngineConfig) -> BaseException:
    async def run() -> None:
        async with Engine.open(config):
            raise AssertionError("the engine opened")

    with pytest.raises(BaseException) as caught:
        trio.run(run)
    return caught.value


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# -- 1. configured paths: ConfigError naming the field, nothing left behind ----------------------------------------
@pytest.mark.parametrize("where", ["under-a-file", "a-file"])
def test_a_spill_dir_that_cannot_be_a_directory_is_a_config_error_naming_it(tmp_path: Path, where: str) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"not a directory")
    spill_dir = plain / "x" if where == "under-a-file" else plain
    error = _open_fails(stub_config(tmp_path / "a.tlog", spill_dir=str(spill_dir)))
    assert isinstance(error, ConfigError), repr(error)
    assert "spill_dir" in str(error) and str(spill_dir) in str(error) and "Not a directory" in str(error)
    assert _tree(tmp_path) == ["plain"]  # no log, no spill directory
    assert plain.read_bytes() == b"not a directory"


def test_spill_dir_dev_null_is_a_config_error_naming_it(tmp_path: Path) -> None:
    error = _open_fails(stub_config(tmp_path / "a.tlog", spill_dir="/dev/null/x"))
    assert isinstance(error, ConfigError), repr(error)
    assert "spill_dir='/dev/null/x'" in str(error) and "Not a directory" in str(error)
    assert _tree(tmp_path) == []


def test_a_spill_dir_that_refuses_writes_is_a_config_error_naming_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only or forbidden directory (the OS's EACCES when the private directory is made in it)."""
    import tempfile

    def refuse(**_kw: Any) -> str:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "spill"))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)  # where the spill store makes its private directory
    error = _open_fails(stub_config(tmp_path / "a.tlog", spill_dir=str(tmp_path / "spill" / "deep")))
    assert isinstance(error, ConfigError), repr(error)
    assert "spill_dir=" in str(error) and "Permission denied" in str(error)
    assert _tree(tmp_path) == []  # the directories it made for spill_dir are gone again


_READ_ONLY_SCRIPT = """
import json, os, sys, trio
from tickloom import ConfigError, Engine, EngineConfig
ro = sys.argv[1]
out = {}
for field, value in (("spill_dir", os.path.join(ro, "spill")), ("spill_dir", ro),
                     ("log_path", os.path.join(ro, "a.tlog"))):
    config = EngineConfig(model="stub", num_blocks=128, max_seq_len=256, **{field: value})
    async def run():
        async with Engine.open(config):
            pass
    try:
        trio.run(run)
        out[field + ":" + value] = "opened"
    except ConfigError as exc:
        out[field + ":" + value] = str(exc)
print(json.dumps(out))
"""


def test_a_read_only_spill_dir_and_log_dir_are_config_errors(tmp_path: Path) -> None:
    """The real thing: a directory this process may not write to (root runs the check without the capability
    that lets it write anywhere)."""
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    prefix = unprivileged("root writes anywhere")
    done = subprocess.run([*prefix, sys.executable, "-c", _READ_ONLY_SCRIPT, str(ro)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert len(results) == 3, results
    for key, message in results.items():
        field = key.split(":", 1)[0]
        assert f"{field}=" in message and "Permission denied" in message, (key, message)
    assert list(ro.iterdir()) == []


def test_a_log_path_under_a_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    error = _open_fails(stub_config(Path("/dev/null/x.tlog")))
    assert isinstance(error, ConfigError) and "log_path='/dev/null/x.tlog'" in str(error)
    assert "Not a directory" in str(error)


def test_a_failed_log_leaves_no_spill_dir_behind(tmp_path: Path) -> None:
    """The spill store is made before the log: when the log then fails, the directories it made go again."""
    spill = tmp_path / "new" / "deeper"
    error = _open_fails(stub_config(tmp_path / "no-such-dir" / "a.tlog", spill_dir=str(spill)))
    assert isinstance(error, ConfigError) and "log_path=" in str(error)
    assert _tree(tmp_path) == []


def test_a_failure_after_the_log_was_created_removes_it_and_the_spill_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "a.tlog"
    spill = tmp_path / "spill"
    kept = tmp_path / "kept"  # a spill_dir that existed before: kept, with nothing of ours in it
    kept.mkdir()

    class Boom(RuntimeError):
        pass

    def failing_core(*_a: Any, **_kw: Any) -> Any:
        raise Boom("the core could not be built")

    monkeypatch.setattr("tickloom.runtime.SchedulerCore", failing_core)
    for spill_dir in (spill, kept):
        error = _open_fails(stub_config(log, spill_dir=str(spill_dir)))
        assert isinstance(error, Boom), repr(error)
        assert _tree(tmp_path) == ["kept"]
    # The same configuration starts once the fault is gone: nothing blocks the paths.
    monkeypatch.setattr("tickloom.runtime.SchedulerCore", SchedulerCore)
    trio.run(_serve, stub_config(log, spill_dir=str(spill)))
    assert verify(log).status == "identical"
    assert spill.is_dir() and list(spill.iterdir()) == []


def test_an_os_error_loading_the_model_is_a_config_error_naming_model(monkeypatch: pytest.MonkeyPatch) -> None:
    import tickloom.engine.model.loaders as model_module

    def unreadable(path: str, *_a: Any, **_kw: Any) -> Any:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), f"{path}/config.json")

    monkeypatch.setattr(model_module, "load_model", unreadable)
    error = _open_fails(EngineConfig(model="/models/locked", num_blocks=64))
    assert isinstance(error, ConfigError), repr(error)
    assert "model='/models/locked'" in str(error) and "Permission denied" in str(error)


# -- 2. a header that cannot be written ----------------------------------------------------------------------------
def _fail_writes_to(path: Path, monkeypatch: pytest.MonkeyPatch, how: str, calls: list[int]) -> None:
    """Make ``os.write`` to the file at ``path`` fail with ENOSPC: raised (``raise``), after a first half is written
    (``partial``), or by the kernel, by writing to /dev/full instead (``dev-full``). Other writes pass."""
    real_write = os.write
    target = os.fspath(path)

    def write(fd: int, data: Any) -> int:
        try:
            ours = os.readlink(f"/proc/self/fd/{fd}") == target
        except OSError:
            ours = False
        if not ours:
            return real_write(fd, data)
        calls.append(len(data))
        if how == "partial" and len(calls) == 1:
            return real_write(fd, bytes(data)[: len(data) // 2])
        if how == "dev-full":
            full = os.open("/dev/full", os.O_WRONLY)
            try:
                return real_write(full, data)
            finally:
                os.close(full)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write)


def _dev_full_usable() -> bool:
    try:
        fd = os.open("/dev/full", os.O_WRONLY)
    except OSError:
        return False
    try:
        os.write(fd, b"x")
    except OSError as exc:
        return exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return False


HOW = ["raise", "partial", pytest.param("dev-full", marks=pytest.mark.skipif(not _dev_full_usable(),
                                                                               reason="no usable /dev/full"))]


@pytest.mark.parametrize("how", HOW)
def test_a_header_write_on_a_full_disk_removes_the_new_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          how: str) -> None:
    path = tmp_path / "full.tlog"
    calls: list[int] = []
    with monkeypatch.context() as patch:
        _fail_writes_to(path, patch, how, calls)
        with pytest.raises(OSError) as caught:
            LogWriter(path, HEADER)
    assert caught.value.errno == errno.ENOSPC and calls
    assert not os.path.lexists(path)  # no 0-byte (or half-header) file blocks the path
    with LogWriter(path, HEADER):  # the retry is not refused
        pass
    with LogReader(path) as reader:
        assert reader.header == HEADER


@pytest.mark.parametrize("how", HOW)
def test_engine_open_on_a_full_disk_is_a_config_error_naming_log_path(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      how: str) -> None:
    log = tmp_path / "full.tlog"
    spill = tmp_path / "spill"
    calls: list[int] = []
    with monkeypatch.context() as patch:
        _fail_writes_to(log, patch, how, calls)
        error = _open_fails(stub_config(log, spill_dir=str(spill)))
    assert isinstance(error, ConfigError), repr(error)
    assert "log_path=" in str(error) and str(log) in str(error) and "No space left on device" in str(error)
    assert _tree(tmp_path) == []
    trio.run(_serve, stub_config(log))  # the path is free again
    assert verify(log).status == "identical"


def test_discard_removes_only_the_file_the_writer_created(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    writer = LogWriter(path, HEADER)
    other = tmp_path / "other"
    other.write_bytes(b"someone else's file")
    os.replace(other, path)  # the path now names another file
    writer.discard()
    assert path.read_bytes() == b"someone else's file"
    writer2 = LogWriter(tmp_path / "b.tlog", HEADER)
    writer2.discard()
    assert not (tmp_path / "b.tlog").exists()


# -- 3. the readers of the command line ---------------------------------------------------------------------------
READERS = [["log", "info"], ["replay"], ["replay", "--bisect"], ["replay", "--until", "3"], ["inspect"], ["whatif"]]


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    status = main(argv)
    captured = capsys.readouterr()
    return status, (captured.out + captured.err).strip().splitlines()


def _bad_input(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    """A path of the ``kind`` of bad input, and what the one line must say."""
    if kind == "missing":
        return tmp_path / "missing.tlog", "no such file"
    if kind == "directory":
        path = tmp_path / "dir.tlog"
        path.mkdir()
        (path / "a.tlog").write_bytes(b"x")
        return path, "is a directory"
    if kind == "empty":
        path = tmp_path / "empty.tlog"
        path.write_bytes(b"")
        return path, "empty"
    if kind == "fifo":  # opened without waiting for a writer that never comes
        path = tmp_path / "fifo.tlog"
        os.mkfifo(path)
        return path, "not a regular file"
    if kind == "garbage":
        path = tmp_path / "garbage.tlog"
        path.write_bytes(b"\x89not a log at all\x00" * 40)
        return path, "byte offset 0"
    assert kind == "unreadable"
    path = tmp_path / "locked.tlog"
    path.write_bytes(b"TLh\x01" + bytes(200))
    path.chmod(0)
    if ROOT:  # root reads any file: the OS's answer to anyone else, injected where the readers open it
        real_open = os.open

        def open_(file: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if os.fspath(file) == str(path):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real_open(file, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", open_)
    return path, "permission denied"


@pytest.mark.parametrize("kind", ["missing", "directory", "unreadable", "empty", "garbage", "fifo"])
@pytest.mark.parametrize("argv", READERS, ids=" ".join)
def test_every_log_reader_exits_2_with_one_line_naming_the_problem(
    argv: list[str], kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path, says = _bad_input(kind, tmp_path, monkeypatch)
    if kind == "fifo":  # a reader that waits for the FIFO's writer would wait forever: fail instead

        def hung(*_a: object) -> None:
            raise AssertionError(f"{' '.join(argv)} waits on a FIFO")

        previous = signal.signal(signal.SIGALRM, hung)
        signal.alarm(60)
        try:
            status, lines = _cli([*argv, str(path)], capsys)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
    else:
        status, lines = _cli([*argv, str(path)], capsys)
    assert status == 2, (status, lines)
    assert len(lines) == 1, lines
    assert str(path) in lines[0] and says in lines[0].lower(), lines
    assert "Traceback" not in lines[0]


@pytest.mark.parametrize("argv", READERS, ids=" ".join)
def test_a_file_this_process_may_not_read_exits_2(argv: list[str], tmp_path: Path) -> None:
    """The real thing, through the installed entry point (root runs it without the capability to read anything)."""
    path = tmp_path / "locked.tlog"
    trio.run(_serve, stub_config(path), 1)
    path.chmod(0)
    prefix = unprivileged("root reads anything")
    done = subprocess.run([*prefix, sys.executable, "-m", "tickloom", *argv, str(path)], capture_output=True,
                          text=True, timeout=120, check=False)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2, (done.returncode, lines)
    assert len(lines) == 1 and str(path) in lines[0] and "permission denied" in lines[0].lower(), lines


@pytest.mark.parametrize("argv", [["replay"], ["whatif"]], ids=" ".join)
def test_a_fleet_directory_is_still_a_legitimate_input(argv: list[str], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from test_fleet_whatif import synthetic_fleet

    fleet = tmp_path / "fleet"
    synthetic_fleet(fleet, requests=6, families=2, replicas=2)
    status, lines = _cli([*argv, str(fleet)], capsys)
    assert status == 0, lines
    assert not any("is a directory" in line for line in lines)


# -- 4. a zero tail: bounded memory, the torn end -----------------------------------------------------------------
@pytest.fixture(scope="module")
def good_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("zero-tail") / "good.tlog"
    trio.run(_serve, stub_config(path, snapshot_every=4), 4)
    return path


def _with_zero_tail(good: Path, out: Path, tail: int) -> Path:
    out.write_bytes(good.read_bytes())
    with open(out, "r+b") as f:
        f.truncate(good.stat().st_size + tail)  # sparse: costs no disk
    return out


def _summary(path: Path) -> tuple[str, int, int, int | None, list[int]]:
    report = verify(path)
    with LogReader(path) as reader:
        ticks = [r.inputs.tick for r in reader.records() if isinstance(r, TickRecord)]
    return report.status, report.ticks, report.rows, report.first_divergent_tick, ticks


def test_a_zero_tail_is_the_torn_end_and_the_verdict_is_unchanged(good_log: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    size = good_log.stat().st_size
    tailed = _with_zero_tail(good_log, tmp_path / "tailed.tlog", 4 * GiB)
    assert _summary(tailed) == _summary(good_log)
    assert _summary(good_log)[0] == "identical"
    assert verify(tailed).torn_bytes == 4 * GiB
    status, lines = _cli(["log", "info", str(tailed)], capsys)
    assert status == 0 and any(f"torn tail: {4 * GiB} bytes" in line for line in lines), lines
    assert _cli(["replay", str(tailed)], capsys)[0] == 0
    recovery = recover_log(tailed)
    assert recovery.bytes_dropped == 4 * GiB and tailed.stat().st_size == size
    assert tailed.read_bytes() == good_log.read_bytes()


def test_a_torn_last_frame_then_zeros_is_a_torn_tail(good_log: Path, tmp_path: Path) -> None:
    """A crash mid-append into space already zeroed (preallocated): the frame's header is whole, its payload is
    not, zeros follow. As with a frame cut at the end of the file, only that frame is dropped."""
    data = good_log.read_bytes()
    with LogReader(good_log) as reader:
        last = list(reader.frames())[-1]
    cut = last.offset + HEADER_SIZE + last.length // 2
    path = tmp_path / "torn-zeros.tlog"
    path.write_bytes(data[:cut] + bytes(len(data) - cut + 4096))
    cut_only = tmp_path / "torn.tlog"
    cut_only.write_bytes(data[:cut])
    assert _summary(path)[:4] == _summary(cut_only)[:4]
    assert verify(path).status == "identical"
    # Not zeros after the damaged frame: still corruption, at its offset.
    junk = tmp_path / "torn-junk.tlog"
    junk.write_bytes(data[:cut] + bytes(len(data) - cut) + b"\x01" + bytes(100))
    report = verify(junk)
    assert report.status == "unreadable" and report.byte_offset == last.offset


_BOUNDED_SCRIPT = """
import json, resource, sys
limit, path, scan = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "scan"
if limit:
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
from tickloom.events import LogReader, TickRecord
from tickloom.replay import verify
if scan:  # no help from the file system's holes: every byte of the tail is read and looked at
    try:
        from tickloom.events.frames import FileBytes
    except ImportError:  # a reader without it has no hole skipping to turn off
        pass
    else:
        FileBytes.next_data = lambda self, offset: offset
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
report = verify(path)
with LogReader(path) as reader:
    ticks = sum(isinstance(r, TickRecord) for r in reader.records())
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"status": report.status, "ticks": ticks, "torn": report.torn_bytes, "error": report.error,
                  "grew_mb": grew / 1024}))
"""


def _bounded(path: Path, limit: int, scan: bool) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_BOUNDED_SCRIPT), str(limit), str(path),
                           "scan" if scan else "holes"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_a_4_gib_zero_tail_reads_under_a_1_5_gib_address_space_limit(good_log: Path, tmp_path: Path) -> None:
    tailed = _with_zero_tail(good_log, tmp_path / "tailed.tlog", 4 * GiB)
    with LogReader(good_log) as reader:
        ticks = sum(isinstance(r, TickRecord) for r in reader.records())
    result = _bounded(tailed, int(1.5 * GiB), scan=False)
    assert (result["status"], result["ticks"], result["torn"]) == ("identical", ticks, 4 * GiB), result


def test_scanning_a_1_gib_zero_tail_byte_by_byte_stays_in_bounded_memory(good_log: Path, tmp_path: Path) -> None:
    tailed = _with_zero_tail(good_log, tmp_path / "tailed.tlog", GiB)
    result = _bounded(tailed, 0, scan=True)
    assert (result["status"], result["torn"]) == ("identical", GiB), result
    assert result["grew_mb"] < 200, result
