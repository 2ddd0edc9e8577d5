"""Train design (b) of the compressor: the sentence encoder fine-tuned to embed child texts as their summary.

    overstory train text_compressor --config configs/train/text_compressor.yaml
    accelerate launch --config_file configs/accelerate/<file>.yaml -m overstory.cli train text_compressor \
        --config configs/train/text_compressor.yaml

Reads the same ``SummaryRecord``s as the set compressor (``overstory data summaries``) and the
hierarchy they were made from (kept next to them), so each record becomes (children's texts joined,
e_gt). The training loop is sentence-transformers' ``SentenceTransformerTrainer`` with its
embedding-distillation loss (``MSELoss``, or cosine distance), i.e. the Hugging Face Trainer: it runs
under ``accelerate launch`` and DeepSpeed unchanged, evaluates and checkpoints every epoch, keeps the
best epoch, and resumes from the newest checkpoint in ``out/checkpoints`` when rerun (refusing other settings
than those recorded in ``out/initial_metrics.json``; only ``train.epochs`` may grow).

Same split by document as the set compressor (the same hash), so both designs are validated on the
same held-out documents. The untrained encoder (``direct_encode``) is evaluated first and kept when no
epoch beats it, so ``out/best`` is never worse than where training started.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from overstory.core.config import ConfigError, to_dict
from overstory.core.records import SummaryRecord, read_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.hierarchy import load_hierarchies, stored_hierarchy_path
from overstory.data_pipeline.splits import split_by_document
from overstory.models.registry import load_sentence_encoder
from overstory.models.text_compressor import join_children, save_text_compressor
from overstory.training import checkpoint_state
from overstory.training.callbacks import StopOnNonFiniteLoss, TrackingCallback
from overstory.training.common import newest_checkpoint
from overstory.training.distributed import process_group_backend
from overstory.training.model_card import finish_checkpoint


@dataclass(frozen=True)
class TextCompressorTrainConfig:
    epochs: int = 3
    batch_size: int = 16
    lr: float = 2e-5
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0
    loss: Literal["mse", "cosine"] = "mse"
    val_fraction: float = 0.2
    logging_steps: int = 10
    seed: int = 0
    bf16: bool = False
    # a DeepSpeed JSON config (configs/deepspeed/); the Hugging Face Trainer hands it to DeepSpeed
    deepspeed: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"train.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ConfigError("train.epochs, train.batch_size and train.lr must be positive")


@dataclass(frozen=True)
class TextCompressorJobConfig:
    data: str
    out: str
    # the hierarchy the summaries were made from; empty: the one the summaries job kept next to `data`
    hierarchies: str = ""
    train: TextCompressorTrainConfig = field(default_factory=TextCompressorTrainConfig)
    push_to_hub: str = ""  # a hub repo id: out/best and its model card are uploaded there at the end
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def group_texts(records: list[SummaryRecord], hierarchies: str | Path) -> list[str]:
    """The text compressor's input for every record: its children's texts, joined in order."""
    path = Path(hierarchies)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: the text compressor needs the children's texts; give "
                                f"`hierarchies=` the hierarchy JSONL the summaries were made from")
    texts = {c.id: c.text for c in load_hierarchies(path)}
    missing = [cid for r in records for cid in r.child_ids if cid not in texts]
    if missing:
        raise ValueError(f"{len(missing)} child chunks (e.g. {missing[0]}) are not in {path}; "
                         f"use the hierarchy the summaries were made from")
    return [join_children([texts[cid] for cid in r.child_ids]) for r in records]


def embedding_metrics(model, texts: list[str], targets: np.ndarray) -> dict[str, float]:
    """Squared distance and cosine to e_gt, on the scale the set compressor reports (sum over dims)."""
    vectors = model.encode(texts, convert_to_numpy=True, show_progress_bar=False, batch_size=64)
    cosine = np.sum(vectors * targets, axis=1) / (np.linalg.norm(vectors, axis=1) * np.linalg.norm(targets, axis=1))
    return {"val_mse": float(np.mean(np.sum((vectors - targets) ** 2, axis=1))), "val_cosine": float(np.mean(cosine))}


def training_args(config: TextCompressorJobConfig, n_train: int):
    """sentence-transformers' (the Hugging Face Trainer's) arguments: evaluate and checkpoint every epoch, keep
    the best by validation loss."""
    from sentence_transformers import SentenceTransformerTrainingArguments

    train, steps_per_epoch = config.train, math.ceil(n_train / config.train.batch_size)
    return SentenceTransformerTrainingArguments(
        output_dir=str(Path(config.out) / "checkpoints"), num_train_epochs=train.epochs,
        per_device_train_batch_size=train.batch_size, per_device_eval_batch_size=train.batch_size,
        learning_rate=train.lr, weight_decay=train.weight_decay,
        warmup_steps=int(train.warmup_ratio * steps_per_epoch * train.epochs),
        max_grad_norm=train.max_grad_norm, eval_strategy="epoch", save_strategy="epoch",
        load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=False,
        save_total_limit=2, logging_steps=train.logging_steps, logging_nan_inf_filter=False,
        seed=train.seed, data_seed=train.seed, bf16=train.bf16, deepspeed=train.deepspeed or None,
        report_to="none", disable_tqdm=False, ddp_backend=process_group_backend())


def resume_settings(config: TextCompressorJobConfig) -> dict:
    """What decides a text-compressor run: the config but its length (``train.epochs``), output and tracking."""
    settings = to_dict(config)
    for key in ("out", "tracking"):
        settings.pop(key)
    settings["train"].pop("epochs")
    return settings


def initial_metrics(config: TextCompressorJobConfig, trainer, model, val_texts: list[str], val_targets: np.ndarray,
                    main_process: bool) -> dict:
    """The untrained encoder (= direct_encode) on the validation split, measured once and kept (written whole, with
    the settings) in ``out/initial_metrics.json``: what a rerun resumes against, refused under other settings."""
    path = Path(config.out) / "initial_metrics.json"
    if path.exists():
        initial = json.loads(path.read_text())
        checkpoint_state.check_settings(initial, resume_settings(config), config.out)
        return initial
    initial = {"eval_loss": trainer.evaluate()["eval_loss"], **embedding_metrics(model, val_texts, val_targets),
               "settings": resume_settings(config)}
    if main_process:
        checkpoint_state.atomic_write_text(path, json.dumps(initial, indent=2))
    return initial


def save_best(config: TextCompressorJobConfig, trainer, initial: dict, val_texts: list[str], val_targets: np.ndarray,
              split: tuple[int, int], encoder: str, tracker, started: float) -> dict:
    """``out/best`` (the best epoch, or the untrained encoder when no epoch beat it), ``metrics.json``; the summary."""
    best_loss = trainer.state.best_metric
    improved = best_loss is not None and best_loss < initial["eval_loss"]
    best_model = trainer.model if improved else load_sentence_encoder(encoder)
    metrics = {"eval_loss": best_loss if improved else initial["eval_loss"],
               **embedding_metrics(best_model, val_texts, val_targets)}
    summary = {"best_val_mse": metrics["val_mse"], "best_val_cosine": metrics["val_cosine"],
               "initial_val_mse": initial["val_mse"], "initial_val_cosine": initial["val_cosine"],
               "improved": improved, "best_checkpoint": trainer.state.best_model_checkpoint,
               "epochs": config.train.epochs, "n_train": split[0], "n_val": split[1],
               "seconds": round(time.perf_counter() - started, 1)}
    if tracker is not None:
        out = Path(config.out)
        save_text_compressor(best_model, out / "best", encoder, {
            "config": to_dict(config), "data": config.data,
            "data_sha256": hashlib.sha256(Path(config.data).read_bytes()).hexdigest()[:16],
            "n_train": split[0], "n_val": split[1], "metrics": metrics, "tracking_run": tracker.id})
        history = [row for row in trainer.state.log_history if "eval_loss" in row]
        (out / "metrics.json").write_text(json.dumps({**summary, "history": history}, indent=2))
        manifest = json.loads((out / "best" / "overstory.json").read_text())
        finish_checkpoint(out / "best", {**manifest, "base_model": encoder, "recipe": "text_compressor"},
                          {"data": config.data}, summary, "sentence-transformers", config.push_to_hub)
        tracker.summary(summary)
        tracker.finish()
        print(json.dumps(summary, indent=2))
    return summary


def run(config: TextCompressorJobConfig) -> dict:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.losses import EmbedDistillLoss

    # --- setup -------------------------------------------------------------------------------------
    records = list(read_jsonl(config.data, SummaryRecord))
    if not records:
        raise ValueError(f"{config.data} holds no summary records; run `overstory data summaries` first")
    train_records, val_records = split_by_document(records, config.train.val_fraction)
    texts = group_texts(train_records + val_records, config.hierarchies or stored_hierarchy_path(config.data))
    train_texts, val_texts = texts[: len(train_records)], texts[len(train_records):]
    val_targets = np.array([r.target_embedding for r in val_records], dtype=np.float32)
    encoder = records[0].encoder
    model = load_sentence_encoder(encoder)
    if model.get_embedding_dimension() != val_targets.shape[1]:
        raise ValueError(f"{encoder} gives {model.get_embedding_dimension()}-dim vectors but the targets in "
                         f"{config.data} are {val_targets.shape[1]}-dim")

    def dataset(texts: list[str], rows: list[SummaryRecord]) -> Dataset:
        return Dataset.from_dict({"text": texts, "label": [r.target_embedding for r in rows]})

    args = training_args(config, len(train_records))
    tracker = start_run(config.tracking, "train text_compressor", config) if args.process_index == 0 else None
    # sentence-transformers' embedding-distillation loss: MSE (mean over dimensions) or cosine distance to e_gt
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=dataset(train_texts, train_records),
        eval_dataset=dataset(val_texts, val_records), loss=EmbedDistillLoss(model, distance_metric=config.train.loss),
        callbacks=[StopOnNonFiniteLoss(f"lower train.lr (now {config.train.lr}) or check the data"),
                   *([TrackingCallback(tracker)] if tracker else [])])

    # --- train -------------------------------------------------------------------------------------
    started = time.perf_counter()
    initial = initial_metrics(config, trainer, model, val_texts, val_targets, args.process_index == 0)
    trainer.train(resume_from_checkpoint=newest_checkpoint(args.output_dir))

    # --- save --------------------------------------------------------------------------------------
    return save_best(config, trainer, initial, val_texts, val_targets, (len(train_records), len(val_records)),
                     encoder, tracker, started)
