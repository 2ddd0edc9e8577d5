"""One embedded server with the real built-in models for the whole serving test package."""

from __future__ import annotations

import pytest

from serving.config import ServeConfig
from serving.engine import EmbeddedEngine
from serving.launch import serve_in_background


@pytest.fixture(scope="session")
def engine() -> EmbeddedEngine:
    return EmbeddedEngine(ServeConfig.local(port=0))


@pytest.fixture(scope="session")
def server_url(engine: EmbeddedEngine):
    with serve_in_background(engine) as url:
        yield url
