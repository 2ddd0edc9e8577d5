"""`overstory eval planner`: planning accuracy, format, length, speed and downstream QA of planner checkpoints.

    overstory eval planner --config configs/eval/planner.yaml --checkpoint DIR --data FILE --out DIR
    overstory eval planner --config configs/eval/planner.yaml --compare base,sft,grpo,stitch

Every variant plans the same held-out questions (the validation documents of the labels' split by document, or
every question of ``data`` when ``train_data`` names the labels the planners were trained on), greedily, with
the planner prompt. Per variant (``planner_metrics.py``): exact (min, max) accuracy against the labels and
against the gold levels where the dataset has them, within-one-level accuracy, format-valid rate
(``format_valid``: the runtime's tolerant parser found a plan; ``format_valid_strict``: the reply ends in the exact
JSON the prompt asks for, see ``strict_plan_valid``), median and p90 completion tokens, seconds per plan, and,
through the SmartChunk runtime (retrieval over the predicted range of the question's document, then the
generator), QA accuracy, recall@k, the tokens the generator read and the mean size of the chunks it read. Every
rate comes with a 95% bootstrap interval (``ci95``), overall and per dataset (``by_dataset``; the labels may mix
datasets, the document id's prefix names each). An invalid plan is answered from ``fallback_range``, the SmartChunk
runtime's setting (``retrieval/smartchunk.py``), as the runtime would, and is counted as a format failure and as a
repair (``repairs.plan_unparsed``).

Without ``train_data`` the held-out questions are those of ``data``'s validation documents, split as the training
runs split them: ``val_fraction`` is read from the variants' manifests (``overstory.json`` beside each checkpoint:
``data.val_fraction``, or planner SFT's ``train.val_fraction``), and a value given here that differs from a
manifest's is refused, naming both.

The references, measured on the same questions in the same run: ``majority_baseline``, always answering the
training labels' most common range (overall and per dataset), for planning accuracy; and ``fixed_ranges``, each
range of ``fixed_ranges`` answered for every question with its QA score and tokens read, the best chosen on
``fixed_range_selection`` training questions (taken one dataset at a time), for the end-to-end trade-off.
``--compare`` names variants from ``variants`` and also draws their training curves (reward and solve rate over
steps, SFT injections marked) from the metrics the recipes wrote next to each checkpoint.

With ``unlabelled``, the held-out documents' questions that the backbone never answered (no label; at most
``limit`` more) are planned and scored too, on everything but the label: format, length and, with ``qa``, the QA
score, tokens read and chunk size of their plans and of the fixed ranges (a NarrativeQA planner is judged on every
question, not only the ones a 135M backbone could answer).

The answers through the runtime are kept as they come (``data_pipeline/planner_answers.py``: ``qa_answers.jsonl``, one
per question and range, asked ``concurrency`` at a time), so a killed run resumes; ``metrics.json`` names the models
that served them (``served``) and how many were asked and read back (``answers``).

Writes ``metrics.json``, ``planner_comparison.png``, ``chunk_size_by_dataset.png`` (the mean size of the chunks
each variant's plans read, per dataset: the SmartChunk paper's Figure 4b), ``qa_vs_tokens.png`` (per dataset, QA
score against the tokens given to the generator for every planner and every fixed range: the trade-off the paper
claims) and ``training_curves.png``; with ``qa``, ``paired`` in the metrics and ``paired.png``: planners compared
question by question with each other (``paired``) and with the best fixed range (``planner_paired.py``).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from overstory.core.config import ConfigError, to_dict
from overstory.core.progress import track
from overstory.core.records import LEVELS, Chunk, PseudoLabel, read_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.planner_answers import PlannerAnswers, chunk_fingerprints
from overstory.data_pipeline.planner_examples import (
    PlannerDataConfig,
    labelled_hierarchy,
    planner_rows,
    unlabelled_rows,
)
from overstory.evaluation.planner_metrics import (
    ALL_RANGES,
    by_dataset,
    dataset_of,
    fixed_ranges,
    majority_baseline,
    plan_outcomes,
    qa_outcome,
    spread_over_datasets,
    summarize,
)
from overstory.evaluation.planner_paired import paired_planners, parse_pair, question_records
from overstory.evaluation.plots import (
    plot_chunk_size_by_dataset,
    plot_paired_planners,
    plot_planner_comparison,
    plot_qa_vs_tokens_by_dataset,
    plot_training_curves,
)
from overstory.evaluation.repairs import repairs_cell
from overstory.models.registry import base_model_of, load_lm_checkpoint
from overstory.retrieval.answer import clean_answer
from overstory.retrieval.judge import CorrectnessConfig, is_correct
from overstory.retrieval.metrics import recall_at_k
from overstory.retrieval.smartchunk import FALLBACK_RANGE, DocumentRetrievers, check_fallback_range
from overstory.serving.config import ServeConfig
from overstory.serving.job_client import client_for


@dataclass(frozen=True)
class EvalPlannerConfig:
    data: str  # pseudo-label JSONL (`overstory data pseudo-labels`)
    out: str
    # the labels the planners were trained on (e.g. `overstory data mix`'s file): the majority range and the
    # fixed-range selection come from all of them, and every question of `data` is held out (e.g. the QASPER dev
    # papers' labels; no document may be in both). Empty: both come from `data`'s split by document
    train_data: str = ""
    checkpoint: str = ""  # one planner (adapter folder, full model folder or model name)
    # named variants for --compare, e.g. {base: builtin:..., sft: runs/train/planner_sft/final}
    variants: dict[str, str] = field(default_factory=dict)
    compare: str = ""  # comma-separated names from `variants`; empty: evaluate `checkpoint`
    hierarchy: str = ""  # the chunks the labels refer to; empty: the one stored beside the labels
    metadata_tokens: int = 1000  # how much of the document the planner reads (as in training)
    # the share of data's documents the training runs held out; null: the value their manifests record (they must
    # agree); a value given is checked against every manifest that records one. Not used (refused) with train_data
    val_fraction: float | None = None
    # the range an unparsed plan is answered from: the SmartChunk runtime's setting and default (smartchunk.py)
    fallback_range: tuple[str, str] = FALLBACK_RANGE
    max_new_tokens: int = 160
    length_limit: int = 128  # L_max: completions above it count as over-long
    batch_size: int = 8
    limit: int = 0  # at most this many held-out questions (0 = all)
    # also evaluate the held-out documents' questions without a label (at most `limit` more): every metric but the
    # label-based ones (accuracy, within_one_level), which have no range to compare with
    unlabelled: bool = False
    qa: bool = True  # QA accuracy and recall@k through SmartChunk for the predicted ranges
    k: int = 5
    # the fixed ranges answered for every held-out question as references ("all": every level_min..level_max);
    # the best is chosen on this many training questions (0: report the ranges without choosing); needs qa
    fixed_ranges: list[str] = field(default_factory=lambda: ["all"])
    fixed_range_selection: int = 50
    # planners compared question by question, "planner:other" (e.g. stitch:sft), each with qa; every compared
    # planner is also paired with the best fixed range. A pair naming a variant this run does not compare is skipped
    paired: list[str] = field(default_factory=list)
    correctness: CorrectnessConfig = field(default_factory=CorrectnessConfig)
    # QA answers in flight (a batching server such as vLLM answers several at once) and each one's time limit
    concurrency: int = 1
    request_timeout_s: float = 120.0
    # keep the answers already in <out>/qa_answers.jsonl (same settings; a killed run resumes); false: ask again
    resume: bool = True
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
        self.reference_ranges()  # a bad range names the key
        for text in self.paired:
            try:
                unknown = [name for name in parse_pair(text) if name not in self.variants]
            except ValueError as error:
                raise ConfigError(f"paired: {error}") from None
            if unknown:
                raise ConfigError(f"paired: {', '.join(unknown)} in {text!r} not in variants "
                                  f"({', '.join(self.variants) or 'none'})")
        if self.concurrency < 1 or self.request_timeout_s <= 0:
            raise ConfigError(f"concurrency must be >= 1 and request_timeout_s positive, got {self.concurrency} and "
                              f"{self.request_timeout_s}")
        if self.fixed_range_selection < 0:
            raise ConfigError(f"fixed_range_selection must be >= 0, got {self.fixed_range_selection}")
        if self.train_data and self.val_fraction is not None:
            raise ConfigError("val_fraction: not used with train_data (every question of data is held out); drop it")
        if self.val_fraction is not None and not 0 < self.val_fraction < 1:
            raise ConfigError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        check_fallback_range(self.fallback_range, "fallback_range")

    def reference_ranges(self) -> list[tuple[str, str]]:
        """``fixed_ranges`` as (level_min, level_max) pairs; none without ``qa`` (they are QA references)."""
        if not self.qa:
            return []
        if self.fixed_ranges == ["all"]:
            return list(ALL_RANGES)
        parsed = [tuple(text.split("..")) for text in self.fixed_ranges]
        bad = [text for text, pair in zip(self.fixed_ranges, parsed) if pair not in ALL_RANGES]
        if bad:
            raise ConfigError(f"fixed_ranges: {', '.join(bad)} is not a range level_min..level_max of "
                              f"{', '.join(LEVELS)} (smallest first), or give [all]")
        return parsed

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
    for start in track(range(0, len(prompts), batch_size), description=f"planning ({batch_size} per batch)"):
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


def manifest_val_fraction(checkpoint: str) -> tuple[float, Path] | None:
    """The share of documents a planner's training run held out, from the ``overstory.json`` beside the checkpoint
    (``config.data.val_fraction`` of GRPO and STITCH, ``config.train.val_fraction`` of planner SFT), with the
    manifest's path; None for a model name or a folder without a manifest recording one (a base model)."""
    path = Path(checkpoint) / "overstory.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text()).get("config", {})
    for section in ("data", "train"):
        value = (config.get(section) or {}).get("val_fraction")
        if value is not None:
            return float(value), path
    return None


