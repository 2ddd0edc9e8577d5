"""`overstory bench serve` in a short mode: every engine measured side by side, ratios, the bounded mixed load
(bench/load.py) on each HTTP engine, JSON, PNG. The vLLM engine's run is in tests/serving/test_bench_vllm.py, beside
the suite's one cpu-vllm stack."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.bench.serve import ServeBenchConfig
from overstory.cli import main
from overstory.core.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def run_bench(out: Path, config: str, *extra: str) -> dict:
    assert main(["bench", "serve", "--config", str(ROOT / config), f"out={out}", "concurrency=[1, 2]",
                 "requests_per_level=2", "max_tokens=4", "load_requests=40", "load_concurrency=8",
                 "tracking.backend=none", f"questions={ROOT / 'data/hotpotqa/questions.json'}", *extra]) == 0
    return json.loads((out / "bench.json").read_text())


def check_bench(result: dict, engines: list[str], out: Path) -> None:
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
    check_bench(run_bench(tmp_path, "configs/bench/serve.yaml"), ["in_process", "embedded"], tmp_path)


def test_bad_engine_lists_are_named() -> None:
    with pytest.raises(ConfigError, match="engines"):
        load_config(ServeBenchConfig, overrides=["engines=[embedded, tgi]"])
    with pytest.raises(ConfigError, match="engines"):
        load_config(ServeBenchConfig, overrides=["engines=[]"])
    with pytest.raises(ConfigError, match="load_time_limit_s"):
        load_config(ServeBenchConfig, overrides=["load_time_limit_s=0"])
