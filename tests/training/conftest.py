"""Real training data made once per test session: SmolLM2 summaries of 30 HotpotQA paragraphs (compressors).

The summaries are generated one request at a time (``concurrency=1``): greedy decoding of a batch depends on what
else is in the batch (padding changes the floating-point sums), so concurrent requests gave summaries, and training
targets, that differed from run to run; alone, each prompt's greedy summary is the same every run."""

from __future__ import annotations

from pathlib import Path

import pytest

from overstory.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def summaries(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("summaries") / "hotpotqa.jsonl"
    code = main(["data", "summaries", "--config", str(ROOT / "configs/data/summaries.yaml"), f"out={out}",
                 "corpus.kind=hotpotqa", f"corpus.path={ROOT / 'data/hotpotqa'}", "levels=[paragraph]",
                 "limit=30", "max_summary_tokens=24", "concurrency=1", "tracking.backend=none"])
    assert code == 0
    return out
