"""`overstory eval planner`: planning accuracy, format, length, speed and downstream QA of planner checkpoints.

    overstory eval planner --config configs/eval/planner.yaml --checkpoint DIR --data FILE --out DIR
    overstory eval planner --config configs/eval/planner.yaml --compare base,sft,grpo,stitch

Every variant plans the same held-out questions (the validation documents of the pseudo-labels'
split by document), greedily, with the planner prompt. Per variant: exact (min, max) accuracy
against the pseudo-labels and against SQuAD's gold levels, within-one-level accuracy, format-valid
rate (``format_valid``: the runtime's tolerant parser found a plan; ``format_valid_strict``: the reply ends in
the exact JSON the prompt asks for, see ``strict_plan_valid``), median and p90 completion tokens, seconds per
plan, and, through the SmartChunk runtime (retrieval over the predicted range of the question's document, then
the generator), QA accuracy and recall@k. An invalid plan falls back to the full range (sentence..document),
as a runtime would, and is counted as a format failure. The report's ``majority_baseline`` is the reference
every variant must beat: always answering the training labels' most common range. ``--compare`` names variants
from ``variants`` and also draws their training curves (reward and solve rate over steps, SFT injections
marked) from the metrics the recipes wrote next to each checkpoint. With ``unlabelled``, the held-out documents'
questions that the backbone never answered (no label) are planned too and counted in ``format_valid_all`` and
``format_valid_strict_all`` only: on a small model most questions have no label, and format is a property of
the prompt, not of the label. Writes ``metrics.json``,
``planner_comparison.png`` and ``training_curves.png``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from overstory.core.config import ConfigError, to_dict
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.formats import LEVELS, PseudoLabel, read_jsonl
from overstory.data_pipeline.planner_examples import PlannerDataConfig, planner_rows, unlabelled_rows
from overstory.evaluation.plots import plot_planner_comparison, plot_training_curves
from overstory.models.planner import parse_plan, strict_plan_valid
from overstory.models.registry import base_model_of, load_lm_checkpoint
from overstory.retrieval.answer import clean_answer
from overstory.retrieval.judge import CorrectnessConfig, is_correct
from overstory.retrieval.metrics import mean, percentile, recall_at_k
from overstory.retrieval.smartchunk import DocumentRetrievers
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig
from overstory.serving.launch import stack_in_background

FALLBACK_RANGE = ("sentence", "document")


@dataclass(frozen=True)
class EvalPlannerConfig:
    data: str  # pseudo-label JSONL (`overstory data pseudo-labels`)
    out: str
    checkpoint: str = ""  # one planner (adapter folder, full model folder or model name)
    # named variants for --compare, e.g. {base: builtin:..., sft: runs/train/planner_sft/final}
    variants: dict[str, str] = field(default_factory=dict)
    compare: str = ""  # comma-separated names from `variants`; empty: evaluate `checkpoint`
    hierarchy: str = ""  # the chunks the labels refer to; empty: the one stored beside the labels
    metadata_tokens: int = 1000  # how much of the document the planner reads (as in training)
    val_fraction: float = 0.2  # must match the training runs' data.val_fraction
    max_new_tokens: int = 160
    length_limit: int = 128  # L_max: completions above it count as over-long
    batch_size: int = 8
    limit: int = 0  # at most this many held-out questions (0 = all)
    # also plan the held-out documents' questions without a correct label (at most `limit` of them): they count in
    # format_valid_all / format_valid_strict_all only, since they have no range to compare with
    unlabelled: bool = False
    qa: bool = True  # QA accuracy and recall@k through SmartChunk for the predicted ranges
    k: int = 5
    correctness: CorrectnessConfig = field(default_factory=CorrectnessConfig)
    # a running stack with the generator and embedder roles for `qa` (e.g. the quickstart's); empty: start `serve`
    server_url: str = ""
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        names = [n for n in self.compare.split(",") if n]
        unknown = [n for n in names if n not in self.variants]
        if unknown:
            raise ConfigError(f"compare: {', '.join(unknown)} not in variants ({', '.join(self.variants) or 'none'})")
        if not names and not self.checkpoint:
            raise ConfigError("give checkpoint (one planner) or compare (names from variants)")

    def selected(self) -> dict[str, str]:
        names = [n for n in self.compare.split(",") if n]
        return {n: self.variants[n] for n in names} if names else {"planner": self.checkpoint}


@torch.no_grad()
def generate_plans(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, batch_size: int
                   ) -> tuple[list[str], list[int], float]:
    """Greedy replies, their token counts and the seconds per plan (batched, left padding)."""
    model.eval()
    tokenizer.padding_side = "left"
    texts, lengths = [], []
    started = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        chunk = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                 for p in prompts[start: start + batch_size]]
        batch = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        output = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens,
                                pad_token_id=tokenizer.pad_token_id)
        for row in output[:, batch["input_ids"].shape[1]:]:
            ids = [t for t in row.tolist() if t != tokenizer.pad_token_id]
            lengths.append(len(ids))
            texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return texts, lengths, (time.perf_counter() - started) / max(len(prompts), 1)


def _distance(a: str, b: str) -> int:
    return abs(LEVELS.index(a) - LEVELS.index(b))


def _within_one(levels: tuple[str, str], row: dict) -> bool:
    """Both ends of the range within one level of the row's label."""
    return _distance(levels[0], row["level_min"]) <= 1 and _distance(levels[1], row["level_max"]) <= 1


