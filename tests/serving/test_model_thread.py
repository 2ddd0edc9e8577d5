"""The encoder models' own thread, and the malloc arena cap of the serving process."""

from __future__ import annotations

import platform
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from overstory.core.config import ConfigError
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.model_thread import ModelThread, limit_malloc_arenas


def test_calls_from_many_threads_run_on_one_thread_and_errors_come_back() -> None:
    model_thread = ModelThread("test")
    with ThreadPoolExecutor(8) as pool:
        names = set(pool.map(lambda _: model_thread.run(lambda: threading.current_thread().name), range(32)))
    assert len(names) == 1 and names.pop().startswith("model-test")

    def fails() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        model_thread.run(fails)


def test_malloc_arena_cap_applies_on_glibc_and_is_validated() -> None:
    assert limit_malloc_arenas(2) is (platform.libc_ver()[0] == "glibc")
    with pytest.raises(ConfigError, match="malloc_arena_max"):
        ServeConfig(roles={"generator": RoleConfig(model="x")}, malloc_arena_max=-1)
