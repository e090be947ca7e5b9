"""The model cache: GGUF conversions keyed by content, weight fingerprints stored and read back, ``tickloom models
--cache [--prune [--all]]``, progress lines on stderr. Small GGUF files written by the ``gguf`` package (the real
98 MB one is slow to convert)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from test_model_loaders import write_gguf

from tickloom.engine.model import convert, loaders, registry
from tickloom.engine.model.convert import resolve_model
from tickloom.engine.model.loaders import load_model
from tickloom.engine.model.registry import cache_dir, cache_entries, entry_name, prune_cache
from tickloom.engine.model.tiny import write_tiny_model
from tickloom.tools.cli import main


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TICKLOOM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("gguf")
    return write_gguf(write_tiny_model(tmp / "tiny", seed=3), tmp / "tiny.gguf")


def _no_conversion(*args: object, **kwargs: object) -> Path:
    raise AssertionError("converted again")


def _no_hashing(*args: object, **kwargs: object) -> str:
    raise AssertionError("the weights were hashed")


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last weight's last byte: still a valid file, other weights
    path.write_bytes(bytes(data))


def test_the_cache_key_is_the_content(cache: Path, tiny_gguf: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    first = resolve_model(tiny_gguf)
    assert first.parent == cache / "models" and first.name.startswith("gguf-")
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copyfile(tiny_gguf, copy)
    with monkeypatch.context() as m:
        m.setattr(convert, "convert_gguf", _no_conversion)
        assert resolve_model(copy) == first  # another path, another name, the same bytes: the same entry
        assert resolve_model(tiny_gguf) == first
    _flip_last_byte(copy)
    changed = resolve_model(copy)
    assert changed != first and changed.parent == first.parent
    assert len(list((cache / "models").iterdir())) == 2


def test_a_modified_file_is_hashed_again_even_with_its_old_mtime(cache: Path, tiny_gguf: Path,
                                                                 tmp_path: Path) -> None:
    g = tmp_path / "m.gguf"
    shutil.copyfile(tiny_gguf, g)
    before = resolve_model(g)
    st = g.stat()
    _flip_last_byte(g)
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime; the ctime still moved
    assert resolve_model(g) != before


def test_the_index_spares_a_second_hash(cache: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = registry.content_key(tiny_gguf)
    index = json.loads((cache / "index.json").read_text())
    assert index["files"][str(tiny_gguf.resolve())]["key"] == key

    def no_file_digest(*args: object, **kwargs: object) -> object:
        raise AssertionError("hashed again")

    monkeypatch.setattr(hashlib, "file_digest", no_file_digest)
    assert registry.content_key(tiny_gguf) == key


def test_the_fingerprint_is_stored_with_the_conversion(cache: Path, tiny_gguf: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    converted = resolve_model(tiny_gguf)
    meta = json.loads((converted / "tickloom.json").read_text())
    with monkeypatch.context() as m:  # what a load computes when nothing is stored
        m.setattr(loaders, "_entry_fingerprint", lambda model_dir: None)
        computed = load_model(tiny_gguf).fingerprint
    assert meta["fingerprint"] == computed
    monkeypatch.setattr(loaders, "gguf_fingerprint", _no_hashing)
    assert load_model(tiny_gguf).fingerprint == computed


def test_a_checkpoint_directory_is_fingerprinted_once(cache: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_tiny_model(tmp_path / "tiny", seed=5)
    fp = load_model(model).fingerprint
    with monkeypatch.context() as m:
        m.setattr(loaders, "fingerprint", _no_hashing)
        assert load_model(model).fingerprint == fp
    other = write_tiny_model(tmp_path / "other", seed=6)
    shutil.copyfile(other / "model.safetensors", model / "model.safetensors")  # new weights, same path
    assert load_model(model).fingerprint == load_model(other).fingerprint != fp
    # A user's directory cannot claim a fingerprint with a tickloom.json of its own.
    (model / "tickloom.json").write_text(json.dumps({"fingerprint": "forged", "files": {"model.safetensors": 1}}))
    assert load_model(model).fingerprint != "forged"


def test_an_unwritable_cache_costs_a_hash_not_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TICKLOOM_CACHE", str(blocker / "cache"))  # under a file: every write fails
    model = write_tiny_model(tmp_path / "tiny", seed=5)
    assert load_model(model).fingerprint == load_model(model).fingerprint


def test_models_cache_lists_and_prunes(cache: Path, tiny_gguf: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    kept = resolve_model(tiny_gguf)
    doomed_source = tmp_path / "doomed.gguf"
    shutil.copyfile(tiny_gguf, doomed_source)
    _flip_last_byte(doomed_source)
    doomed = resolve_model(doomed_source)
    legacy = cache / "models" / "smollm2-135m-6fa3f964eb2be4a5"  # the path-keyed layout before this one
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")
    old_partial = cache / "models" / ".gguf-x.abc123"
    old_partial.mkdir()
    long_ago = time.time() - 2 * registry.STALE_TEMP_SECONDS
    os.utime(old_partial, (long_ago, long_ago))
    young_partial = cache / "models" / ".gguf-y.def456"  # a conversion that may be running now
    young_partial.mkdir()

    assert main(["models", "--cache"]) == 0
    out = capsys.readouterr().out
    assert str(cache) in out and "5 entries" in out
    assert kept.name in out and doomed.name in out and legacy.name in out and "legacy" in out
    assert str(tiny_gguf.resolve()) in out
    assert main(["models", "--cache", "--json"]) == 0
    rows = {Path(r["path"]).name: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows[kept.name]["referenced"] and rows[kept.name]["name"] == "tiny"
    assert rows[kept.name]["sources"] == [str(tiny_gguf.resolve())]

    doomed_source.unlink()  # nothing refers to its entry any more
    assert main(["models", "--cache", "--prune"]) == 0
    out = capsys.readouterr().out
    assert "pruned 3 entries" in out
    assert {p.name for p in (cache / "models").iterdir()} == {kept.name, young_partial.name}

    assert main(["models", "--cache", "--prune", "--all"]) == 0
    assert "pruned 1 entries" in capsys.readouterr().out
    assert {p.name for p in (cache / "models").iterdir()} == {young_partial.name}
    assert json.loads((cache / "index.json").read_text())["files"] == {}


def test_models_cache_flags_need_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "--prune"]) == 64
    assert main(["models", "--cache", "--all"]) == 64
    err = capsys.readouterr().err.splitlines()
    assert err == ["tickloom: error: --prune needs --cache", "tickloom: error: --all needs --prune"]


def test_prune_keeps_what_a_venv_uses(cache: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    """Two venvs with their own copy of one GGUF share an entry; removing one copy keeps it."""
    venv_copy = tmp_path / "venv2" / "model.gguf"
    venv_copy.parent.mkdir()
    shutil.copyfile(tiny_gguf, venv_copy)
    entry = resolve_model(tiny_gguf)
    assert resolve_model(venv_copy) == entry
    venv_copy.unlink()
    assert prune_cache() == []
    assert [e.path for e in cache_entries()] == [entry]
    assert entry.name == entry_name(registry.content_key(tiny_gguf))


def test_loading_shows_progress_on_stderr(cache: Path, tiny_gguf: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    g = tmp_path / "p.gguf"
    shutil.copyfile(tiny_gguf, g)
    _flip_last_byte(g)  # a file this cache has not seen
    argv = ["generate", "--model", str(g), "--no-chat", "--max-tokens", "2", "--temperature", "0", "hi"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"loading {g}…" in err
    assert "hashing" in err and "converting p.gguf to the cache (first run only)…" in err
    assert f"loaded {g} in " in err
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "converting" not in err and "hashing" not in err and f"loaded {g} in " in err
    assert cache_dir() == cache
