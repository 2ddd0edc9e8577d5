"""`overstory bench serve` in a short mode: every engine measured side by side, ratios, the bounded mixed load
(serving/load_test.py) on each HTTP engine, JSON, PNG. The vLLM engine is the package's one cpu-vllm stack."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.core.config import ConfigError, load_config
from overstory.serving import bench
from overstory.serving.bench import ServeBenchConfig
from overstory.serving.config import ServeConfig
from overstory.serving.launch import VllmStack

ROOT = Path(__file__).resolve().parents[2]


def _bench(out: Path, config: str, *extra: str) -> dict:
    assert main(["bench", "serve", "--config", str(ROOT / config), f"out={out}", "concurrency=[1, 2]",
                 "requests_per_level=2", "max_tokens=4", "load_requests=40", "load_concurrency=8",
                 "tracking.backend=none", f"questions={ROOT / 'data/hotpotqa/questions.json'}", *extra]) == 0
    return json.loads((out / "bench.json").read_text())


def _check(result: dict, engines: list[str], out: Path) -> None:
    rows = result["results"]
    assert [r["concurrency"] for r in rows] == [1, 2] and result["baseline"] == engines[0]
    for row in rows:
        assert list(row["engines"]) == engines
        for name, m in row["engines"].items():
            assert m["requests"] == 2 and m["requests_per_s"] > 0 and m["p95_s"] >= m["p50_s"] > 0
            assert row["ratios"][name]["throughput"] == pytest.approx(
                m["requests_per_s"] / row["engines"][engines[0]]["requests_per_s"], rel=1e-2)
        assert row["ratios"][engines[0]] == {"throughput": 1.0, "p50": 1.0}
    http_engines = [e for e in engines if e != "in_process"]
    assert list(result["load"]) == http_engines
    for name, load in result["load"].items():
        # 40 mixed requests on the built-in roles (no cross-encoder scorer: no /v1/rerank), all of them sent
        assert load["requests"] == load["sent"] == 40 and not load["time_limited"], name
        assert set(load["by_kind"]) == {"chat", "stream", "completions", "embeddings", "malformed"}
        assert sum(k["sent"] for k in load["by_kind"].values()) == 40
        assert load["failed_valid"] == 0, load["failures"]
        assert load["malformed_not_4xx"] == load["malformed_bad_error_body"] == 0, load["failures"]
        assert load["by_kind"]["malformed"]["sent"] == 4 and len(load["malformed_statuses"]) == 4
        assert all(400 <= s < 500 for statuses in load["malformed_statuses"].values() for s in statuses)
        assert load["health"]["probes"] >= 1 and load["health"]["answered"] == load["health"]["probes"]
        assert load["rss_peak_mib"] >= load["rss_last_quarter_mib"] > 100 and load["requests_per_s"] > 0
    assert (out / "bench.png").stat().st_size > 5_000


@pytest.mark.slow
def test_bench_in_process_against_the_embedded_server(tmp_path: Path) -> None:
    _check(_bench(tmp_path, "configs/bench/serve.yaml"), ["in_process", "embedded"], tmp_path)


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
    result = _bench(tmp_path, "configs/bench/serve-vllm.yaml", "serve.vllm_env={VLLM_CPU_KVCACHE_SPACE: '1'}",
                    f"serve.api_key={shared.api_key}")  # the package's stack wants its key
    _check(result, ["embedded", "vllm"], tmp_path)
    # one stack asked for: the benchmarked chat role on vLLM, the embedder kept for the load mix, logs in the run
    assert len(asked) == 1 and asked[0].engine == "vllm" and set(asked[0].roles) == {"generator", "embedder"}
    assert asked[0].roles["embedder"].kind == "embedding" and asked[0].log_dir == str(tmp_path / "logs")


def test_bad_engine_lists_are_named() -> None:
    with pytest.raises(ConfigError, match="engines"):
        load_config(ServeBenchConfig, overrides=["engines=[embedded, tgi]"])
    with pytest.raises(ConfigError, match="engines"):
        load_config(ServeBenchConfig, overrides=["engines=[]"])
    with pytest.raises(ConfigError, match="load_time_limit_s"):
        load_config(ServeBenchConfig, overrides=["load_time_limit_s=0"])
