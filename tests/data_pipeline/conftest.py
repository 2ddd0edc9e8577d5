"""Fixtures shared by the data pipeline tests: the real default tokenizer, loaded once per session."""

from __future__ import annotations

import pytest

from overstory.data_pipeline.hierarchy import HierarchyConfig, cached_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer (the hierarchy default), as every hierarchy test counts tokens with it."""
    return cached_tokenizer(HierarchyConfig().tokenizer)
