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
def planner_adapter(sft_planner) -> str:
    """A LoRA adapter from a short real planner_sft run (the session's ``sft_planner``: its high learning rate
    visibly moves the model)."""
    return str(sft_planner / "final")
