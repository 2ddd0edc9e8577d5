"""eval planner's trade-off plot (QA score against tokens read) drawn from a metrics.json-shaped report."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from overstory.evaluation.plots import plot_qa_vs_tokens_by_dataset


def _summary(qa: float, tokens: float) -> dict:
    return {"n": 30, "qa_accuracy": qa, "tokens_read": tokens, "ci95": {"qa_accuracy": [qa - 0.1, qa + 0.1]}}


def test_one_panel_per_dataset_with_every_fixed_range_and_planner(tmp_path: Path) -> None:
    """Two datasets give a figure twice as wide as one; a dataset a planner did not see and a range without answers
    (no tokens read) are left out of their panel instead of failing the plot."""
    ranges = {"sentence..sentence": {"by_dataset": {"qasper": _summary(0.2, 150), "squad": _summary(0.5, 170)}},
              "section..section": {"by_dataset": {"qasper": _summary(0.4, 2200), "squad": _summary(0.6, 4100)}},
              "paragraph..paragraph": {"by_dataset": {"qasper": {"n": 0, "qa_accuracy": None, "tokens_read": None}}}}
    report = {"variants": {"base": {"by_dataset": {"qasper": _summary(0.1, 560)}},
                           "sft": {"by_dataset": {"qasper": _summary(0.45, 300), "squad": _summary(0.55, 180)}}},
              "fixed_ranges": {"ranges": ranges, "best": {"range": "section..section"}}}
    two = Image.open(plot_qa_vs_tokens_by_dataset(report, tmp_path / "two.png"))
    one_report = {**report, "variants": {"base": report["variants"]["base"]},
                  "fixed_ranges": {"ranges": {k: {"by_dataset": {"qasper": v["by_dataset"]["qasper"]}}
                                              for k, v in ranges.items()}}}
    one = Image.open(plot_qa_vs_tokens_by_dataset(one_report, tmp_path / "one.png"))
    assert two.width > 1.8 * one.width and two.height == one.height
