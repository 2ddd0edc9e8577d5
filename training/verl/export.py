"""`overstory data verl-export`: the planner's RL and SFT data in verl's parquet layout.

    overstory data verl-export --config configs/verl/planner_export.yaml

Writes ``train.parquet`` and ``val.parquet`` for ``verl.trainer.main_ppo`` (one row per correct
pseudo-label: ``data_source``, ``prompt`` as chat messages, ``ability``, ``reward_model`` with the label
as ``ground_truth``, and ``extra_info`` with what the reward entry needs: example id, level token
means, reward weights, the tokenizer that counts completion tokens) and, when traces are given,
``sft.parquet`` (``messages``: the planner prompt plus the trace as the assistant turn) for verl's SFT
trainer, the imitation half of a STITCH schedule over verl (``training/verl/README.md``). The split
by document is the same as the TRL recipes'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from overstory.core.config import ConfigError, to_dict
from overstory.core.records import PlannerTrace, read_jsonl
from overstory.data_pipeline.planner_examples import PlannerDataConfig, planner_rows
from overstory.training.planner_common import RewardSettings

DATA_SOURCE = "overstory/smartchunk_planner"


@dataclass(frozen=True)
class VerlExportConfig:
    data: PlannerDataConfig
    out: str
    tokenizer: str = "builtin:smollm2-135m-instruct"  # the policy's tokenizer: prompts and R_length count with it
    traces: str = ""  # planner traces for sft.parquet; empty: no SFT export
    # the weights verl's reward entry applies; R_QA needs the served generator, which verl's reward entry has not
    rewards: RewardSettings = field(default_factory=RewardSettings)

    def __post_init__(self) -> None:
        if self.rewards.qa:
            raise ConfigError(f"rewards.qa ({self.rewards.qa}): verl's reward entry (training/verl/reward.py) cannot "
                              f"compute R_QA (it needs the served generator); set rewards.qa to 0, or train with "
                              f"R_QA through planner_grpo or stitch")


def verl_row(row: dict, index: int, split: str, config: VerlExportConfig) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": row["prompt"],
        "ability": "retrieval_planning",
        "reward_model": {"style": "rule", "ground_truth": {"level_min": row["level_min"],
                                                           "level_max": row["level_max"]}},
        "extra_info": {"split": split, "index": index, "example_id": row["example_id"], "doc_id": row["doc_id"],
                       "level_tokens": row["level_tokens"], "reward_weights": to_dict(config.rewards),
                       "tokenizer": config.tokenizer},
    }


def run(config: VerlExportConfig) -> dict:
    import pandas as pd

    train, val, _ = planner_rows(config.data, config.tokenizer)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, rows in (("train", train), ("val", val)):
        pd.DataFrame([verl_row(r, i, split, config) for i, r in enumerate(rows)]).to_parquet(out / f"{split}.parquet")
        counts[split] = len(rows)
    if config.traces:
        traces = list(read_jsonl(config.traces, PlannerTrace))
        rows = [{"messages": [*t.prompt, {"role": "assistant", "content": t.completion}], "teacher": t.teacher,
                 "example_id": t.question_id} for t in traces]
        pd.DataFrame(rows).to_parquet(out / "sft.parquet")
        counts["sft"] = len(traces)
    print(f"verl export: {counts} -> {out}")
    return counts
