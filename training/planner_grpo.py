"""GRPO with the DAPO loss for the planner (TRL's GRPOTrainer), rewarded by ``training/rewards.py``.

    overstory train planner_grpo --config configs/train/planner_grpo.yaml
    accelerate launch --config_file configs/accelerate/<file>.yaml -m overstory.cli train planner_grpo \
        --config configs/train/planner_grpo.yaml

Prompts are the planner's prompts for the correct pseudo-labels (``data_pipeline/planner_examples.py``); each
is rolled out ``num_generations`` times, and the weighted rewards (format, length, alignment, cost,
and R_QA through SmartChunk retrieval when ``rewards.qa`` > 0) give group-relative advantages. DAPO:
token-level loss normalisation (``loss_type: dapo``), clip-higher (``epsilon_high``), no KL term
(``beta: 0``) and truncated completions masked out. The policy is the base model with a new LoRA
adapter, or a planner_sft output (its adapter keeps training). With ``vllm_server_url`` set,
rollouts come from a running ``trl vllm-serve`` server instead of transformers ``generate``.
Checkpoints under ``out/checkpoints`` (a rerun resumes), the final adapter/model in ``out/final``.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overstory.core.config import to_dict
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.planner_examples import PlannerDataConfig, planner_rows
from overstory.models.registry import SMOLLM2, load_lm_checkpoint
from overstory.retrieval.judge import CorrectnessConfig
from overstory.serving.config import ServeConfig
from overstory.serving.job_client import client_for
from overstory.training.callbacks import StopOnNonFiniteLoss, TrackingCallback
from overstory.training.common import LoraSettings, lora_config, newest_checkpoint, save_final
from overstory.training.planner_common import (
    GRPO_OWNED,
    GrpoSettings,
    RewardSettings,
    build_rewards,
    grpo_args,
    qa_reward_counts,
)
from overstory.training.qa_judge import QAJudge
from overstory.training.trl_args import check_section


@dataclass(frozen=True)
class PlannerGrpoConfig:
    data: PlannerDataConfig
    out: str
    model: str = SMOLLM2  # a base model, or a planner_sft output folder
    lora: LoraSettings = field(default_factory=LoraSettings)
    rewards: RewardSettings = field(default_factory=RewardSettings)
    correctness: CorrectnessConfig = field(default_factory=CorrectnessConfig)  # for R_QA
    train: GrpoSettings = field(default_factory=GrpoSettings)
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))  # R_QA's generator
    # R_QA on a running stack instead (a URL or the stack.json of `overstory serve`): what multi-process runs
    # use, so that every rank asks the same servers rather than starting a stack of its own
    server_url: str = ""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # TRL GRPOConfig fields passed through after the train block (docs/training.md, "TRL's own settings")
    trl: dict[str, Any] = field(default_factory=dict)
    push_to_hub: str = ""  # a hub repo id: out/final and its model card are uploaded there at the end

    def __post_init__(self) -> None:
        check_section(self.trl, "trl", "GRPOConfig", self.train.trl_aliases(), GRPO_OWNED)


def run(config: PlannerGrpoConfig) -> dict:
    from datasets import Dataset
    from peft import PeftModel
    from trl import GRPOTrainer

    # --- setup -------------------------------------------------------------------------------------
    out = Path(config.out)
    model, tokenizer, base = load_lm_checkpoint(config.model)
    train_rows, val_rows, chunks = planner_rows(config.data, base)
    with ExitStack() as stack:
        judge = None
        if config.rewards.qa:
            client = stack.enter_context(client_for(config.serve, config.server_url,
                                                    timeout_s=config.rewards.qa_request_timeout_s))
            judge = QAJudge(train_rows, chunks, client, config.correctness, config.rewards.k,
                            kept=config.rewards.qa_answers)
            stack.callback(judge.close)
        reward_funcs, weights = build_rewards(config.rewards, judge)
        args = grpo_args(config.train, out / "checkpoints", weights, config.trl, "trl")
        peft_config = None if isinstance(model, PeftModel) else lora_config(config.lora)  # an adapter keeps training
        tracker = start_run(config.tracking, "train planner_grpo", config) if args.process_index == 0 else None
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward_funcs, args=args, train_dataset=Dataset.from_list(train_rows),
            processing_class=tokenizer, peft_config=peft_config,
            callbacks=[StopOnNonFiniteLoss(f"lower train.lr (now {config.train.lr})"),
                       *([TrackingCallback(tracker)] if tracker else [])])

        # --- train ---------------------------------------------------------------------------------
        started = time.perf_counter()
        result = trainer.train(resume_from_checkpoint=newest_checkpoint(args.output_dir))

    # --- save --------------------------------------------------------------------------------------
    history = trainer.state.log_history
    metrics = {"train_loss": result.training_loss, "steps": trainer.state.global_step, "n_prompts": len(train_rows),
               "n_val": len(val_rows), "final_reward": next((r["reward"] for r in reversed(history) if "reward" in r),
                                                            None),
               "seconds": round(time.perf_counter() - started, 1),
               **({"qa_answers": judge.counts} if judge and judge.counts else {}), **qa_reward_counts(reward_funcs)}
    save_final(trainer, tokenizer, out, {
        "kind": "planner", "base_model": base, "adapter": isinstance(trainer.model, PeftModel),
        "recipe": "planner_grpo", "init": config.model, "config": to_dict(config),
        "tracking_run": tracker.id if tracker else None}, metrics, history=history,
        data={"data.labels": config.data.labels}, push_to_hub=config.push_to_hub)
    if tracker:
        tracker.summary(metrics)
        tracker.finish()
        print(json.dumps(metrics, indent=2))
    return metrics
