"""TRL SFT settings shared by the SFT recipes (planner SFT, the distilled LATTICE scorer): the ``train`` block of
their configs and the ``SFTConfig`` a run gets from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from overstory.core.config import ConfigError
from overstory.training.distributed import process_group_backend, trainer_device_args
from overstory.training.trl_args import HUB_OWNED, build_args, check_section


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
    save_steps: int = 0  # 0: save once per epoch
    # when the validation split is evaluated: "save" (with each save) or "epoch" (once per epoch, however often it
    # saves: a long epoch checkpointed often, so a killed run resumes, without paying an evaluation each time)
    eval_at: str = "save"
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
        if self.eval_at not in ("save", "epoch"):
            raise ConfigError(f"train.eval_at must be 'save' or 'epoch', got {self.eval_at!r}")

    def trl_aliases(self, prefix: str = "train.") -> dict[str, str]:
        """The TRL SFTConfig field each short name sets (field -> its config key); a ``trl`` section may not set
        them too. ``save_steps`` picks the save strategy (0: every epoch), ``eval_at`` the evaluation's."""
        sets = {"epochs": ["num_train_epochs"], "max_steps": ["max_steps"], "lr": ["learning_rate"],
                "batch_size": ["per_device_train_batch_size", "per_device_eval_batch_size"],
                "grad_accum": ["gradient_accumulation_steps"], "max_length": ["max_length"],
                "warmup_ratio": ["warmup_steps"], "weight_decay": ["weight_decay"], "logging_steps": ["logging_steps"],
                "save_steps": ["save_strategy", "save_steps"], "eval_at": ["eval_strategy", "eval_steps"],
                "seed": ["seed", "data_seed"], "bf16": ["bf16"],
                "gradient_checkpointing": ["activation_checkpointing", "gradient_checkpointing"],
                "deepspeed": ["deepspeed"]}
        return {trl_field: f"{prefix}{name}" for name, fields in sets.items() for trl_field in fields}

    def trl_kwargs(self, evaluate: bool) -> dict[str, Any]:
        """SFTConfig's arguments from the short names (``trl_aliases``); ``evaluate``: there is validation data."""
        return dict(
            num_train_epochs=self.epochs, max_steps=self.max_steps, learning_rate=self.lr,
            per_device_train_batch_size=self.batch_size, per_device_eval_batch_size=self.batch_size,
            gradient_accumulation_steps=self.grad_accum, max_length=self.max_length,
            warmup_steps=self.warmup_ratio, weight_decay=self.weight_decay,  # a float < 1 is a ratio
            logging_steps=self.logging_steps, **self.save_and_eval_kwargs(evaluate), seed=self.seed,
            data_seed=self.seed, bf16=self.bf16, deepspeed=self.deepspeed or None,
            **{checkpointing_field(): self.gradient_checkpointing})

    def save_and_eval_kwargs(self, evaluate: bool) -> dict[str, Any]:
        """The TrainingArguments that say when a run saves and when it evaluates (``save_steps``, ``eval_at``), for
        the SFT recipes and the cross-encoder student alike; ``evaluate``: there is validation data."""
        save_each_epoch = self.save_steps <= 0
        eval_each_epoch = save_each_epoch or self.eval_at == "epoch"
        return dict(save_strategy="epoch" if save_each_epoch else "steps", save_steps=self.save_steps or 500,
                    eval_strategy=("epoch" if eval_each_epoch else "steps") if evaluate else "no",
                    eval_steps=None if eval_each_epoch else self.save_steps)


def checkpointing_field() -> str:
    """TrainingArguments' name for activation checkpointing in the installed transformers: ``activation_checkpointing``
    from 5.23 (where ``gradient_checkpointing`` became its deprecated alias), ``gradient_checkpointing`` before. The
    project allows transformers from 5.0: GPU images ship older ones (5.17 refused ``activation_checkpointing``), and
    the verl environment caps it near 5.10."""
    from transformers import TrainingArguments  # transformers takes seconds to import: only when arguments are built

    names = {field.name for field in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


# SFTConfig fields the SFT recipes derive themselves: a ``trl`` section may not set them
SFT_OWNED: dict[str, str] = {
    "output_dir": "checkpoints go to <out>/checkpoints, where a rerun resumes from the newest",
    "logging_nan_inf_filter": "StopOnNonFiniteLoss stops a run on a non-finite loss, which the filter would hide",
    "include_num_input_tokens_seen": "metrics.json's tokens_seen (what `bench train` turns into tokens/s) counts "
                                     "the non-padding tokens",
    **HUB_OWNED}


def check_sft_section(section: dict[str, Any], train: SftTrainSettings) -> None:
    """A recipe config's ``trl`` section against SFTConfig, the ``train`` block's short names and SFT_OWNED."""
    check_section(section, "trl", "SFTConfig", train.trl_aliases(), SFT_OWNED)


class SftRun(Protocol):
    """What ``sft_args`` reads of a recipe's config."""

    out: str
    train: SftTrainSettings
    trl: dict[str, Any]


def sft_args(config: SftRun, evaluate: bool, **overrides):
    """TRL's SFTConfig for a run: the ``train`` block's arguments, the recipe's own, its defaults, then the
    config's ``trl`` section; ``evaluate``: there is validation data. ``overrides`` go last (tests build the
    arguments a launch would, e.g. with ``use_cpu=True`` where bf16 needs a GPU)."""
    recipe = {**config.train.trl_kwargs(evaluate),
              "output_dir": str(Path(config.out) / "checkpoints"), "logging_nan_inf_filter": False,
              "include_num_input_tokens_seen": "non_padding",  # tokens/s and MFU in `bench train`
              # defaults a trl section may replace
              "save_total_limit": 2, "report_to": "none", "completion_only_loss": True,
              "ddp_backend": process_group_backend(), **trainer_device_args()}
    return build_args("SFTConfig", recipe, {**config.trl, **overrides}, "trl")
