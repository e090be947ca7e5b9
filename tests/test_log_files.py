"""Log files are new files: never overwritten, never reached through a symlink, never chmodded unless created.

``LogWriter`` opens with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600; ``Engine.open`` turns a taken
``log_path`` into ``ConfigError``, and ``tickloom generate --log`` into exit 64.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import trio
from engine_helpers import stub_config

from tickloom import ConfigError, Engine
from tickloom.events import FORMAT_VERSION, SCHEMA_HASH, LogError, LogExists, LogHeader, LogReader, LogWriter
from tickloom.events.digest import DIGEST_VERSION
from tickloom.tools.cli import EX_USAGE, main

HEADER = LogHeader(FORMAT_VERSION, SCHEMA_HASH, DIGEST_VERSION, "test", '{"test": true}')
PRECIOUS = b"an old log: evidence, not scratch space\n" * 100


def _precious(path: Path, mode: int = 0o644) -> Path:
    path.write_bytes(PRECIOUS)
    path.chmod(mode)
    return path


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_existing_log_is_refused_and_left_byte_for_byte(tmp_path: Path) -> None:
    path = _precious(tmp_path / "old.tlog")
    before = path.stat()
    with pytest.raises(LogExists) as caught:
        LogWriter(path, HEADER)
    assert isinstance(caught.value, LogError) and isinstance(caught.value, FileExistsError)
    assert f"log_path={str(path)!r} already exists" in str(caught.value)
    assert "never overwrites" in str(caught.value)
    after = path.stat()
    assert path.read_bytes() == PRECIOUS
    assert (after.st_mode, after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_mode, before.st_size, before.st_mtime_ns, before.st_ino)


def test_an_empty_existing_file_is_refused_too(tmp_path: Path) -> None:
    path = tmp_path / "empty.tlog"
    path.touch(mode=0o644)
    with pytest.raises(LogExists):
        LogWriter(path, HEADER)
    assert path.read_bytes() == b"" and _mode(path) == 0o644


def test_a_symlink_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = _precious(tmp_path / "target.txt", 0o644)
    link = tmp_path / "link.tlog"
    link.symlink_to(target)
    with pytest.raises(LogExists, match="is a symlink"):
        LogWriter(link, HEADER)
    assert target.read_bytes() == PRECIOUS and _mode(target) == 0o644
    assert link.is_symlink()


def test_a_dangling_symlink_is_refused_and_creates_nothing(tmp_path: Path) -> None:
    target = tmp_path / "would-be-created.txt"
    link = tmp_path / "dangling.tlog"
    link.symlink_to(target)
    with pytest.raises(LogExists, match="is a symlink"):
        LogWriter(link, HEADER)
    assert not target.exists() and link.is_symlink()


def test_a_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dir.tlog"
    path.mkdir()
    with pytest.raises(LogExists):
        LogWriter(path, HEADER)
    assert path.is_dir()


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_a_new_log_is_0600_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    path = tmp_path / "new.tlog"
    old = os.umask(umask)
    try:
        LogWriter(path, HEADER).close()
    finally:
        os.umask(old)
    assert _mode(path) == 0o600
    with LogReader(path) as reader:
        assert reader.header == HEADER


def test_engine_open_with_an_existing_log_path_is_a_config_error(tmp_path: Path) -> None:
    path = _precious(tmp_path / "old.tlog")

    async def run() -> None:
        async with Engine.open(stub_config(path)):
            raise AssertionError("the engine opened over an existing log")

    with pytest.raises(ConfigError, match=r"log_path=.*already exists") as caught:
        trio.run(run)
    assert str(path) in str(caught.value)
    assert path.read_bytes() == PRECIOUS and _mode(path) == 0o644


def test_the_writer_refuses_atomically_behind_the_early_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A log that appears after ``Engine.open``'s early check (a race) is still refused, by ``O_EXCL``."""
    import tickloom.runtime as runtime_module

    path = tmp_path / "late.tlog"
    monkeypatch.setattr(runtime_module, "_check_log_path", lambda _path: _precious(path))

    async def run() -> None:
        async with Engine.open(stub_config(path)):
            raise AssertionError("the engine opened over an existing log")

    with pytest.raises(ConfigError, match=r"log_path=.*already exists"):
        trio.run(run)
    assert path.read_bytes() == PRECIOUS and _mode(path) == 0o644


def test_engine_open_with_a_symlinked_log_path_is_a_config_error(tmp_path: Path) -> None:
    target = _precious(tmp_path / "target.txt")
    link = tmp_path / "link.tlog"
    link.symlink_to(target)

    async def run() -> None:
        async with Engine.open(stub_config(link)):
            raise AssertionError("the engine opened through a symlink")

    with pytest.raises(ConfigError, match=r"log_path=.*is a symlink"):
        trio.run(run)
    assert target.read_bytes() == PRECIOUS and _mode(target) == 0o644


def test_engine_open_with_an_uncreatable_log_path_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "no-such-dir" / "a.tlog"

    async def run() -> None:
        async with Engine.open(stub_config(path)):
            raise AssertionError("the engine opened without its log")

    with pytest.raises(ConfigError, match=r"log_path=.*cannot be created"):
        trio.run(run)


def test_generate_with_an_existing_log_exits_64(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _precious(tmp_path / "old.tlog")
    status = main(["generate", "--model", "stub", "--max-tokens", "4", "--log", str(path), "hello"])
    assert status == EX_USAGE
    err = capsys.readouterr().err
    assert f"log_path={str(path)!r} already exists" in err and "Traceback" not in err
    assert path.read_bytes() == PRECIOUS


def test_log_demo_with_an_existing_path_exits_64(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _precious(tmp_path / "old.tlog")
    assert main(["log", "demo", str(path)]) == EX_USAGE
    assert "never overwrites" in capsys.readouterr().err
    assert path.read_bytes() == PRECIOUS


def test_the_demo_script_removes_only_its_own_previous_log() -> None:
    script = (Path(__file__).parent.parent / "scripts" / "demo.sh").read_text(encoding="utf-8")
    assert "rm -f demo.tlog" in script
    assert script.index("rm -f demo.tlog") < script.index("--log demo.tlog")
