"""One embedded server with the real built-in models for the whole serving test package."""

from __future__ import annotations

from pathlib import Path

import pytest

from overstory.serving.config import ServeConfig
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.launch import serve_in_background

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def engine() -> EmbeddedEngine:
    return EmbeddedEngine(ServeConfig.local(port=0))


@pytest.fixture(scope="session")
def server_url(engine: EmbeddedEngine):
    with serve_in_background(engine) as url:
        yield url


@pytest.fixture(scope="session")
def planner_adapter(planner_traces, tmp_path_factory):
    """A LoRA adapter from a short real planner_sft run (lr high enough that it visibly moves the model)."""
    from overstory.cli import main

    out = tmp_path_factory.mktemp("planner_adapter")
    assert main(["train", "planner_sft", "--config", str(ROOT / "configs/train/planner_sft.yaml"),
                 f"traces={planner_traces}", f"out={out}", "train.max_steps=3", "train.lr=1e-3",
                 "train.batch_size=4", "train.max_length=384", "train.val_fraction=0", "tracking.backend=none"]) == 0
    return str(out / "final")
