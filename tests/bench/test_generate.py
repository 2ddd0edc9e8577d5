"""`overstory bench generate` in a short mode on the CPU: two dtypes of the built-in SmolLM2 side by side, ratios
against the first, the rows the batcher put in each generate call, JSON and PNG; and the config's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.bench.generate import GenerateBenchConfig
from overstory.cli import main
from overstory.core.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_bench_generate_float32_against_bfloat16(tmp_path: Path) -> None:
    assert main(["bench", "generate", "--config", str(ROOT / "configs/bench/generate.yaml"), f"out={tmp_path}",
                 "concurrency=[1, 3]", "requests_per_level=3", "max_tokens=4", "plain_generate=true",
                 "tracking.backend=none",
                 f"questions={ROOT / 'data/hotpotqa/questions.json'}"]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["baseline"] == "float32" and [r["concurrency"] for r in result["results"]] == [1, 3]
    for row in result["results"]:
        assert list(row["variants"]) == ["float32", "bfloat16"]
        base = row["variants"]["float32"]["completion_tokens_per_s"]
        for m in row["variants"].values():
            assert m["requests"] == 3 and m["completion_tokens_per_s"] > 0 and m["p95_s"] >= m["p50_s"] > 0
            # transformers generate alone on the same model and prompts, from the main thread and from a worker
            assert m["plain_generate_tokens_per_s"] > 0 and m["plain_generate_thread_tokens_per_s"] > 0
            assert m["tokens_per_s_ratio"] == pytest.approx(m["completion_tokens_per_s"] / base, rel=1e-2)
            # one request at a time is one row per generate call; three at once share calls
            assert (m["rows_per_generate"] == 1.0) if row["concurrency"] == 1 else (1.0 <= m["rows_per_generate"] <= 3)
    assert (tmp_path / "bench.png").stat().st_size > 5_000


@pytest.mark.parametrize(("overrides", "message"), [
    (["variants={}"], "variants must name at least one variant"),
    (["variants={half: {dtyp: float16}}"], r"variants.half \(or role\): unknown RoleConfig fields \['dtyp'\]"),
    (["variants={eight: {dtype: float8}}"], "variants.eight: dtype must be float32, bfloat16 or float16"),
    (["role={device: gpu}"], "variants.float32: device must be cpu, cuda, cuda:N or auto"),
    (["concurrency=[0]"], "concurrency must list levels >= 1"),
])
def test_bad_generate_bench_configs_are_named(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(GenerateBenchConfig, ROOT / "configs/bench/generate.yaml", overrides)
