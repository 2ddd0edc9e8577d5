"""LATTICE's traversal scorer distilled into a small served model: `overstory train distill-scorer`.

    overstory train distill-scorer --config configs/train/distill_scorer_llm.yaml
    overstory train distill-scorer --config configs/train/distill_scorer_cross_encoder.yaml

Reads the teacher-scored slates of ``overstory data lattice-traces`` (``training/distill_data.py``), holds out a
share of the queries, and trains one of two students. ``traces`` is one traces file or several (a YAML list, or on
the command line ``traces=[a.jsonl,b.jsonl]`` or ``traces=a.jsonl,b.jsonl``): their slates are read as one set, the
split by query is over the union of their queries, and a query traced in two files is refused by name. The manifest
records each file with its digest, the teachers its slates name and the model that served them (from the traces job's
``<stem>.settings.json``).

* ``student: llm``: LoRA on a causal LM (the built-in SmolLM2 by default, any hub model by ``model``) with TRL's
  SFTTrainer, to write the teacher's JSON for a slate given the scorer's own slate prompt. ``out/final`` is a
  PEFT adapter: vLLM serves it as ``--lora-modules scorer=runs/train/distill_scorer-llm/final``, the embedded
  server as a ``scorer`` role whose model is that folder. Teacher targets only (the JSON is the teacher's).
* ``student: cross_encoder``: a sentence-transformers ``CrossEncoder`` (from the built-in MiniLM by default: its
  BERT body and a new one-label head) trained with ``CrossEncoderTrainer`` on (query, candidate text) pairs,
  internal-node descriptions and leaves alike, with one of three losses, all on the model's one logit:
  ``pointwise`` (binary cross-entropy with logits on the target in [0, 1]), ``listwise`` (ListNet over a slate's
  candidates) or ``lambdaloss`` (LambdaLoss, NDCG-Loss2++ weighting, over a slate's candidates); the listwise two
  take targets * ``listwise_label_scale``: ListNet compares softmax distributions, and on a 0-1 scale a 100-vs-0
  teacher preference would be a mild e^1 (on 0-10 it is e^10); LambdaLoss reads them as graded gains.
  ``activation`` (``sigmoid`` or ``identity``) is what the saved model puts on that logit, so what the server
  serves, and what the listwise two train through (sentence-transformers' ``activation_fn``): ListNet and
  LambdaLoss see the sigmoid's output when it is served, so the two activations are two different models, and
  sentence-transformers' advice (identity for listwise losses: they learn differences between scores, and a
  sigmoid saturates them and flattens the ranking) is a comparison the eval can make. ``pointwise`` trains the
  logit with BCE-with-logits under either: its sigmoid is inside the loss, so the activation only decides whether
  the server returns the probability (``sigmoid``) or the logit. The defaults are ``pointwise`` with
  ``sigmoid``; ``configs/train/distill_scorer_cross_encoder.yaml`` gives the commands for every combination and
  ``configs/eval/lattice.yaml`` has a row for each. ``out/final`` is a CrossEncoder folder that ``overstory serve``
  puts behind ``/score`` and ``/v1/rerank`` (role kind ``cross-encoder``). ``targets: gold`` or ``mix`` trains on
  relevance labels instead of (or beside) the teacher: such a model is reported as its own row, never as distilled.

Both write ``out/heldout_queries.json`` (the held-out query ids, which ``eval lattice`` scores agreement on),
``out/metrics.json`` and the ``overstory.json`` manifest. Checkpoints go to ``out/checkpoints``; a rerun resumes
from the newest, only under the settings they were trained with (``out/resume_settings.json``, written when the run
starts afresh): a rerun that changes what is trained (the student, its loss or activation, the targets, the traces'
content, all files in order, a training setting other than its length) is refused naming the keys that differ,
before anything in ``out`` is touched, as the other recipes refuse theirs (``training/checkpoint_state.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from overstory.core.config import ConfigError, path_list, to_dict
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.fanout import settings_path
from overstory.models.registry import MINILM, SMOLLM2, init_cross_encoder, load_causal_lm
from overstory.training import checkpoint_state
from overstory.training.callbacks import StopOnNonFiniteLoss, TrackingCallback
from overstory.training.common import (
    LoraSettings,
    final_eval_loss,
    lora_config,
    newest_checkpoint,
    save_final,
    size_metrics,
    write_manifest,
)
from overstory.training.distill_data import (
    Targets,
    TracedSlate,
    listwise_rows,
    llm_rows,
    pointwise_rows,
    read_trace_files,
    split_slates,
)
from overstory.training.model_card import finish_checkpoint
from overstory.training.sft import SftTrainSettings, check_sft_section, checkpointing_field, sft_args

SETTINGS_FILE = "resume_settings.json"  # in out: the settings the checkpoints were trained with
# the saved cross-encoder's activation by its configured (and served) name
ACTIVATIONS: dict[str, type[torch.nn.Module]] = {"sigmoid": torch.nn.Sigmoid, "identity": torch.nn.Identity}


@dataclass(frozen=True)
class DistillScorerConfig:
    # slates from `overstory data lattice-traces`: one file, a list, or one string of comma-separated paths
    traces: str | list[str]
    out: str
    student: Literal["llm", "cross_encoder"] = "llm"
    model: str = ""  # empty: the built-in SmolLM2 (llm) or MiniLM (cross_encoder)
    targets: Targets = "teacher"
    loss: Literal["pointwise", "listwise", "lambdaloss"] = "pointwise"  # cross_encoder only
    activation: Literal["sigmoid", "identity"] = "sigmoid"  # cross_encoder only: what the saved model serves
    listwise_label_scale: float = 10.0
    max_candidate_chars: int = 600  # as the search's scorer shows candidates
    max_reasoning_chars: int = 400  # llm: the teacher's reasoning is cut to the serving schema's cap
    lora: LoraSettings = field(default_factory=LoraSettings)  # llm only
    train: SftTrainSettings = field(default_factory=SftTrainSettings)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # llm only: TRL SFTConfig fields passed through after the train block (docs/training.md, "TRL's own settings")
    trl: dict[str, Any] = field(default_factory=dict)
    push_to_hub: str = ""  # a hub repo id: out/final and its model card are uploaded there at the end

    def __post_init__(self) -> None:
        if not self.trace_files:
            raise ConfigError("traces: name at least one traces file of `overstory data lattice-traces`")
        if self.student == "cross_encoder" and self.trl:
            raise ConfigError("trl applies to student=llm (TRL's SFTTrainer); the cross-encoder student trains with "
                              "sentence-transformers' CrossEncoderTrainer: leave trl empty")
        check_sft_section(self.trl, self.train)
        if self.student == "llm" and self.targets != "teacher":
            raise ConfigError(f"targets={self.targets!r} needs student=cross_encoder: the llm student learns the "
                              "teacher's JSON, which only teacher targets define")
        if self.student == "llm" and self.loss != "pointwise":
            raise ConfigError("loss applies to student=cross_encoder only; leave it 'pointwise' for the llm student")
        if self.student == "llm" and self.activation != "sigmoid":
            raise ConfigError("activation applies to student=cross_encoder only; leave it 'sigmoid' for the llm "
                              "student")
        if self.listwise_label_scale <= 0:
            raise ConfigError(f"listwise_label_scale must be positive, got {self.listwise_label_scale}")

    @property
    def trace_files(self) -> list[str]:
        """``traces`` as a list of paths (a single path is a list of one; a string may list several, comma-separated,
        as a command-line override ``traces=a.jsonl,b.jsonl`` gives them)."""
        return path_list(self.traces)

    @property
    def model_name(self) -> str:
        return self.model or (SMOLLM2 if self.student == "llm" else MINILM)


def run(config: DistillScorerConfig) -> dict:
    files = config.trace_files
    slates = read_trace_files(files)
    if not slates:
        raise ValueError(f"{', '.join(files)} holds no scored slates (every teacher reply failed, or the file is "
                         f"empty); run `overstory data lattice-traces` and check its failed_slates")
    traces_sha256 = traces_digest(files)
    check_resume(config, traces_sha256)
    train, heldout = split_slates(slates, config.train.val_fraction)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "heldout_queries.json").write_text(json.dumps(sorted({s.query_id for s in heldout}), indent=1))
    manifest = {"kind": "scorer", "student": config.student, "base_model": config.model_name,
                "targets": config.targets, "distilled": config.targets == "teacher",
                "recipe": "distill_scorer", "config": to_dict(config), "traces": files,
                "traces_sha256": traces_sha256, "teachers": sorted({t for path in files for t in _teachers(path)}),
                "trace_files": [trace_file_record(path) for path in files]}
    train_fn = _train_llm if config.student == "llm" else _train_cross_encoder
    metrics = train_fn(config, train, heldout, manifest)
    print(json.dumps(metrics, indent=2))
    return metrics


def resume_settings(config: DistillScorerConfig, traces_sha256: str) -> dict:
    """What decides what a run trains: the config but its length (``train.epochs``, ``train.max_steps``, which a
    resume may extend), its logging and evaluation cadence, output folder and tracking; the traces by their content
    (a traces job that resumed appends to the same file, and a moved file is the same data)."""
    settings = to_dict(config)
    for key in ("out", "tracking", "traces", "push_to_hub"):
        settings.pop(key)
    for key in ("epochs", "max_steps", "logging_steps", "eval_at"):
        settings["train"].pop(key)
    return {**settings, "traces_sha256": traces_sha256}


def check_resume(config: DistillScorerConfig, traces_sha256: str) -> None:
    """Before ``out`` is written to: refuse a rerun whose checkpoints were trained under other settings (or under
    settings never recorded), naming the keys; a run without checkpoints records its settings (rank 0 only)."""
    out = Path(config.out)
    settings, record = resume_settings(config, traces_sha256), out / SETTINGS_FILE
    if any(path.is_dir() for path in (out / "checkpoints").glob("checkpoint-*")):
        state = json.loads(record.read_text()) if record.exists() else {}
        checkpoint_state.check_settings(state, settings, out / "checkpoints")
    elif int(os.environ.get("RANK", 0)) == 0:
        checkpoint_state.atomic_write_text(record, json.dumps({"settings": settings}, indent=2))


def traces_digest(paths: list[str]) -> str:
    """The traces' content, every file in order (one file: the digest of its bytes, as runs before lists had it;
    the files are whole JSONL lines, so their concatenation decides the slates)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def trace_file_record(path: str) -> dict:
    """What the manifest keeps of one traces file: its path, digest, the teachers its slates name, the models that
    served its traces job (``served`` in its settings record; empty when the job ran without a server) and the slate
    reply schema the teacher was held to (``slate_schema``; "not recorded" for traces made before it was recorded,
    whose schema let the teacher leave candidates unscored)."""
    record = settings_path(path)
    settings = json.loads(record.read_text()) if record.exists() else {}
    return {"path": path, "sha256": traces_digest([path]), "teachers": _teachers(path),
            "served": settings.get("served", {}), "slate_schema": settings.get("slate_schema", "not recorded")}


