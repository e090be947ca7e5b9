"""Test-wide settings: one torch thread (when torch is installed) and no network for Hugging Face."""

from __future__ import annotations

import importlib.util
import os

os.environ["HF_HUB_OFFLINE"] = "1"

if importlib.util.find_spec("torch") is not None:
    import torch

    torch.set_num_threads(1)