def held_out_fraction(config: EvalPlannerConfig, variants: dict[str, str]) -> float | None:
    """The ``val_fraction`` that splits ``data`` as the variants' training runs split it: the configured one,
    refused when a manifest records another, or the one the manifests agree on. None with ``train_data``."""
    if config.train_data:
        return None
    recorded = {name: found for name, checkpoint in variants.items()
                if (found := manifest_val_fraction(checkpoint)) is not None}
    if config.val_fraction is not None:
        for name, (value, path) in recorded.items():
            if value != config.val_fraction:
                raise ConfigError(f"val_fraction: {config.val_fraction} here, but {name}'s training run held out "
                                  f"{value} of the documents ({path}); the held-out questions would not be the ones "
                                  f"it held out: set val_fraction={value} or evaluate a run trained with "
                                  f"{config.val_fraction}")
        return config.val_fraction
    values = {value for value, _ in recorded.values()}
    if len(values) > 1:
        raise ConfigError("val_fraction: the variants' training runs held out different shares of the documents ("
                          + ", ".join(f"{name} {value} in {path}" for name, (value, path) in recorded.items())
                          + "); compare runs trained on the same split")
    if not values:
        raise ConfigError("val_fraction: no variant has a training manifest (overstory.json) that records it; give "
                          "the share of data's documents the training runs held out")
    value = values.pop()
    if value == 0:
        raise ConfigError("val_fraction: the variants' training runs held out no documents (val_fraction 0 in "
                          f"{', '.join(str(path) for _, path in recorded.values())}); evaluate them on other "
                          "documents with train_data")
    return value


