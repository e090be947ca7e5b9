"""Writing a Hugging Face-format checkpoint directory, atomically (temp dir, then rename)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from tickloom.engine.model.config import ModelConfig


def write_checkpoint_files(
    out_dir: Path,
    cfg: ModelConfig,
    tensors: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    tokenizer_config: dict[str, Any],
    torch_dtype: str = "float32",
) -> None:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
    generation_config.json into an existing directory."""
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = torch_dtype
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True), encoding="utf-8")
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"}
    )
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
    tensors: dict[str, torch.Tensor],
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
