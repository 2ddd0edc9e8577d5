"""Train the set compressor: child-chunk embeddings -> the embedding of the group's LLM summary, or of its questions.

    overstory train compressor --config configs/train/compressor.yaml
    overstory train compressor --config configs/train/compressor-qasper-contrastive.yaml   # no summaries
    accelerate launch --config_file configs/accelerate/<file>.yaml -m overstory.cli train compressor \
        --config configs/train/compressor.yaml

Reads ``SummaryRecord``s (``data``: ``overstory data summaries`` output) or, without summaries (``groups``), the
``questions`` corpus's own upper-level chunks with their children embedded by ``encoder`` (``compressor_records.py``),
splits them by document (never by chunk, so validation groups come from documents the model never saw), trains with
the paper's MSE to e_gt (cosine as an option; needs summaries), or with a retrieval objective the paper does not
have (``train.objective: contrastive``: InfoNCE pulling a chunk's compressed embedding towards the ``questions``
corpus's questions whose evidence it covers, see ``compressor_contrastive.py``), or both added (``mse+contrastive``,
needs summaries). Questions left out (evidence only a figure or table, no text evidence) and questions no
upper-level chunk covers are counted per split in ``metrics.json`` and the printed summary. Every epoch it evaluates
next to the untrained ``mean_pool`` baseline, keeps the best checkpoint by the validation objective in ``out/best``
and the full training state in ``out/last`` (staged and swapped in whole, ``training/checkpoint_state.py``).
Rerunning the same command resumes from ``out/last``; other settings are refused (only ``train.epochs`` may grow).
A non-finite loss stops the run with a clear error; ``best`` and ``last`` stay as they were after the last good
epoch.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import get_cosine_schedule_with_warmup

from overstory.core.config import ConfigError, to_dict
from overstory.core.progress import JobProgress
from overstory.core.records import Chunk, QAExample
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.compressor_groups import GroupsConfig, question_counts
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.splits import split_by_document
from overstory.models.compressor import SetCompressor, SetCompressorConfig, pad_children, save_checkpoint
from overstory.models.registry import MINILM, load_sentence_encoder
from overstory.training import checkpoint_state
from overstory.training.callbacks import TrainingDiverged
from overstory.training.compressor_contrastive import (
    DocumentBatches,
    PositiveSampler,
    QuestionPositives,
    contrastive_loss,
    question_positives,
)
from overstory.training.compressor_records import Record, groups_path, stored_groups, summary_records
from overstory.training.distributed import accelerator_handlers, cpu_ddp
from overstory.training.model_card import finish_checkpoint

STATE_FILE = "trainer_state.json"


@dataclass(frozen=True)
class CompressorModelConfig:
    num_layers: int = 1
    num_heads: int = 4
    ffn_dim: int = 768
    dropout: float = 0.1


@dataclass(frozen=True)
class CompressorTrainConfig:
    epochs: int = 20
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    grad_clip: float = 1.0
    loss: Literal["mse", "cosine"] = "mse"  # the summary term: squared distance or 1 - cosine to e_gt
    # what is minimised: the summary term, the contrastive term, or their sum (contrastive_weight on the second)
    objective: Literal["mse", "contrastive", "mse+contrastive"] = "mse"
    contrastive_weight: float = 1.0
    temperature: float = 0.05
    # shuffled: batches of records from any document; document: each batch one document's records, so the
    # contrastive objective's negatives are the question's own document's other chunks (validation batched alike)
    batching: Literal["shuffled", "document"] = "shuffled"
    val_fraction: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.contrastive_weight <= 0 or self.temperature <= 0:
            raise ConfigError("train.contrastive_weight and train.temperature must be positive")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"train.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ConfigError("train.epochs, train.batch_size and train.lr must be positive")


@dataclass(frozen=True)
class CompressorJobConfig:
    out: str
    # the summary records (`overstory data summaries` output); empty: no summaries, `groups` builds the inputs
    data: str = ""
    model: CompressorModelConfig = field(default_factory=CompressorModelConfig)
    train: CompressorTrainConfig = field(default_factory=CompressorTrainConfig)
    # the corpus whose questions (with evidence spans) the contrastive objective pulls chunks towards: the one the
    # summaries were made from (or, with groups, whose hierarchy is built); only questions whose evidence lies in a
    # split's documents serve that split
    questions: CorpusConfig | None = None
    # without summaries (data empty): the upper levels of the questions corpus's hierarchy, children embedded by
    # `encoder`; the contrastive objective only (the MSE term regresses on a summary's embedding)
    groups: GroupsConfig | None = None
    encoder: str = MINILM  # embeds the groups' children and the questions (summary records name their own)
    push_to_hub: str = ""  # a hub repo id: out/best and its model card are uploaded there at the end
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if bool(self.data) == (self.groups is not None):
            raise ConfigError("give data (a summaries file from `overstory data summaries`) or groups (the questions "
                              "corpus's own upper levels, no summaries, e.g. groups: {levels: [subsection, section]}), "
                              f"exactly one; got data={self.data!r}, groups={self.groups}")
        if self.groups is not None and self.train.objective != "contrastive":
            raise ConfigError(f"train.objective {self.train.objective!r} needs summaries (its MSE term regresses on "
                              f"the summary embedding): set data to `overstory data summaries` output, or use "
                              f"train.objective: contrastive with groups")
        if self.data and self.encoder != MINILM:
            raise ConfigError(f"encoder ({self.encoder!r}) applies to groups only: summary records in data name the "
                              f"encoder that embedded them")
        if self.train.objective != "mse" and self.questions is None:
            raise ConfigError(f"train.objective {self.train.objective!r} needs questions: the corpus the summaries "
                              f"were made from, e.g. questions: {{kind: qasper, path: ...}}")

    @property
    def records_file(self) -> str:
        """The file the training records are read from: the summaries, or the groups this run built."""
        return self.data or str(groups_path(self.out))


def collate(records: list[Record]) -> dict[str, torch.Tensor]:
    """The padded children and their mask, and e_gt (``target``) where the records have one (summary records)."""
    children, mask = pad_children([torch.tensor(r.child_embeddings, dtype=torch.float32) for r in records])
    if records[0].target_embedding is None:
        return {"children": children, "mask": mask}
    return {"children": children, "mask": mask,
            "target": torch.tensor([r.target_embedding for r in records], dtype=torch.float32)}


class RecordBatches:
    """Collates a batch of record indices: ``collate``'s tensors plus, with a ``PositiveSampler``, each record's
    sampled question (the contrastive objective's inputs)."""

    def __init__(self, records: list[Record], sampler: PositiveSampler | None):
        self.records, self.sampler = records, sampler

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        batch = collate([self.records[i] for i in indices])
        return {**batch, **self.sampler(indices)} if self.sampler is not None else batch


def compressor_loss(prediction: torch.Tensor, target: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "cosine":
        return (1 - F.cosine_similarity(prediction, target, dim=-1)).mean()
    return F.mse_loss(prediction, target, reduction="none").sum(-1).mean()  # ||e_comp - e_gt||^2


def objective(prediction: torch.Tensor, batch: dict[str, torch.Tensor], train: CompressorTrainConfig
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss ``train.objective`` minimises, and its terms (for logging)."""
    terms: dict[str, torch.Tensor] = {}
    if train.objective in ("mse", "mse+contrastive"):
        terms["summary"] = compressor_loss(prediction, batch["target"], train.loss)
    if train.objective in ("contrastive", "mse+contrastive"):
        terms["contrastive"] = train.contrastive_weight * contrastive_loss(
            prediction, batch["question"], batch["has_question"], batch["also_covers"], train.temperature)
    return sum(terms.values()), {k: float(v.detach()) for k, v in terms.items()}


def positives_for(split: list[Record], chunks: dict[str, Chunk], questions: list[QAExample],
                  encoder) -> QuestionPositives:
    """The ``questions`` whose evidence lies in ``split``'s documents, embedded with the records' encoder, as
    positives of the records whose chunks cover their evidence."""
    missing = [r.id for r in split if r.id not in chunks]
    if missing:
        raise ValueError(f"{len(missing)} chunks of the records (e.g. {missing[0]}) are not in the stored hierarchy")
    return question_positives(split, chunks, questions, lambda texts: encoder.encode(
        texts, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False))


@torch.no_grad()
def evaluate(model: SetCompressor, loader: DataLoader, accelerator: Accelerator,
             train: CompressorTrainConfig) -> dict[str, float]:
    """Validation MSE and cosine to e_gt (where the records have summaries), for the model and for the mean of the
    children; with the contrastive objective also its loss (``val_contrastive``, batch by batch) for both. Every
    process scores the whole validation split (a few hundred records), so all hold the same figures and pick the
    same best epoch. ``val_objective`` is the objective the run minimises, on the validation split: the best
    checkpoint is chosen by it."""
    model.eval()
    sums = torch.zeros(6, device=accelerator.device)
    count = torch.zeros(2, device=accelerator.device)
    contrastive, targets = train.objective != "mse", False
    for batch in loader:
        batch = {k: v.to(accelerator.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        prediction = model(batch["children"], batch["mask"])
        mask = batch["mask"].unsqueeze(-1).float()
        mean_pool = (batch["children"] * mask).sum(1) / mask.sum(1)
        targets = "target" in batch
        for i, estimate in enumerate((prediction, mean_pool)):
            if targets:
                sums[2 * i] += ((estimate - batch["target"]) ** 2).sum(-1).sum()
                sums[2 * i + 1] += F.cosine_similarity(estimate, batch["target"], dim=-1).sum()
            if contrastive and bool(batch["has_question"].any()):
                sums[4 + i] += contrastive_loss(estimate, batch["question"], batch["has_question"],
                                                batch["also_covers"], train.temperature) * batch["has_question"].sum()
        count[0] += len(batch["children"])
        count[1] += batch["has_question"].sum() if contrastive else 0
    metrics: dict[str, float] = {}
    if targets:
        values = (sums[:4] / count[0]).tolist()
        metrics.update(val_mse=values[0], val_cosine=values[1], mean_pool_mse=values[2], mean_pool_cosine=values[3])
    if contrastive:
        per_question = (sums[4:] / count[1].clamp(min=1)).tolist()
        metrics.update(val_contrastive=per_question[0], mean_pool_contrastive=per_question[1])
    summary_term = (metrics["val_mse"] if train.loss == "mse" else 1 - metrics["val_cosine"]) if targets else None
    metrics["val_objective"] = {"mse": summary_term, "contrastive": metrics.get("val_contrastive"),
                                "mse+contrastive": (summary_term or 0.0) + train.contrastive_weight
                                * metrics.get("val_contrastive", 0.0)}[train.objective]
    model.train()
    return metrics


@dataclass
class Setup:
    """What a compressor run trains and evaluates, prepared by accelerate."""

    model: SetCompressor
    optimizer: torch.optim.Optimizer
    scheduler: object
    train_loader: DataLoader
    val_loader: DataLoader
    n_train: int
    n_val: int
    # the contrastive objective's chunks and questions per split, used, left out and uncovered ({} for mse)
    coverage: dict[str, int]


def split_positives(split: list[Record], name: str, chunks: dict[str, Chunk], questions: list[QAExample],
                    encoder) -> tuple[QuestionPositives, dict[str, int]]:
    """One split's positives and its counts: the questions about its documents used (text evidence), left out
    (evidence only a figure or table, no text evidence) and used but covered by no chunk of the split."""
    used, counts = question_counts(questions, {r.doc_id for r in split})
    positives = positives_for(split, chunks, used, encoder)
    return positives, positives.coverage(name) | {f"{name}_questions_{kind}": counts[kind]
                                                  for kind in ("figure_table_only", "no_text_evidence")}


def loaders(config: CompressorJobConfig, train_records: list[Record], val_records: list[Record],
            chunks: dict[str, Chunk], questions: list[QAExample], accelerator: Accelerator
            ) -> tuple[DataLoader, DataLoader, dict[str, int]]:
    """Training and validation batches; with a contrastive objective each record also draws a covered question,
    and the coverage counts (chunks covering a question, questions used, left out, and uncovered) come back beside
    them."""
    samplers: list[PositiveSampler | None] = [None, None]
    coverage: dict[str, int] = {}
    if config.train.objective != "mse":
        encoder = load_sentence_encoder(train_records[0].encoder)
        (train_positives, train_counts), (val_positives, val_counts) = (
            split_positives(split, name, chunks, questions, encoder)
            for split, name in ((train_records, "train"), (val_records, "val")))
        coverage = train_counts | val_counts
        accelerator.print(
            f"contrastive objective: {train_positives.covered_records} of {len(train_records)} training and "
            f"{val_positives.covered_records} of {len(val_records)} validation chunks cover a question; questions "
            + "; ".join(f"{name}: {coverage[f'{name}_questions']} used, {coverage[f'{name}_questions_uncovered']} of "
                        f"them with no chunk covering their evidence (never a positive), left out "
                        f"{coverage[f'{name}_questions_figure_table_only']} whose evidence is only a figure or table "
                        f"and {coverage[f'{name}_questions_no_text_evidence']} with no text evidence"
                        for name in ("train", "val")))
        samplers = [PositiveSampler(train_positives, seed=config.train.seed),
                    PositiveSampler(val_positives, deterministic=True)]
    train, val = list(range(len(train_records))), list(range(len(val_records)))
    train_collate, val_collate = RecordBatches(train_records, samplers[0]), RecordBatches(val_records, samplers[1])
    if config.train.batching == "document":
        train_loader = DataLoader(train, collate_fn=train_collate, batch_sampler=DocumentBatches(
            [r.doc_id for r in train_records], config.train.batch_size, seed=config.train.seed))
        val_loader = DataLoader(val, collate_fn=val_collate, batch_sampler=DocumentBatches(
            [r.doc_id for r in val_records], config.train.batch_size, shuffle=False))
        return train_loader, val_loader, coverage
    train_loader = DataLoader(train, batch_size=config.train.batch_size, shuffle=True, collate_fn=train_collate,
                              generator=torch.Generator().manual_seed(config.train.seed))
    val_loader = DataLoader(val, batch_size=config.train.batch_size, collate_fn=val_collate)
    return train_loader, val_loader, coverage


def training_records(config: CompressorJobConfig, accelerator: Accelerator
                     ) -> tuple[list[Record], dict[str, Chunk], list[QAExample]]:
    """The records (summary records, or child groups built from the questions corpus), the chunks they name, by id,
    and the questions corpus's questions (none when the objective needs none)."""
    if config.groups is None:
        records, chunks = summary_records(config.data)
        questions = load_corpus(config.questions)[1] if config.questions is not None else []
        return records, chunks, questions
    documents, questions = load_corpus(config.questions)
    records, chunks = stored_groups(config.out, config.questions, documents, config.groups, config.encoder,
                                    accelerator)
    if not records:
        raise ValueError(f"the {'/'.join(config.groups.levels)} chunks of {config.questions.path} have no children: "
                         f"nothing to compress")
    return records, chunks, questions


def setup(config: CompressorJobConfig, accelerator: Accelerator) -> Setup:
    """The records split by document, the compressor, its optimizer and schedule, and the loaders."""
    records, chunks, questions = training_records(config, accelerator)
    train_records, val_records = split_by_document(records, config.train.val_fraction)
    model = SetCompressor(SetCompressorConfig(embedding_dim=len(records[0].child_embeddings[0]),
                                              encoder=records[0].encoder, **to_dict(config.model)))
    train_loader, val_loader, coverage = loaders(config, train_records, val_records, chunks, questions, accelerator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.lr, weight_decay=config.train.weight_decay)
    total_steps = config.train.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(config.train.warmup_ratio * total_steps), total_steps)
    # the validation loader stays whole on every process: sharded, accelerate pads the last batches with repeated
    # records (even_batches) and every process would score a different, padded half
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    return Setup(model, optimizer, scheduler, train_loader, val_loader, len(train_records), len(val_records), coverage)


def resume_settings(config: CompressorJobConfig) -> dict:
    """What decides a compressor run's training: the config but its length (``train.epochs``, which a resume may
    extend), its output folder and tracking."""
    settings = to_dict(config)
    for key in ("out", "tracking"):
        settings.pop(key)
    settings["train"].pop("epochs")
    return settings


def resume(config: CompressorJobConfig, prepared: Setup, accelerator: Accelerator) -> dict:
    """The training state of the last whole epoch in ``out/last`` (refused under other settings), or a fresh one."""
    last = Path(config.out) / "last"
    if accelerator.is_main_process:
        checkpoint_state.recover(last)
    accelerator.wait_for_everyone()
    state = json.loads((last / STATE_FILE).read_text()) if (last / STATE_FILE).exists() else None
    if state is None:
        return {"epoch": 0, "step": 0, "best_val_mse": float("inf"), "best_val_objective": float("inf"),
                "history": [], "settings": resume_settings(config)}
    checkpoint_state.check_settings(state, resume_settings(config), last)
    accelerator.load_state(str(last))
    accelerator.print(f"resuming from {last} after epoch {state['epoch']}")
    return state


def train_epoch(prepared: Setup, config: CompressorJobConfig, accelerator: Accelerator, state: dict, epoch: int,
                advance) -> dict:
    """One pass over the training batches; returns the epoch's metrics (with its validation)."""
    prepared.model.train()
    epoch_loss, batches, samples, epoch_started = 0.0, 0, 0, time.perf_counter()
    term_sums: dict[str, float] = {}
    for batch in prepared.train_loader:
        loss, terms = objective(prepared.model(batch["children"], batch["mask"]), batch, config.train)
        if not torch.isfinite(loss):
            raise TrainingDiverged(
                f"non-finite loss at epoch {epoch + 1}, step {state['step']}; the checkpoints in {config.out} are "
                f"from epoch {state['epoch']}. Lower train.lr (now {config.train.lr}) or check the data.")
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(prepared.model.parameters(), config.train.grad_clip)
        prepared.optimizer.step()
        prepared.scheduler.step()
        prepared.optimizer.zero_grad()
        epoch_loss, batches, state["step"] = epoch_loss + loss.item(), batches + 1, state["step"] + 1
        for name, value in terms.items():
            term_sums[name] = term_sums.get(name, 0.0) + value
        samples += len(batch["children"]) * accelerator.num_processes
        advance()
    return {"epoch": epoch + 1, "train_loss": epoch_loss / max(batches, 1),
            **{f"train_{k}": v / max(batches, 1) for k, v in term_sums.items()},
            "lr": prepared.scheduler.get_last_lr()[0],
            "samples_per_s": round(samples / (time.perf_counter() - epoch_started), 1),
            **evaluate(prepared.model, prepared.val_loader, accelerator, config.train)}


def save_best(prepared: Setup, config: CompressorJobConfig, accelerator: Accelerator, state: dict, metrics: dict,
              tracker) -> None:
    """``out/best``: the compressor of the epoch with the lowest validation objective so far."""
    state["best_val_mse"], state["best_val_objective"] = metrics.get("val_mse"), metrics["val_objective"]
    if accelerator.is_main_process:
        save_checkpoint(accelerator.unwrap_model(prepared.model), Path(config.out) / "best", {
            "config": to_dict(config), "data": config.records_file,
            "data_sha256": hashlib.sha256(Path(config.records_file).read_bytes()).hexdigest()[:16],
            "n_train": prepared.n_train, "n_val": prepared.n_val, "metrics": metrics,
            "tracking_run": tracker.id if tracker else None})


def save_last(config: CompressorJobConfig, accelerator: Accelerator, state: dict) -> None:
    """The full training state (accelerate's: model, optimizer, schedule, RNG) staged and swapped into ``out/last``
    whole, the JSON state last: a kill leaves the last whole epoch."""
    last = Path(config.out) / "last"
    if accelerator.is_main_process:
        checkpoint_state.start_step(last)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(checkpoint_state.staging_path(last)))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        checkpoint_state.commit(last, state, STATE_FILE)
    accelerator.wait_for_everyone()


def summarise(config: CompressorJobConfig, prepared: Setup, state: dict, started: float, tracker,
              accelerator: Accelerator) -> dict:
    """The run's summary and ``metrics.json`` (with the per-epoch history)."""
    history = state["history"]
    summary = {"objective": config.train.objective, "best_val_objective": state["best_val_objective"],
               "initial_val_objective": history[0]["val_objective"],
               "best_val_mse": state["best_val_mse"], "initial_val_mse": history[0].get("val_mse"),
               "epochs": state["epoch"], "n_train": prepared.n_train, "n_val": prepared.n_val, **prepared.coverage,
               "seconds": round(time.perf_counter() - started, 1),
               # how the run was spread: the processes that shared each step's batches, and accelerate's name for it
               "processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
               **{k: v for k, v in history[-1].items() if k.startswith(("val_", "mean_pool"))}}
    if tracker is not None:
        tracker.summary(summary)
        tracker.finish()
        (Path(config.out) / "metrics.json").write_text(json.dumps({**summary, "history": history}, indent=2))
        best = Path(config.out) / "best"
        manifest = json.loads((best / "overstory.json").read_text())
        # the set compressor works on its encoder's vectors: that encoder is the base its card names
        finish_checkpoint(best, {**manifest, "base_model": manifest["encoder"], "recipe": "compressor"},
                          {"data": config.records_file}, summary, "overstory", config.push_to_hub)
        accelerator.print(json.dumps(summary, indent=2))
    return summary


def run(config: CompressorJobConfig) -> dict:
    # --- setup -------------------------------------------------------------------------------------
    accelerator = Accelerator(cpu=cpu_ddp(), kwargs_handlers=accelerator_handlers())
    set_seed(config.train.seed)
    prepared = setup(config, accelerator)
    state = resume(config, prepared, accelerator)
    tracker = start_run(config.tracking, "train compressor", config) if accelerator.is_main_process else None
    started = time.perf_counter()
    if not state["history"]:
        # The untrained compressor is the mean of its children: the first candidate for "best", so a
        # run that only overfits never leaves a checkpoint worse than the mean_pool baseline.
        initial = {"epoch": 0, "train_loss": None, "lr": prepared.scheduler.get_last_lr()[0],
                   **evaluate(prepared.model, prepared.val_loader, accelerator, config.train)}
        state["history"].append(initial)
        save_best(prepared, config, accelerator, state, initial, tracker)

    # --- train, and save every epoch ---------------------------------------------------------------
    epochs, per_epoch = config.train.epochs, len(prepared.train_loader)
    with JobProgress(disable=not accelerator.is_main_process) as progress:
        task = progress.add_task(f"epoch {state['epoch'] + 1}/{epochs}", total=epochs * per_epoch,
                                 completed=state["epoch"] * per_epoch)
        for epoch in range(state["epoch"], epochs):
            metrics = train_epoch(prepared, config, accelerator, state, epoch, lambda: progress.advance(task))
            state["history"].append(metrics)
            state["epoch"] = epoch + 1
            if metrics["val_objective"] < state["best_val_objective"]:
                save_best(prepared, config, accelerator, state, metrics, tracker)
            save_last(config, accelerator, state)
            if tracker is not None:
                tracker.log(metrics, step=state["step"])
            progress.update(task, description=f"epoch {epoch + 1}/{epochs}: val_objective "
                                              f"{metrics['val_objective']:.4f}")

    # --- evaluate ----------------------------------------------------------------------------------
    return summarise(config, prepared, state, started, tracker, accelerator)
