"""A Hugging Face-format checkpoint directory on disk: reading its weights (contained), checking and
fingerprinting them, and writing a directory atomically (temp dir, then rename).

Reading is contained: it reads only files inside the model directory (an index's shard names and every symlink
are checked, see ``contained``), and it never runs code from a checkpoint: weights are safetensors only (no
pickle, no ``torch.load``), the tokenizer is ``tokenizer.json``, the chat template runs in jinja's sandbox, and
``auto_map`` / remote code in ``config.json`` is never imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from tickloom.engine.model.config import ModelConfig
from tickloom.engine.model.errors import ModelLoadError
from tickloom.engine.model.llama import expected_shapes


def write_checkpoint_files(
    out_dir: Path,
    cfg: ModelConfig,
    tensors: dict[str, torch.Tensor] | None,
    tokenizer: Tokenizer,
    tokenizer_config: dict[str, Any],
    torch_dtype: str = "float32",
) -> None:
    """Write config.json, model.safetensors (unless ``tensors`` is None: a GGUF's cache entry, whose weights stay
    in the file), tokenizer.json, tokenizer_config.json and generation_config.json into an existing directory."""
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = torch_dtype
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True), encoding="utf-8")
    if tensors is not None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
                  metadata={"format": "pt"})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, sort_keys=True), encoding="utf-8"
    )
    gen: dict[str, Any] = {"bos_token_id": cfg.bos_token_id}
    if cfg.eos_token_ids:
        gen["eos_token_id"] = list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_ids[0]
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")


def write_checkpoint_atomic(
    out_dir: Path,
    cfg: ModelConfig,
    tensors: dict[str, torch.Tensor] | None,
    tokenizer: Tokenizer,
    tokenizer_config: dict[str, Any],
    torch_dtype: str = "float32",
    finish: Callable[[Path], None] | None = None,
) -> Path:
    """Write the checkpoint into a sibling temp dir, then rename it into place. If another process
    won the race, its complete copy is kept. ``finish(temp_dir)`` may add files before the rename."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write_checkpoint_files(tmp, cfg, tensors, tokenizer, tokenizer_config, torch_dtype)
        if finish is not None:
            finish(tmp)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


CHECKPOINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                    "chat_template.jinja")
"""The files besides the weights that loading reads; each must stay inside the model directory too."""


def _allowed_roots(root: Path) -> list[Path]:
    """Where a model directory's files may live: the directory itself and, for a Hugging Face hub cache snapshot
    (``models--org--name/snapshots/<rev>/``, whose files are symlinks to ``../../blobs/<hash>``), that repo's
    ``blobs`` directory."""
    roots = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        roots.append(root.parent.parent / "blobs")
    return roots


def contained(model_dir: Path, name: object, source: Path | None = None) -> Path:
    """``model_dir / name``, refused (``ModelLoadError``) unless it stays inside the model directory.

    ``name`` must be a relative path without ``..`` (so an index cannot name ``/etc/passwd`` or ``../other``),
    and the file it resolves to, through any symlinks, must lie inside the directory (or its hub cache's
    ``blobs``). ``source`` is the file that named it, for the message.
    """
    where = source or model_dir
    if not isinstance(name, str) or not name:
        raise ModelLoadError(where, f"file name {name!r} must be a non-empty string")
    if "\x00" in name:
        raise ModelLoadError(where, f"file name {name!r} contains a NUL byte")
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or windows.root:
        raise ModelLoadError(where, f"file {name!r} is an absolute path; it must be inside the model directory")
    if ".." in posix.parts or ".." in windows.parts:
        raise ModelLoadError(where, f"file {name!r} leaves the model directory ('..')")
    root = model_dir.resolve()
    path = model_dir / name
    target = path.resolve()
    if not any(target.is_relative_to(r) for r in _allowed_roots(root)):
        raise ModelLoadError(where, f"file {name!r} resolves to {target}, outside the model directory {root} "
                                    "(a symlink escapes it)")
    return path


def _shard_files(model_dir: Path) -> list[Path]:
    index = contained(model_dir, "model.safetensors.index.json")
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(index, f"bad safetensors index: {exc!r}") from exc
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(index, "bad safetensors index: weight_map must be a non-empty object")
        names = set(weight_map.values())
        for name in names:
            if not isinstance(name, str) or not name.endswith(".safetensors"):
                raise ModelLoadError(index, f"shard {name!r} in weight_map is not a .safetensors file name")
        files = sorted(contained(model_dir, name, index) for name in names)
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f, "shard named in model.safetensors.index.json is missing")
        return files
    files = sorted(contained(model_dir, f.name) for f in model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(model_dir, "no *.safetensors weights found")
    return files


def read_safetensors(model_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors of a checkpoint directory and, per tensor, the file it came from."""
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in _shard_files(model_dir):
        size = f.stat().st_size
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensors[name] = sf.get_tensor(name)
                    origin[name] = f
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f, f"truncated or corrupt safetensors file ({size} bytes): {exc}") from exc
    return tensors, origin


def check_tensors(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], origin: dict[str, Path], where: Path
) -> dict[str, torch.Tensor]:
    """The tensors the architecture needs, checked for presence and shape."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        t = tensors.get(name)
        if t is None:
            raise ModelLoadError(where, f"missing tensor {name!r}")
        if tuple(t.shape) != shape:
            raise ModelLoadError(
                origin.get(name, where), f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}"
            )
        if not t.is_floating_point():
            raise ModelLoadError(origin.get(name, where), f"tensor {name!r} has non-float dtype {t.dtype}")
        out[name] = t
    return out


def fingerprint(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> str:
    """blake2b over the canonical config and every weight's name, dtype, shape and bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).reshape(-1).numpy().data if t.numel() else b"")
    return h.hexdigest()


def fingerprint_files(model_dir: Path) -> list[str]:
    """The files a weight fingerprint depends on, relative to the directory: config.json, the shard index and
    the shards."""
    names = ["config.json", *(str(f.relative_to(model_dir)) for f in _shard_files(model_dir))]
    if (model_dir / "model.safetensors.index.json").is_file():
        names.append("model.safetensors.index.json")
    return names