def score_plans(rows: list[dict], replies: list[str], lengths: list[int], length_limit: int) -> tuple[dict, list]:
    """Planning metrics of one variant, and the range each question is answered from."""
    plans = [parse_plan(text) for text in replies]
    ranges = [p.levels if p.valid else FALLBACK_RANGE for p in plans]
    exact = [float(p.levels == (r["level_min"], r["level_max"])) for p, r in zip(plans, rows)]
    gold = [float(p.levels == (r["gold_level_min"], r["gold_level_max"])) if r["gold_level_min"] else None
            for p, r in zip(plans, rows)]
    within = [float(p.valid and _within_one(p.levels, r)) for p, r in zip(plans, rows)]
    metrics = {"accuracy": mean(exact), "accuracy_gold": mean(gold), "within_one_level": mean(within),
               "format_valid": mean([float(p.valid) for p in plans]),
               "format_valid_strict": mean([float(strict_plan_valid(text)) for text in replies]),
               "median_completion_tokens": percentile(lengths, 50), "p90_completion_tokens": percentile(lengths, 90),
               "over_length": mean([float(n > length_limit) for n in lengths])}
    return metrics, ranges


def run(config: EvalPlannerConfig) -> dict:
    variants = config.selected()
    data = PlannerDataConfig(labels=config.data, hierarchy=config.hierarchy, metadata_tokens=config.metadata_tokens,
                             val_fraction=config.val_fraction)
    train_rows, val_rows, chunks = planner_rows(data, base_model_of(next(iter(variants.values()))))
    rows = (val_rows or train_rows)[: config.limit or None]
    extra = []
    if config.unlabelled:
        held_out_docs = {r["doc_id"] for r in (val_rows or train_rows)}
        extra = unlabelled_rows(data, base_model_of(next(iter(variants.values()))), held_out_docs)
        extra = extra[: config.limit or None]
    evidence = {label.id: label.evidence for label in read_jsonl(config.data, PseudoLabel)}
    report: dict = {"n_questions": len(rows), "n_unlabelled": len(extra),
                    "split": "validation documents" if val_rows else "all (no split)",
                    "majority_baseline": majority_baseline(train_rows, rows), "variants": {},
                    "checkpoints": variants, "config": to_dict(config)}
    qa_cache: dict[tuple[str, str, str], tuple[float, float]] = {}
    with ExitStack() as stack:
        tracker = stack.enter_context(start_run(config.tracking, "eval planner", config))
        retrievers = client = None
        if config.qa:
            client = Client.from_url(config.server_url or stack.enter_context(stack_in_background(config.serve)))
            retrievers = DocumentRetrievers(chunks, client)
        for name, checkpoint in variants.items():
            model, tokenizer, _ = load_lm_checkpoint(checkpoint)
            replies, lengths, seconds = generate_plans(model, tokenizer, [r["prompt"] for r in rows + extra],
                                                       config.max_new_tokens, config.batch_size)
            metrics, ranges = score_plans(rows, replies[: len(rows)], lengths[: len(rows)], config.length_limit)
            if extra:  # the format rates over every planned question, labelled or not
                metrics["format_valid_all"] = mean([float(parse_plan(text).valid) for text in replies])
                metrics["format_valid_strict_all"] = mean([float(strict_plan_valid(text)) for text in replies])
            metrics["seconds_per_plan"] = round(seconds, 3)
            if retrievers is not None:
                outcomes = []
                for row, (low, high) in zip(rows, ranges):
                    key = (row["example_id"], low, high)  # greedy answers: one per (question, range) for all variants
                    if key not in qa_cache:
                        reply, read = retrievers[row["doc_id"]].answer(row["question"], low, high, k=config.k)
                        qa_cache[key] = (float(is_correct(clean_answer(reply.text), row["answers"], row["question"],
                                                          config.correctness, client)),
                                         recall_at_k(read, evidence.get(row["example_id"], []), config.k))
                    outcomes.append(qa_cache[key])
                metrics["qa_accuracy"] = mean([correct for correct, _ in outcomes])
                metrics[f"recall@{config.k}"] = mean([recall for _, recall in outcomes])
            metrics["examples"] = [{"id": r["example_id"], "label": [r["level_min"], r["level_max"]], "reply": text}
                                   for r, text in zip(rows[:5], replies[:5])]
            report["variants"][name] = metrics
            tracker.log({f"{name}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
            del model
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(report, indent=2))
    plot_planner_comparison(report["variants"], out / "planner_comparison.png",
                            report["majority_baseline"]["accuracy"])
    if len(variants) > 1:
        curves = {name: training_history(checkpoint) for name, checkpoint in variants.items()}
        plot_training_curves({k: v for k, v in curves.items() if v}, out / "training_curves.png")
    _print(report)
    return report


def majority_baseline(train_rows: list[dict], rows: list[dict]) -> dict:
    """The reference a planner must beat to have learned anything from the question: always answering the
    training labels' most common range. Its accuracy on ``rows``; ``within_one_level`` as for the variants.

    >>> train = [{"level_min": "sentence", "level_max": "section"}] * 2 + [{"level_min": "sentence",
    ...          "level_max": "document"}]
    >>> held_out = [{"level_min": "sentence", "level_max": "section"}, {"level_min": "paragraph",
    ...             "level_max": "document"}]
    >>> majority_baseline(train, held_out)
    {'label': ['sentence', 'section'], 'accuracy': 0.5, 'within_one_level': 1.0}
    """
    counts = Counter((r["level_min"], r["level_max"]) for r in train_rows)
    low, high = counts.most_common(1)[0][0]
    return {"label": [low, high],
            "accuracy": mean([float((r["level_min"], r["level_max"]) == (low, high)) for r in rows]),
            "within_one_level": mean([float(_within_one((low, high), r)) for r in rows])}


def training_history(checkpoint: str) -> list[dict]:
    """Per-step training records a recipe wrote beside ``checkpoint`` (``<run>/final`` -> ``<run>/metrics.json``)."""
    metrics = Path(checkpoint).parent / "metrics.json"
    if not Path(checkpoint).exists() or not metrics.exists():
        return []
    return [row for row in json.loads(metrics.read_text()).get("history", []) if "step" in row]


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"planner variants on {report['n_questions']} held-out questions")
    columns = [("accuracy", "acc"), ("accuracy_gold", "acc gold"), ("within_one_level", "within 1"),
               ("format_valid", "format ok"), ("format_valid_strict", "strict ok"),
               ("median_completion_tokens", "median tok"),
               ("p90_completion_tokens", "p90 tok"), ("seconds_per_plan", "s/plan"), ("qa_accuracy", "QA acc"),
               ("recall@5", "recall@5")]
    table.add_column("variant")
    for _, title in columns:
        table.add_column(title, justify="right")
    for name, metrics in report["variants"].items():
        table.add_row(name, *("-" if metrics.get(key) is None else f"{metrics[key]:.3g}" for key, _ in columns))
    Console(width=140).print(table)
    majority = report["majority_baseline"]
    print(f"reference: always {majority['label']} (the training labels' most common range): accuracy "
          f"{majority['accuracy']:.3g}, within one level {majority['within_one_level']:.3g}")
    if report.get("n_unlabelled"):
        total = report["n_questions"] + report["n_unlabelled"]
        print(f"format valid (strict) on all {total} planned questions, {report['n_unlabelled']} of them without a "
              f"label: " + ", ".join(f"{name} {m['format_valid_all']:.2f} ({m['format_valid_strict_all']:.2f})"
                                     for name, m in report["variants"].items()))
