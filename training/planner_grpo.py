"""GRPO with the DAPO loss for the planner (TRL's GRPOTrainer), rewarded by ``training/rewards.py``.

    overstory train planner_grpo --config configs/train/planner_grpo.yaml
    accelerate launch --config_file configs/accelerate/<file>.yaml -m overstory.cli train planner_grpo \
        --config configs/train/planner_grpo.yaml

Prompts are the planner's prompts for the correct pseudo-labels (``training/planner_data.py``); each
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
from typing import Literal

from data_pipeline.pseudo_labels import CorrectnessConfig
from models.registry import SMOLLM2
from overstory.config import ConfigError, to_dict
from overstory.tracking import TrackingConfig, start_run
from serving.client import Client
from serving.config import ServeConfig
from serving.launch import stack_in_background
from training.callbacks import StopOnNonFiniteLoss, TrackingCallback
from training.distributed import process_group_backend
from training.planner_data import (
    PlannerDataConfig,
    RewardSettings,
    build_rewards,
    load_policy,
    make_qa_judge,
    planner_rows,
)
from training.planner_sft import LoraSettings


@dataclass(frozen=True)
class GrpoSettings:
    max_steps: int = 20
    lr: float = 1e-6  # the paper's rate for Qwen2.5-1.5B; small LoRA runs on CPU use ~1e-4
    num_generations: int = 8  # rollouts per prompt (G)
    batch_size: int = 8  # completions per device per step (a multiple of num_generations)
    grad_accum: int = 1
    # micro-batches per generation batch: rollouts are generated for per-device batch x processes x this many
    # micro-batches at once, then trained on in steps_per_generation / grad_accum optimizer steps (the paper's
    # prompt batch 256 with mini-batch 64); 0: grad_accum, one optimizer step per generation
    steps_per_generation: int = 0
    max_completion_length: int = 128
    temperature: float = 1.0
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.28  # DAPO's clip-higher
    beta: float = 0.0  # KL coefficient; DAPO drops the KL term
    mask_truncated_completions: bool = True  # DAPO's overlong filtering
    logging_steps: int = 1
    save_steps: int = 10
    seed: int = 0
    bf16: bool = False
    deepspeed: str = ""
    vllm_server_url: str = ""  # a `trl vllm-serve` endpoint for rollouts; empty: transformers generate

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ConfigError("train.num_generations must be >= 2 (advantages are relative within a group)")
        if self.steps_per_generation and self.steps_per_generation % self.grad_accum:
            raise ConfigError(f"train.steps_per_generation ({self.steps_per_generation}) must be a multiple of "
                              f"train.grad_accum ({self.grad_accum}): whole optimizer steps per generation batch")
        if self.batch_size % self.num_generations:
            raise ConfigError(f"train.batch_size ({self.batch_size}) must be a multiple of train.num_generations "
                              f"({self.num_generations})")


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


def grpo_args(config: PlannerGrpoConfig, reward_weights: list[float], **overrides):
    """TRL's GRPOConfig for this run (shared with STITCH, which runs the same GRPO updates and passes its
    batch shape as ``overrides``: GRPOConfig derives the generation batch from them when it is built)."""
    from trl import GRPOConfig

    settings = config.train
    return GRPOConfig(**{**dict(
        output_dir=str(Path(config.out) / "checkpoints"), max_steps=settings.max_steps, learning_rate=settings.lr,
        per_device_train_batch_size=settings.batch_size, gradient_accumulation_steps=settings.grad_accum,
        steps_per_generation=settings.steps_per_generation or None,
        num_generations=settings.num_generations, max_completion_length=settings.max_completion_length,
        temperature=settings.temperature, loss_type=settings.loss_type, epsilon=settings.epsilon,
        epsilon_high=settings.epsilon_high, beta=settings.beta,
        mask_truncated_completions=settings.mask_truncated_completions, reward_weights=reward_weights,
        logging_steps=settings.logging_steps, logging_nan_inf_filter=False, save_strategy="steps",
        save_steps=settings.save_steps, save_total_limit=2, seed=settings.seed, data_seed=settings.seed,
        bf16=settings.bf16, deepspeed=settings.deepspeed or None, report_to="none", ddp_backend=process_group_backend(),
        use_vllm=bool(settings.vllm_server_url), vllm_mode="server",
        vllm_server_base_url=settings.vllm_server_url or None, remove_unused_columns=False), **overrides})


def run(config: PlannerGrpoConfig) -> dict:
    from datasets import Dataset
    from peft import LoraConfig, PeftModel
    from transformers.trainer_utils import get_last_checkpoint
    from trl import GRPOTrainer

    # --- setup -------------------------------------------------------------------------------------
    out = Path(config.out)
    model, tokenizer, base = load_policy(config.model)
    train_rows, val_rows, chunks = planner_rows(config.data, base)
    with ExitStack() as stack:
        judge = None
        if config.rewards.qa:
            client = Client.from_url(config.server_url or stack.enter_context(stack_in_background(config.serve)))
            judge = make_qa_judge(train_rows, chunks, client, config.correctness, config.rewards.k)
        reward_funcs, weights = build_rewards(config.rewards, judge)
        args = grpo_args(config, weights)
        peft_config = None if isinstance(model, PeftModel) or not config.lora.enabled else LoraConfig(
            r=config.lora.r, lora_alpha=config.lora.alpha, lora_dropout=config.lora.dropout,
            target_modules=list(config.lora.target_modules), task_type="CAUSAL_LM")
        tracker = start_run(config.tracking, "train planner_grpo", config) if args.process_index == 0 else None
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward_funcs, args=args, train_dataset=Dataset.from_list(train_rows),
            processing_class=tokenizer, peft_config=peft_config,
            callbacks=[StopOnNonFiniteLoss(f"lower train.lr (now {config.train.lr})"),
                       *([TrackingCallback(tracker)] if tracker else [])])

        # --- train ---------------------------------------------------------------------------------
        started = time.perf_counter()
        last = get_last_checkpoint(args.output_dir) if Path(args.output_dir).exists() else None
        if last:
            print(f"resuming from {last}")
        result = trainer.train(resume_from_checkpoint=last)

    # --- save --------------------------------------------------------------------------------------
    history = trainer.state.log_history
    metrics = {"train_loss": result.training_loss, "steps": trainer.state.global_step, "n_prompts": len(train_rows),
               "n_val": len(val_rows), "final_reward": next((r["reward"] for r in reversed(history) if "reward" in r),
                                                            None),
               "seconds": round(time.perf_counter() - started, 1)}
    if args.process_index == 0:
        final = out / "final"
        trainer.model.save_pretrained(final)
        tokenizer.save_pretrained(final)
        (final / "overstory.json").write_text(json.dumps({
            "kind": "planner", "base_model": base, "adapter": isinstance(trainer.model, PeftModel),
            "recipe": "planner_grpo", "init": config.model, "config": to_dict(config), "metrics": metrics,
            "tracking_run": tracker.id}, indent=2))
        (out / "metrics.json").write_text(json.dumps({**metrics, "history": history}, indent=2))
        tracker.summary(metrics)
        tracker.finish()
        print(json.dumps(metrics, indent=2))
    return metrics
