"""Shared fixtures. Caches point into the tree so tests never reach a hub (they are offline)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OVERSTORY_CACHE", str(ROOT / ".cache" / "overstory"))
os.environ.setdefault("HF_HOME", str(ROOT / ".cache" / "huggingface"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_DIR", str(ROOT / ".cache" / "wandb"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
