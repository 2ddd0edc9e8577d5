"""TRL SFT settings shared by the SFT recipes (planner SFT, the distilled LATTICE scorer): the ``train`` block of
their configs and the ``SFTConfig`` a run gets from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from overstory.core.config import ConfigError
from overstory.training.distributed import process_group_backend


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


class SftRun(Protocol):
    """What ``sft_args`` reads of a recipe's config."""

    out: str
    train: SftTrainSettings


def sft_args(config: SftRun, evaluate: bool, **overrides):
    """TRL's SFTConfig for a run (its ``out`` and ``train``); ``evaluate``: there is validation data.
    ``overrides`` go to SFTConfig (tests build the arguments a launch would, e.g. with ``use_cpu=True`` where
    bf16 needs a GPU)."""
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
        report_to="none", completion_only_loss=True, ddp_backend=process_group_backend(),
        include_num_input_tokens_seen="non_padding"), **overrides})  # tokens/s and MFU in `bench train`
