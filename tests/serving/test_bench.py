"""`overstory bench serve` in a short mode: both engines measured, JSON and PNG written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_serve_short(tmp_path: Path) -> None:
    code = main(["bench", "serve", "--config", str(ROOT / "configs/bench/serve.yaml"), f"out={tmp_path}",
                 "concurrency=[1, 2]", "requests_per_level=2", "max_tokens=4", "tracking.backend=none",
                 f"questions={ROOT / 'data/hotpotqa/questions.json'}"])
    assert code == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for row in rows:
        for engine in ("in_process", "http"):
            assert row[engine]["requests"] == 2 and row[engine]["requests_per_s"] > 0
            assert row[engine]["p95_s"] >= row[engine]["p50_s"] > 0
        assert row["throughput_ratio"] == pytest.approx(
            row["http"]["requests_per_s"] / row["in_process"]["requests_per_s"], rel=1e-2)
    assert (tmp_path / "bench.png").stat().st_size > 5_000