def split_rows(config: EvalPlannerConfig, data: PlannerDataConfig, tokenizer_name: str
               ) -> tuple[list[dict], list[dict], list[Chunk], str]:
    """(training rows, held-out rows, the chunks both refer to, how they were split): ``data``'s split by document,
    or with ``train_data`` all of ``data`` held out and all of ``train_data`` for training (no shared document)."""
    if not config.train_data:
        train, val, chunks = planner_rows(data, tokenizer_name)
        return (train, val, chunks, "validation documents") if val else ([], train, chunks, "all (no split)")
    held_out, _, chunks = planner_rows(replace(data, val_fraction=0), tokenizer_name)
    train, _, train_chunks = planner_rows(replace(data, labels=config.train_data, hierarchy="", val_fraction=0),
                                          tokenizer_name)
    shared = sorted({r["doc_id"] for r in train} & {r["doc_id"] for r in held_out})
    if shared:
        raise ConfigError(f"train_data: {len(shared)} documents (e.g. {shared[0]}) are also in data {config.data}; "
                          "the held-out questions must come from documents no training label comes from")
    return train, held_out, chunks + train_chunks, f"all of data (training labels: {config.train_data})"


def unlabelled_held_out(config: EvalPlannerConfig, data: PlannerDataConfig, tokenizer_name: str,
                        held_out: list[dict], chunks: list[Chunk]) -> tuple[list[dict], list[Chunk]]:
    """With ``unlabelled``, the held-out questions without a label (at most ``limit``), and ``chunks`` with the
    documents that only such questions name added (a NarrativeQA story none of whose questions got a label). The
    held-out documents are all of ``data``'s with ``train_data``, else the validation documents of its split."""
    if not config.unlabelled:
        return [], chunks
    doc_ids = None if config.train_data else {r["doc_id"] for r in held_out}
    extra = unlabelled_rows(data, tokenizer_name, doc_ids)[: config.limit or None]
    unseen = {r["doc_id"] for r in extra} - {c.doc_id for c in chunks}
    return extra, chunks + [c for c in labelled_hierarchy(config.data, config.hierarchy) if c.doc_id in unseen]


