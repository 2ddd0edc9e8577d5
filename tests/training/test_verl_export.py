"""verl export round trip and the verl reward entry (structural: verl itself lives in its own environment)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from overstory.cli import main
from overstory.core.config import ConfigError, load_config
from overstory.models.planner import plan_json
from overstory.models.registry import load_tokenizer
from overstory.training.rewards import align_reward, format_reward, make_cost_reward, make_length_reward
from overstory.training.verl.export import VerlExportConfig
from overstory.training.verl.reward import compute_score

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_export_round_trip_and_reward_entry(planner_labels: Path, planner_traces: Path, tmp_path: Path) -> None:
    out = tmp_path / "verl"
    assert main(["data", "verl-export", "--config", str(ROOT / "configs/verl/planner_export.yaml"),
                 f"data.labels={planner_labels}",
                 "data.metadata_tokens=64", f"traces={planner_traces}", f"out={out}"]) == 0
    train, val, sft = (pd.read_parquet(out / f"{name}.parquet") for name in ("train", "val", "sft"))
    assert len(train) + len(val) == 24 and len(sft) == 24
    assert not set(train.extra_info.map(lambda e: e["doc_id"])) & set(val.extra_info.map(lambda e: e["doc_id"]))
    row = train.iloc[0]
    assert row.data_source == "overstory/smartchunk_planner" and list(row.prompt[0]) == ["role", "content"]
    assert row.prompt[0]["role"] == "system" and "Question:" in row.prompt[1]["content"]
    truth = dict(row.reward_model["ground_truth"])
    assert sft.iloc[0].messages[-1]["role"] == "assistant"

    info = {k: (dict(v) if isinstance(v, dict) else v) for k, v in dict(row.extra_info).items()}
    reply = f"Short reason.\n{plan_json(truth['level_min'], truth['level_max'])}"
    result = compute_score(row.data_source, reply, truth, info)
    weights = info["reward_weights"]
    ids = load_tokenizer(info["tokenizer"])(reply, add_special_tokens=False)["input_ids"]
    terms = {"format": format_reward([reply])[0],
             "length": make_length_reward(weights["max_completion_tokens"])([reply], completion_ids=[ids])[0],
             "align": align_reward([reply], level_min=[truth["level_min"]], level_max=[truth["level_max"]])[0],
             "cost": make_cost_reward(weights["k"])([reply], level_tokens=[info["level_tokens"]])[0]}
    assert result["score"] == pytest.approx(sum(weights[name] * value for name, value in terms.items()))
    assert result["align"] == 1.0 and result["format"] == 1.0
    assert compute_score(row.data_source, "no plan", truth, info)["score"] < result["score"]


def test_launch_script_names_the_reward_entry_and_dapo_settings() -> None:
    script = (ROOT / "scripts/verl_planner_grpo.sh").read_text()
    for setting in ("python -m verl.trainer.main_ppo", "algorithm.adv_estimator=grpo", "custom_reward_function.name="
                    "compute_score", "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.rollout.n=8",
                    "data.train_batch_size=256", "actor_rollout_ref.actor.ppo_mini_batch_size=64"):
        assert setting in script, setting
    assert (ROOT / "training/verl/reward.py").exists() and "training/verl/reward.py" in script


def test_r_qa_is_refused_by_the_export_and_the_reward_entry() -> None:
    """verl's reward entry has no generator for R_QA: a weight on it is refused, not stored and dropped."""
    with pytest.raises(ConfigError, match="rewards.qa .1.0.: verl's reward entry"):
        load_config(VerlExportConfig, ROOT / "configs/verl/planner_export.yaml", ["rewards.qa=1.0"])
    truth = {"level_min": "sentence", "level_max": "paragraph"}
    with pytest.raises(ValueError, match="cannot compute R_QA"):
        compute_score("overstory/smartchunk_planner", plan_json("sentence", "paragraph"), truth,
                      {"reward_weights": {"format": 1.0, "qa": 0.5}})
    assert compute_score("overstory/smartchunk_planner", plan_json("sentence", "paragraph"), truth,
                         {"reward_weights": {"format": 1.0, "qa": 0.0}})["score"] == 1.0
