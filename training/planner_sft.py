"""Supervised fine-tuning of the planner on teacher traces (TRL's SFTTrainer, LoRA through peft or full).

    overstory train planner_sft --config configs/train/planner_sft.yaml
    accelerate launch --config_file configs/accelerate/<file>.yaml -m overstory.cli train planner_sft \
        --config configs/train/planner_sft.yaml

Reads ``PlannerTrace`` records (``overstory data traces``) as conversational prompt-completion pairs:
the planner's own prompt, and the teacher's reasoning ending in the JSON plan as the assistant turn.
TRL computes the loss on the completion only. The split is by document, so validation questions
come from documents the model never saw. Checkpoints every epoch under ``out/checkpoints`` (a rerun
resumes from the newest); the final model goes to ``out/final``: a PEFT adapter folder with LoRA
(what ``vllm --lora-modules planner=DIR`` loads), a full Hugging Face folder otherwise or with
``lora.merge: true``, plus the tokenizer and the ``overstory.json`` manifest.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from overstory.core.config import ConfigError, to_dict
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.formats import PlannerTrace, read_jsonl
from overstory.data_pipeline.splits import split_by_document
from overstory.models.registry import SMOLLM2, load_causal_lm
from overstory.training.callbacks import StopOnNonFiniteLoss, TrackingCallback
from overstory.training.common import LoraSettings, lora_config, newest_checkpoint, save_final
from overstory.training.distributed import process_group_backend
from overstory.training.planner_common import trace_rows


@dataclass(frozen=True)
class SftTrainSettings:
    epochs: float = 1.0
    max_steps: int = -1  # > 0 overrides epochs (smoke runs)
    lr: float = 2e-4
    batch_size: int = 8
    grad_accum: int = 1
    max_length: int = 1024
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    val_fraction: float = 0.2
    logging_steps: int = 5
    save_steps: int = 0  # 0: save (and evaluate) once per epoch
    seed: int = 0
    bf16: bool = False
    gradient_checkpointing: bool = False
    deepspeed: str = ""  # a DeepSpeed JSON config; the Trainer hands it to DeepSpeed

    def __post_init__(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"train.val_fraction must be in [0, 1), got {self.val_fraction}")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.lr <= 0 or self.batch_size < 1 or self.grad_accum < 1:
            raise ConfigError("train.lr, train.batch_size and train.grad_accum must be positive")


@dataclass(frozen=True)
class PlannerSftConfig:
    traces: str
    out: str
    model: str = SMOLLM2
    lora: LoraSettings = field(default_factory=LoraSettings)
    train: SftTrainSettings = field(default_factory=SftTrainSettings)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def sft_args(config: PlannerSftConfig, evaluate: bool, **overrides):
    """TRL's SFTConfig for this run; ``evaluate``: there are validation traces. ``overrides`` go to SFTConfig
    (tests build the arguments a launch would, e.g. with ``use_cpu=True`` where bf16 needs a GPU)."""
    from trl import SFTConfig

    every_epoch = config.train.save_steps <= 0
    return SFTConfig(**{**dict(
        output_dir=str(Path(config.out) / "checkpoints"), num_train_epochs=config.train.epochs,
        max_steps=config.train.max_steps, learning_rate=config.train.lr,
        per_device_train_batch_size=config.train.batch_size, per_device_eval_batch_size=config.train.batch_size,
        gradient_accumulation_steps=config.train.grad_accum,
        warmup_steps=config.train.warmup_ratio, weight_decay=config.train.weight_decay,  # a float < 1 is a ratio
        max_length=config.train.max_length, logging_steps=config.train.logging_steps, logging_nan_inf_filter=False,
        save_strategy="epoch" if every_epoch else "steps", save_steps=config.train.save_steps or 500,
        eval_strategy=("epoch" if every_epoch else "steps") if evaluate else "no",
        eval_steps=None if every_epoch else config.train.save_steps,
        save_total_limit=2, seed=config.train.seed, data_seed=config.train.seed, bf16=config.train.bf16,
        activation_checkpointing=config.train.gradient_checkpointing, deepspeed=config.train.deepspeed or None,
        report_to="none", completion_only_loss=True, ddp_backend=process_group_backend()), **overrides})


def run(config: PlannerSftConfig) -> dict:
    from datasets import Dataset
    from trl import SFTTrainer

    # --- setup -------------------------------------------------------------------------------------
    out = Path(config.out)
    traces = list(read_jsonl(config.traces, PlannerTrace))
    if not traces:
        raise ValueError(f"{config.traces} holds no traces (the teacher pool yielded nothing); "
                         f"run `overstory data traces` and check its yield table")
    train_traces, val_traces = (split_by_document(traces, config.train.val_fraction)
                                if config.train.val_fraction else (traces, []))
    if not train_traces:
        raise ValueError(f"the document split left no training traces ({len(traces)} traces from "
                         f"{len({t.doc_id for t in traces})} documents); lower train.val_fraction")
    model, tokenizer = load_causal_lm(config.model)
    args = sft_args(config, evaluate=bool(val_traces))
    tracker = start_run(config.tracking, "train planner_sft", config) if args.process_index == 0 else None
    trainer = SFTTrainer(
        model=model, args=args, processing_class=tokenizer, peft_config=lora_config(config.lora),
        train_dataset=Dataset.from_list(trace_rows(train_traces)),
        eval_dataset=Dataset.from_list(trace_rows(val_traces)) if val_traces else None,
        callbacks=[StopOnNonFiniteLoss(f"lower train.lr (now {config.train.lr}) or check the traces"),
                   *([TrackingCallback(tracker)] if tracker else [])])
    if len(trainer.train_dataset) == 0:  # TRL drops traces whose completion truncation cut away entirely
        raise ValueError(f"all {len(train_traces)} training traces lose their whole completion at "
                         f"train.max_length={config.train.max_length} tokens (the prompt alone fills it); "
                         f"raise train.max_length or shorten the traces' metadata")

    # --- train -------------------------------------------------------------------------------------
    started = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=newest_checkpoint(args.output_dir))

    # --- save --------------------------------------------------------------------------------------
    metrics = {"train_loss": result.training_loss, "steps": trainer.state.global_step,
               "n_train": len(train_traces), "n_val": len(val_traces),
               "seconds": round(time.perf_counter() - started, 1)}
    if val_traces:
        metrics["eval_loss"] = trainer.evaluate()["eval_loss"]
    save_final(trainer, tokenizer, out, {
        "kind": "planner", "base_model": config.model, "adapter": config.lora.enabled and not config.lora.merge,
        "recipe": "planner_sft", "config": to_dict(config), "traces": config.traces,
        "traces_sha256": hashlib.sha256(Path(config.traces).read_bytes()).hexdigest()[:16],
        "teachers": sorted({t.teacher for t in traces}), "tracking_run": tracker.id if tracker else None},
        metrics, history=trainer.state.log_history, merge_lora=config.lora.enabled and config.lora.merge)
    if tracker:
        tracker.summary(metrics)
        tracker.finish()
        print(json.dumps(metrics, indent=2))
    return metrics
