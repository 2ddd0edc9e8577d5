"""Real training data made once per test session: SmolLM2 summaries of 30 HotpotQA paragraphs (compressors), and a
short real planner SFT adapter on the template traces (the planner RL recipes start from it)."""

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
                 "limit=30", "max_summary_tokens=24", "tracking.backend=none"])
    assert code == 0
    return out


@pytest.fixture(scope="session")
def sft_planner(planner_traces: Path, tmp_path_factory) -> Path:
    """A short real planner_sft run on the template traces with a high learning rate: a policy that writes the
    planner's format, so GRPO (in planner_grpo and STITCH) sees rewards that differ within a group. Its
    ``metrics.json`` keeps the loss per step."""
    out = tmp_path_factory.mktemp("sft_planner") / "sft"
    code = main(["train", "planner_sft", "--config", str(ROOT / "configs/train/planner_sft.yaml"),
                 f"traces={planner_traces}", f"out={out}", "train.max_steps=6", "train.batch_size=2", "train.lr=3e-3",
                 "train.warmup_ratio=0", "train.val_fraction=0", "train.max_length=384", "train.logging_steps=1",
                 "tracking.backend=none"])
    assert code == 0
    return out