def answer_settings(config: EvalPlannerConfig) -> dict:
    """What decides an answer through the runtime besides its question, range and document's chunks (its key) and the
    served models (recorded apart): kept beside the answers, so that a rerun with other settings does not reuse them."""
    return {"k": config.k, "correctness": to_dict(config.correctness)}


def run(config: EvalPlannerConfig) -> dict:
    variants = config.selected()
    val_fraction = held_out_fraction(config, variants)
    data = PlannerDataConfig(labels=config.data, hierarchy=config.hierarchy, metadata_tokens=config.metadata_tokens,
                             val_fraction=0 if val_fraction is None else val_fraction)
    base = base_model_of(next(iter(variants.values())))
    train_rows, held_out, chunks, split = split_rows(config, data, base)
    rows = held_out[: config.limit or None]
    extra, chunks = unlabelled_held_out(config, data, base, held_out, chunks)
    evidence = {label.id: label.evidence for label in read_jsonl(config.data, PseudoLabel)}
    if config.train_data:
        evidence |= {label.id: label.evidence for label in read_jsonl(config.train_data, PseudoLabel)}
    report: dict = {"n_questions": len(rows), "n_unlabelled": len(extra), "split": split,
                    "val_fraction": val_fraction, "fallback_range": list(config.fallback_range),
                    "datasets": dict(Counter(dataset_of(r) for r in rows)),
                    "majority_baseline": majority_baseline(train_rows or held_out, rows), "variants": {},
                    "checkpoints": variants, "config": to_dict(config)}
    with ExitStack() as stack:
        tracker = stack.enter_context(start_run(config.tracking, "eval planner", config))
        answers = None
        if config.qa:
            client = stack.enter_context(client_for(config.serve, config.server_url,
                                                    timeout_s=config.request_timeout_s))
            retrievers = DocumentRetrievers(chunks, client)

            def outcome(row: dict, correct: bool, read: list) -> dict:
                return qa_outcome(correct, recall_at_k(read, evidence.get(row["example_id"], []), config.k), read)

            def answer(row: dict, low: str, high: str) -> dict:
                reply, read = retrievers[row["doc_id"]].answer(row["question"], low, high, k=config.k)
                return outcome(row, is_correct(clean_answer(reply.text), row["answers"], row["question"],
                                               config.correctness, client), read)

            differs = []

            def refresh(row: dict, low: str, high: str, kept: dict) -> dict:
                """An answer kept before ``tokens_given`` was recorded, completed by retrieval alone (no generator
                call; its QA score stands); one whose retrieval no longer reads what it recorded is counted."""
                read = [hit.chunk for hit in retrievers[row["doc_id"]].retrieve([row["question"]], low, high,
                                                                                 config.k)[0]]
                completed = outcome(row, bool(kept["qa_accuracy"]), read)
                if (completed["tokens_read"], completed["recall"]) != (kept["tokens_read"], kept["recall"]):
                    differs.append(answers.key(row, low, high))
                return completed

            answers = PlannerAnswers(config.out, answer_settings(config), client, answer, chunk_fingerprints(chunks),
                                     config.concurrency, config.resume, required=("tokens_given",), refresh=refresh)
            stack.callback(answers.close)
            report["served"] = answers.served

        for name, checkpoint in variants.items():
            report["variants"][name] = metrics = evaluate_variant(config, checkpoint, rows, extra, answers)
            tracker.log({f"{name}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
        if answers is not None and config.reference_ranges():
            selection = spread_over_datasets(train_rows, config.fixed_range_selection)
            answers.answer_all([(row, low, high) for row in [*rows, *extra, *selection]
                                for low, high in config.reference_ranges()], "fixed ranges")
            report["fixed_ranges"] = fixed_ranges(selection, rows + extra, config.reference_ranges(), answers)
        if answers is not None:
            report["paired"] = paired_planners(
                {name: metrics["questions"] for name, metrics in report["variants"].items()}, config.paired,
                best_fixed_records(report.get("fixed_ranges", {}), rows + extra, answers))
            # refreshed: kept answers completed by retrieval alone; of them, refreshed_retrieval_differs read other
            # chunks than when they were answered (their QA score is the earlier chunks')
            report["answers"] = {**answers.counts, "refreshed_retrieval_differs": len(differs)}
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(report, indent=2))
    plot_planner_comparison(report["variants"], out / "planner_comparison.png",
                            report["majority_baseline"]["accuracy"])
    if config.qa:
        plot_chunk_size_by_dataset(report, out / "chunk_size_by_dataset.png")
        plot_qa_vs_tokens_by_dataset(report, out / "qa_vs_tokens.png")
        if report["paired"]["comparisons"]:
            plot_paired_planners(report["paired"], out / "paired.png")
    if len(variants) > 1:
        curves = {name: training_history(checkpoint) for name, checkpoint in variants.items()}
        plot_training_curves({k: v for k, v in curves.items() if v}, out / "training_curves.png")
    _print(report)
    return report


def evaluate_variant(config: EvalPlannerConfig, checkpoint: str, rows: list[dict], extra: list[dict],
                     answers: PlannerAnswers | None) -> dict:
    """One planner's metrics on ``rows + extra`` (overall and ``by_dataset``; the label-based ones on ``rows``
    only, ``extra`` having no label) and, given ``answers``, the runtime's outcomes for the ranges it planned."""
    model, tokenizer, _ = load_lm_checkpoint(checkpoint)
    planned = rows + extra
    replies, lengths, seconds = generate_plans(model, tokenizer, [r["prompt"] for r in planned],
                                               config.max_new_tokens, config.batch_size)
    del model
    outcomes, ranges = plan_outcomes(planned, replies, lengths, config.length_limit, config.fallback_range)
    if answers is not None:
        answers.answer_all([(row, low, high) for row, (low, high) in zip(planned, ranges)], "planned ranges")
        for outcome, row, (low, high) in zip(outcomes, planned, ranges):
            outcome.update(answers(row, low, high))
    metrics = summarize(outcomes)
    if answers is not None:
        metrics["questions"] = question_records(planned, ranges, outcomes)
    metrics[f"recall@{config.k}"] = metrics["recall"]
    metrics["by_dataset"] = by_dataset(outcomes)
    metrics["seconds_per_plan"] = round(seconds, 3)
    metrics["examples"] = [{"id": r["example_id"], "label": [r["level_min"], r["level_max"]], "reply": text}
                           for r, text in zip(rows[:5], replies[:5])]
    return metrics


def best_fixed_records(fixed: dict, rows: list[dict], answers: PlannerAnswers) -> list[dict] | None:
    """The per-question records of the best fixed range (chosen on training questions) on ``rows``, read from the
    kept answers; None when no range was chosen."""
    if "best" not in fixed:
        return None
    low, high = fixed["best"]["range"].split("..")
    return question_records(rows, [(low, high)] * len(rows), [answers(row, low, high) for row in rows])


def training_history(checkpoint: str) -> list[dict]:
    """Per-step training records a recipe wrote beside ``checkpoint`` (``<run>/final`` -> ``<run>/metrics.json``)."""
    metrics = Path(checkpoint).parent / "metrics.json"
    if not Path(checkpoint).exists() or not metrics.exists():
        return []
    return [row for row in json.loads(metrics.read_text()).get("history", []) if "step" in row]


def _fmt(metrics: dict, key: str) -> str:
    value, interval = metrics.get(key), metrics.get("ci95", {}).get(key)
    if value is None:
        return "-"
    return f"{value:.3g} [{interval[0]:.2g}, {interval[1]:.2g}]" if interval else f"{value:.3g}"


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    table = Table(title=f"planner variants on {report['n_questions']} held-out questions (95% bootstrap intervals)")
    columns = [("accuracy", "acc"), ("accuracy_gold", "acc gold"), ("within_one_level", "within 1"),
               ("format_valid", "format ok"), ("format_valid_strict", "strict ok"),
               ("median_completion_tokens", "median tok"), ("seconds_per_plan", "s/plan"),
               ("qa_accuracy", "QA acc"), ("tokens_given", "tokens given"), ("tokens_read", "tokens retrieved")]
    table.add_column("variant")
    for _, title in columns:
        table.add_column(title, justify="right")
    majority = report["majority_baseline"]
    rows = [(name, metrics) for name, metrics in report["variants"].items()]
    rows.append((f"always {'..'.join(majority['label'])}", majority))
    for name, ranges in [("fixed " + k, v) for k, v in report.get("fixed_ranges", {}).get("ranges", {}).items()]:
        rows.append((name, ranges))
    table.add_column(f"repairs (answered from {'..'.join(report['fallback_range'])})")
    for name, metrics in rows:
        table.add_row(name, *(_fmt(metrics, key) for key, _ in columns), repairs_cell(metrics.get("repairs")))
    console.print(table)
    if "best" in report.get("fixed_ranges", {}):
        best = report["fixed_ranges"]["best"]
        print(f"best fixed range on {best['selection_questions']} training questions: {best['range']} (QA "
              f"{best['train_qa_accuracy']:.3g} there); held out: QA {_fmt(best, 'qa_accuracy')}, tokens given "
              f"{_fmt(best, 'tokens_given')} (retrieved {_fmt(best, 'tokens_read')})")
    for name, metrics in report["variants"].items():
        for dataset, summary in metrics["by_dataset"].items():
            print(f"{name} on {dataset} ({summary['n']}): accuracy {_fmt(summary, 'accuracy')}, gold "
                  f"{_fmt(summary, 'accuracy_gold')}, QA {_fmt(summary, 'qa_accuracy')}, chunk tokens "
                  f"{_fmt(summary, 'chunk_tokens')}")
    for dataset, summary in majority.get("by_dataset", {}).items():
        if "dataset_label" in summary:  # the reference a per-dataset planner must beat
            own = summary["dataset_label"]
            print(f"always {'..'.join(own['label'])} (the majority of {dataset}'s training labels) on {dataset} "
                  f"({own['n']}): accuracy {_fmt(own, 'accuracy')}, gold {_fmt(own, 'accuracy_gold')}")
    for comparison in report.get("paired", {}).get("comparisons", []):
        cell = comparison["overall"]
        if "qa_accuracy" in cell:
            qa, tokens = cell["qa_accuracy"], cell["tokens_given"]
            print(f"{comparison['planner']} against {comparison['against']}, question by question ({cell['n']}, "
                  f"{cell['same_range']} from the same range): QA {qa['delta']:+.3f} [{qa['delta_ci95'][0]:+.3f}, "
                  f"{qa['delta_ci95'][1]:+.3f}] ({qa['higher']} better, {qa['lower']} worse), tokens given "
                  f"{tokens['delta']:+.0f}")
    if "answers" in report:
        print(f"QA through the runtime: generator {report['served'].get('generator', '?')}; "
              f"{report['answers']['asked']} answers asked in this run, {report['answers']['resumed']} read back from "
              f"an earlier one (qa_answers.jsonl), {report['answers']['refreshed']} of them completed by retrieval "
              f"alone ({report['answers']['refreshed_retrieval_differs']} of those now retrieve other chunks)")
    if report.get("n_unlabelled"):
        total = report["n_questions"] + report["n_unlabelled"]
        print(f"{report['n_unlabelled']} of the {total} planned questions have no label: every rate but accuracy and "
              "within 1 counts them")