def trace_data(paths: list[str]) -> dict[str, str]:
    """The traces files as the model card lists its data (name -> path)."""
    return {f"traces[{i}]": path for i, path in enumerate(paths)}


def _teachers(path: str) -> list[str]:
    with open(path) as handle:
        return sorted({json.loads(line).get("teacher", "") for line in handle if line.strip()})


def _train_llm(config: DistillScorerConfig, train: list[TracedSlate], heldout: list[TracedSlate],
               manifest: dict) -> dict:
    from datasets import Dataset
    from trl import SFTTrainer

    train_rows = llm_rows(train, config.max_candidate_chars, config.max_reasoning_chars)
    val_rows = llm_rows(heldout, config.max_candidate_chars, config.max_reasoning_chars)
    if not train_rows:
        raise ValueError(f"no fully scored training slate in {', '.join(config.trace_files)} ({len(train)} slates "
                         f"after the split); the llm student learns whole replies")
    model, tokenizer = load_causal_lm(config.model_name)
    args = sft_args(config, evaluate=bool(val_rows))
    tracker = start_run(config.tracking, "train distill-scorer", config) if args.process_index == 0 else None
    trainer = SFTTrainer(
        model=model, args=args, processing_class=tokenizer, peft_config=lora_config(config.lora),
        train_dataset=Dataset.from_list(train_rows), eval_dataset=Dataset.from_list(val_rows) if val_rows else None,
        callbacks=[StopOnNonFiniteLoss(f"lower train.lr (now {config.train.lr})"),
                   *([TrackingCallback(tracker)] if tracker else [])])
    if len(trainer.train_dataset) == 0:  # TRL drops rows whose completion truncation cut away entirely
        raise ValueError(f"every slate prompt fills train.max_length={config.train.max_length} tokens; raise it or "
                         f"lower max_candidate_chars (now {config.max_candidate_chars})")
    started = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=newest_checkpoint(args.output_dir))
    metrics = {"student": "llm", "train_loss": result.training_loss, "steps": trainer.state.global_step,
               "n_train_slates": len(train_rows), "n_heldout_slates": len(val_rows),
               "seconds": round(time.perf_counter() - started, 1),
               "tokens_seen": trainer.state.num_input_tokens_seen, **size_metrics(trainer.model)}
    if val_rows:
        metrics["eval_loss"] = final_eval_loss(trainer)
    save_final(trainer, tokenizer, config.out,
               {**manifest, "adapter": config.lora.enabled and not config.lora.merge,
                "tracking_run": tracker.id if tracker else None},
               metrics, history=trainer.state.log_history, merge_lora=config.lora.enabled and config.lora.merge,
               data=trace_data(config.trace_files), push_to_hub=config.push_to_hub)
    if tracker:
        tracker.summary(metrics)
        tracker.finish()
    return metrics


