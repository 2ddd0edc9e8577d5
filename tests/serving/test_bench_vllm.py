"""`overstory bench serve` with the vLLM engine: it lives beside the package's one cpu-vllm stack (conftest.py), which
it measures instead of starting a second vLLM server; the bench's other checks are in tests/bench/test_serve.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from overstory.bench import serve as bench
from overstory.serving.config import ServeConfig
from overstory.serving.launch import VllmStack
from tests.bench.test_serve import check_bench, run_bench


@pytest.mark.vllm
def test_bench_embedded_against_vllm(tmp_path: Path, cpu_vllm_stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's vLLM engine is the package's cpu-vllm stack (conftest.py; starting a second vLLM server would take
    another minute or more): the bench asks for a stack, which is checked to be one the package's stack serves (the
    same model for the benchmarked role, the bench's vLLM flags and environment among the stack's), and measures it.
    Starting a stack from a config is what the package's stack itself does, through the same ``vllm_stack``."""
    stack, shared = cpu_vllm_stack
    asked: list[ServeConfig] = []

    @contextmanager
    def package_stack(config: ServeConfig) -> Iterator[VllmStack]:
        asked.append(config)
        role, served = config.roles["generator"], shared.roles["generator"]
        assert (role.model, role.dtype, role.adapter) == (served.model, served.dtype, served.adapter)
        assert all(arg in shared.vllm_args for arg in config.vllm_args) and config.vllm_env == shared.vllm_env
        yield stack

    monkeypatch.setattr(bench, "vllm_stack", package_stack)
    result = run_bench(tmp_path, "configs/bench/serve-vllm.yaml", "serve.vllm_env={VLLM_CPU_KVCACHE_SPACE: '1'}",
                    f"serve.api_key={shared.api_key}")  # the package's stack wants its key
    check_bench(result, ["embedded", "vllm"], tmp_path)
    # one stack asked for: the benchmarked chat role on vLLM, the embedder kept for the load mix, logs in the run
    assert len(asked) == 1 and asked[0].engine == "vllm" and set(asked[0].roles) == {"generator", "embedder"}
    assert asked[0].roles["embedder"].kind == "embedding" and asked[0].log_dir == str(tmp_path / "logs")
