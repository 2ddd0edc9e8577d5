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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overstory.core.config import ConfigError, to_dict
from overstory.core.records import PlannerTrace, read_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.splits import split_by_document
from overstory.models.registry import SMOLLM2, load_causal_lm
from overstory.training.callbacks import StopOnNonFiniteLoss, TrackingCallback
from overstory.training.common import (
    LoraSettings,
    final_eval_loss,
    lora_config,
    newest_checkpoint,
    save_final,
    size_metrics,
)
from overstory.training.planner_common import trace_rows
from overstory.training.sft import SftTrainSettings, check_sft_section, sft_args


@dataclass(frozen=True)
class PlannerSftConfig:
    traces: str
    out: str
    model: str = SMOLLM2
    lora: LoraSettings = field(default_factory=LoraSettings)
    train: SftTrainSettings = field(default_factory=SftTrainSettings)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # TRL SFTConfig fields passed through after the train block (docs/training.md, "TRL's own settings")
    trl: dict[str, Any] = field(default_factory=dict)
    push_to_hub: str = ""  # a hub repo id: out/final and its model card are uploaded there at the end
    # train on the traces of these datasets' documents only (a doc_id's prefix: qasper, squad, narrativeqa, ...);
    # empty: every trace. [qasper, squad] is the planner trained on gold levels only, without pseudo-labels
    datasets: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_sft_section(self.trl, self.train)


def dataset_of(trace: PlannerTrace) -> str:
    """The dataset a trace's document belongs to: its doc_id's prefix (``qasper/1601.03313`` -> ``qasper``)."""
    return trace.doc_id.split("/", 1)[0]


def select_datasets(traces: list[PlannerTrace], datasets: list[str]) -> list[PlannerTrace]:
    """The traces of ``datasets`` (all of them when empty); a named dataset with no trace is a config error, so a
    misspelt name cannot silently train on less."""
    if not datasets:
        return traces
    present = {dataset_of(t) for t in traces}
    if missing := [name for name in datasets if name not in present]:
        raise ConfigError(f"datasets: {missing} have no trace in these traces (their datasets: {sorted(present)})")
    return [t for t in traces if dataset_of(t) in datasets]


def run(config: PlannerSftConfig) -> dict:
    from datasets import Dataset
    from trl import SFTTrainer

    # --- setup -------------------------------------------------------------------------------------
    out = Path(config.out)
    all_traces = list(read_jsonl(config.traces, PlannerTrace))
    if not all_traces:
        raise ValueError(f"{config.traces} holds no traces (the teacher pool yielded nothing); "
                         f"run `overstory data traces` and check its yield table")
    traces = select_datasets(all_traces, config.datasets)
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
               "n_traces_by_dataset": dict(Counter(dataset_of(t) for t in traces)),
               "n_left_out_by_dataset": dict(Counter(dataset_of(t) for t in all_traces)
                                             - Counter(dataset_of(t) for t in traces)),
               "seconds": round(time.perf_counter() - started, 1),
               "tokens_seen": trainer.state.num_input_tokens_seen,  # non-padding, all processes, since step 0
               **size_metrics(trainer.model)}
    if val_traces:
        metrics["eval_loss"] = final_eval_loss(trainer)
    save_final(trainer, tokenizer, out, {
        "kind": "planner", "base_model": config.model, "adapter": config.lora.enabled and not config.lora.merge,
        "recipe": "planner_sft", "config": to_dict(config), "traces": config.traces,
        "traces_sha256": hashlib.sha256(Path(config.traces).read_bytes()).hexdigest()[:16],
        "teachers": sorted({t.teacher for t in traces}), "tracking_run": tracker.id if tracker else None},
        metrics, history=trainer.state.log_history, merge_lora=config.lora.enabled and config.lora.merge,
        data={"traces": config.traces}, push_to_hub=config.push_to_hub)
    if tracker:
        tracker.summary(metrics)
        tracker.finish()
        print(json.dumps(metrics, indent=2))
    return metrics