def _cross_encoder_columns(config: DistillScorerConfig, slates: list[TracedSlate]) -> dict[str, list]:
    if config.loss == "pointwise":
        return pointwise_rows(slates, config.targets, config.max_candidate_chars)
    return listwise_rows(slates, config.targets, config.max_candidate_chars, config.listwise_label_scale)


def _train_cross_encoder(config: DistillScorerConfig, train: list[TracedSlate], heldout: list[TracedSlate],
                         manifest: dict) -> dict:
    from datasets import Dataset
    from sentence_transformers.cross_encoder import CrossEncoderTrainer, CrossEncoderTrainingArguments, losses

    train_columns, val_columns = _cross_encoder_columns(config, train), _cross_encoder_columns(config, heldout)
    if not train_columns["query"]:
        raise ValueError(f"no training rows for loss={config.loss} in {', '.join(config.trace_files)} ({len(train)} "
                         f"slates after the split; a listwise row needs two scored candidates)")
    model = init_cross_encoder(config.model_name, max_length=config.train.max_length, seed=config.train.seed)
    # what predict() and the server put on the logit, and what the listwise losses train through; BCE-with-logits
    # holds its own sigmoid, so the pointwise loss trains the logit under either
    model.activation_fn = ACTIVATIONS[config.activation]()
    head = ACTIVATIONS[config.activation]()
    loss = {"pointwise": lambda: losses.BinaryCrossEntropyLoss(model),
            "listwise": lambda: losses.ListNetLoss(model, activation_fn=head,
                                                   mini_batch_size=config.train.batch_size),
            "lambdaloss": lambda: losses.LambdaLoss(model, activation_fn=head,
                                                    mini_batch_size=config.train.batch_size)}[config.loss]()
    settings = config.train
    evaluate = bool(val_columns["query"])
    args = CrossEncoderTrainingArguments(
        output_dir=str(Path(config.out) / "checkpoints"), num_train_epochs=settings.epochs,
        max_steps=settings.max_steps, learning_rate=settings.lr, per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=settings.batch_size, gradient_accumulation_steps=settings.grad_accum,
        warmup_steps=settings.warmup_ratio, weight_decay=settings.weight_decay,  # a float < 1 is a ratio
        logging_steps=settings.logging_steps, **settings.save_and_eval_kwargs(evaluate), save_total_limit=2,
        seed=settings.seed, data_seed=settings.seed, bf16=settings.bf16, deepspeed=settings.deepspeed or None,
        report_to="none", logging_nan_inf_filter=False, **{checkpointing_field(): settings.gradient_checkpointing})
    tracker = start_run(config.tracking, "train distill-scorer", config) if args.process_index == 0 else None
    trainer = CrossEncoderTrainer(
        model=model, args=args, loss=loss, train_dataset=Dataset.from_dict(train_columns),
        eval_dataset=Dataset.from_dict(val_columns) if evaluate else None,
        callbacks=[StopOnNonFiniteLoss(f"lower train.lr (now {config.train.lr})"),
                   *([TrackingCallback(tracker)] if tracker else [])])
    started = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=newest_checkpoint(args.output_dir))
    metrics = {"student": "cross_encoder", "loss": config.loss, "activation": config.activation,
               "targets": config.targets,
               "train_loss": result.training_loss, "steps": trainer.state.global_step,
               "n_train_rows": len(train_columns["query"]), "n_heldout_rows": len(val_columns["query"]),
               "seconds": round(time.perf_counter() - started, 1)}
    if evaluate:
        metrics["eval_loss"] = final_eval_loss(trainer)
    final = Path(config.out) / "final"
    if trainer.is_world_process_zero():
        model.save(str(final))
        write_manifest(final, {**manifest, "tracking_run": tracker.id if tracker else None, "metrics": metrics})
        finish_checkpoint(final, manifest, trace_data(config.trace_files), metrics, "sentence-transformers",
                          config.push_to_hub)
        (Path(config.out) / "metrics.json").write_text(
            json.dumps({**metrics, "history": trainer.state.log_history}, indent=2))
    if tracker:
        tracker.summary(metrics)
        tracker.finish()
    return metrics
