"""`overstory eval planner` on real SQuAD questions: the base SmolLM2 next to a LoRA SFT planner, with SmartChunk QA."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.core.config import ConfigError, load_config
from overstory.data_pipeline.formats import PseudoLabel, read_jsonl, write_jsonl
from overstory.data_pipeline.hierarchy import stored_hierarchy_path
from overstory.data_pipeline.splits import split_by_document
from overstory.evaluation.planner import EvalPlannerConfig, score_plans
from overstory.models.planner import plan_json

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/eval/planner.yaml"


def test_score_plans_counts_exact_gold_within_one_and_format() -> None:
    rows = [{"level_min": "sentence", "level_max": "paragraph", "gold_level_min": "sentence",
             "gold_level_max": "sentence"},
            {"level_min": "paragraph", "level_max": "section", "gold_level_min": "", "gold_level_max": ""}]
    replies = [plan_json("sentence", "paragraph"), "no plan at all"]
    metrics, ranges = score_plans(rows, replies, [20, 200], length_limit=128)
    assert metrics["accuracy"] == 0.5 and metrics["accuracy_gold"] == 0.0 and metrics["format_valid"] == 0.5
    assert metrics["format_valid_strict"] == 0.5
    assert metrics["within_one_level"] == 0.5 and metrics["over_length"] == 0.5
    assert ranges == [("sentence", "paragraph"), ("sentence", "document")]  # invalid plan: full-range fallback


def test_strict_format_rate_counts_only_the_exact_json() -> None:
    """The tolerant parser finds a plan in all four replies (what the runtime acts on); only the first is in the
    format the prompt asks for."""
    rows = [{"level_min": "sentence", "level_max": "paragraph", "gold_level_min": "", "gold_level_max": ""}] * 4
    replies = ['It asks for a date. {"largest_chunk_size": "paragraph", "smallest_chunk_size": "sentence"}',
               "{'largest_chunk_size': 'paragraph', 'smallest_chunk_size': 'sentence'}",
               '{"largest_chunk_size": "sentence", "smallest_chunk_size": "paragraph"}',
               '{"largest_chunk_size": "paragraphs", "smallest_chunk_size": "sentence"']
    metrics, _ = score_plans(rows, replies, [20] * 4, length_limit=128)
    assert metrics["format_valid"] == 1.0 and metrics["format_valid_strict"] == 0.25


def test_compare_needs_known_variants() -> None:
    with pytest.raises(ConfigError, match="not in variants"):
        load_config(EvalPlannerConfig, CONFIG, ["compare=base,nope"])


def _with_unanswered(labels: Path, folder: Path, n: int) -> tuple[Path, set[str]]:
    """The labels with the last ``n`` of the held-out document's questions turned into ones the backbone never
    answered (no correct label), stored with their hierarchy as the pseudo-labels job would; and those ids."""
    records = list(read_jsonl(labels, PseudoLabel))
    _, val = split_by_document([r for r in records if r.correct], 0.2)
    unanswered = {r.id for r in val[-n:]}
    records = [replace(r, correct=False, level_min=None, level_max=None) if r.id in unanswered else r
               for r in records]
    folder.mkdir()
    write_jsonl(folder / "labels.jsonl", records)
    shutil.copy(stored_hierarchy_path(labels), stored_hierarchy_path(folder / "labels.jsonl"))
    return folder / "labels.jsonl", unanswered


@pytest.mark.slow
def test_eval_planner_compares_base_and_sft(planner_labels: Path, sft_planner: Path, tmp_path: Path) -> None:
    sft = sft_planner
    labels, unanswered = _with_unanswered(planner_labels, tmp_path / "labels", 2)
    out = tmp_path / "eval"
    assert main(["eval", "planner", "--config", str(CONFIG), "--data", str(labels), "--out", str(out),
                 "metadata_tokens=96",
                 f"variants={{base: builtin:smollm2-135m-instruct, sft: {sft / 'final'}}}", "--compare", "base,sft",
                 "limit=3", "max_new_tokens=72", "unlabelled=true", "tracking.backend=none"]) == 0
    report = json.loads((out / "metrics.json").read_text())
    assert set(report["variants"]) == {"base", "sft"} and report["n_questions"] == 3 and report["n_unlabelled"] == 2
    assert not unanswered & {row["id"] for m in report["variants"].values() for row in m["examples"]}
    for metrics in report["variants"].values():
        assert metrics["accuracy_gold"] is None  # the fixture's labels carry no gold levels
        for key in ("accuracy", "within_one_level", "format_valid", "format_valid_strict", "median_completion_tokens",
                    "p90_completion_tokens", "seconds_per_plan", "qa_accuracy", "recall@5"):
            assert metrics[key] is not None, key
        assert 0 <= metrics["accuracy"] <= metrics["within_one_level"] <= 1
        assert metrics["format_valid_strict"] <= metrics["format_valid"]
        assert metrics["format_valid_strict_all"] <= metrics["format_valid_all"]  # over all 5 planned questions
    assert report["variants"]["base"]["format_valid_all"] == 0.0  # measured: the base model never writes the plan
    assert report["variants"]["sft"]["format_valid_all"] > 0  # the SFT adapter does, on labelled and unlabelled ones
    majority = report["majority_baseline"]  # the reference row: the training labels' most common range
    assert len(majority["label"]) == 2 and 0 <= majority["accuracy"] <= majority["within_one_level"] <= 1
    assert (out / "planner_comparison.png").stat().st_size > 5_000
    assert (out / "training_curves.png").stat().st_size > 5_000
