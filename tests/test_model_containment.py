"""Model loading is contained: it reads only files inside the model directory, and never executes checkpoint code."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tickloom.engine.model.checkpoint import CHECKPOINT_FILES, contained
from tickloom.engine.model.errors import ModelLoadError
from tickloom.engine.model.loaders import load_model
from tickloom.engine.model.tiny import write_tiny_model

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", seed=3)


@pytest.fixture
def tiny_dir(tiny_src: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(tiny_src, out)
    return out


def shard(model_dir: Path, names: dict[str, str]) -> dict[str, str]:
    """Split ``model.safetensors`` in two shards at the given (relative or absolute) locations; write the index."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    keys = sorted(tensors)
    weight_map: dict[str, str] = {}
    for (name, location), part in zip(names.items(), (keys[::2], keys[1::2]), strict=True):
        target = Path(location) if Path(location).is_absolute() else model_dir / location
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: tensors[k] for k in part}, str(target))
        weight_map.update({k: name for k in part})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weight_map


def test_a_sharded_index_inside_the_directory_loads(tiny_dir: Path) -> None:
    shard(tiny_dir, {"a.safetensors": "a.safetensors", "sub/b.safetensors": "sub/b.safetensors"})
    assert load_model(tiny_dir).config.vocab_size == 512


def test_an_absolute_shard_path_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere" / "b.safetensors"
    shard(tiny_dir, {"a.safetensors": "a.safetensors", str(outside): str(outside)})
    assert outside.is_file()
    with pytest.raises(ModelLoadError, match="absolute path") as info:
        load_model(tiny_dir)
    assert "model.safetensors.index.json" in str(info.value), "the message names the index"


def test_a_dotdot_shard_path_is_refused(tiny_dir: Path) -> None:
    shard(tiny_dir, {"a.safetensors": "a.safetensors", "../b.safetensors": "../b.safetensors"})
    assert (tiny_dir.parent / "b.safetensors").is_file()
    with pytest.raises(ModelLoadError, match=r"leaves the model directory \('\.\.'\)"):
        load_model(tiny_dir)


@pytest.mark.parametrize("name", ["sub/../../b.safetensors", "..\\b.safetensors", "C:\\b.safetensors", "",
                                  "a.bin", 7, None])
def test_other_bad_shard_names_are_refused(tiny_dir: Path, name: Any) -> None:
    shard(tiny_dir, {"a.safetensors": "a.safetensors", "b.safetensors": "b.safetensors"})
    index = tiny_dir / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    weight_map[next(iter(weight_map))] = name
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError):
        load_model(tiny_dir)


@pytest.mark.parametrize("index", [{"weight_map": []}, {"weight_map": {}}, {"weight_map": "x"}, [], {"x": 1}])
def test_a_malformed_index_is_refused(tiny_dir: Path, index: Any) -> None:
    (tiny_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="bad safetensors index"):
        load_model(tiny_dir)


def test_a_symlinked_shard_escaping_the_directory_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    shard(tiny_dir, {"a.safetensors": "a.safetensors", "b.safetensors": str(outside / "b.safetensors")})
    (tiny_dir / "b.safetensors").symlink_to(outside / "b.safetensors")
    with pytest.raises(ModelLoadError, match="a symlink escapes it"):
        load_model(tiny_dir)


def test_an_unindexed_symlinked_weight_file_escaping_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(str(tiny_dir / "model.safetensors"), outside / "model.safetensors")
    (tiny_dir / "model.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(ModelLoadError, match="outside the model directory"):
        load_model(tiny_dir)


def test_a_symlinked_directory_escaping_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    shard(tiny_dir, {"a.safetensors": "a.safetensors", "sub/b.safetensors": str(outside / "b.safetensors")})
    (tiny_dir / "sub").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ModelLoadError, match="outside the model directory"):
        load_model(tiny_dir)


@pytest.mark.parametrize("name", CHECKPOINT_FILES[:3])
def test_symlinked_config_and_tokenizer_files_escaping_are_refused(tiny_dir: Path, tmp_path: Path,
                                                                   name: str) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(str(tiny_dir / name), outside / name)
    (tiny_dir / name).symlink_to(outside / name)
    with pytest.raises(ModelLoadError, match=re.escape(name)):
        load_model(tiny_dir)


def test_symlinks_inside_the_directory_and_into_a_hub_cache_blobs_dir_are_fine(tiny_src: Path,
                                                                                tmp_path: Path) -> None:
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in tiny_src.iterdir():  # the hub cache layout: every file a symlink to ../../blobs/<hash>
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    assert load_model(snapshot).fingerprint == load_model(tiny_src).fingerprint
    # ... but not into another repo's blobs, nor from a directory that merely looks like a snapshot.
    assert contained(snapshot, "model.safetensors") == snapshot / "model.safetensors"
    (snapshot / "x.safetensors").symlink_to(tmp_path / "models--other" / "blobs" / "x")
    with pytest.raises(ModelLoadError, match="outside the model directory"):
        contained(snapshot, "x.safetensors")


def test_pickled_weights_are_never_loaded(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``pytorch_model.bin`` (a pickle) is not a checkpoint here; unpickling would run arbitrary code."""
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    (tiny_dir / "model.safetensors").unlink()
    with open(tiny_dir / "pytorch_model.bin", "wb") as f:
        pickle.dump({k: v.numpy() for k, v in tensors.items()}, f)

    def forbidden(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("loading tried to unpickle")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights found"):
        load_model(tiny_dir)


def test_remote_code_in_config_is_never_run(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran"
    (tiny_dir / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    config = json.loads((tiny_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    config["trust_remote_code"] = True
    (tiny_dir / "config.json").write_text(json.dumps(config))
    monkeypatch.syspath_prepend(str(tiny_dir))
    monkeypatch.setattr(torch, "load", lambda *_a, **_k: pytest.fail("torch.load was called"))
    load_model(tiny_dir)
    assert not marker.exists(), "checkpoint code ran"


def test_the_chat_template_runs_sandboxed(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (tiny_dir / "tokenizer_config.json").write_text(json.dumps(config))
    lm = load_model(tiny_dir)
    with pytest.raises(ValueError, match="chat template refused"):
        lm.tokenizer.render_chat([{"role": "user", "content": "hi"}])


def test_the_source_never_unpickles_or_trusts_remote_code() -> None:
    """No code path can execute a checkpoint: no pickle, no ``torch.load``, no remote code."""
    banned = re.compile(r"\bimport pickle\b|\bpickle\.load|\btorch\.load\(|trust_remote_code\s*=\s*True|"
                        r"allow_pickle\s*=\s*True|\bdill\b|\bcloudpickle\b|\bjoblib\.load")
    hits = []
    for folder in ("engine", "actors", "events", "replay", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if banned.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)
