"""eval planner's plots: the trade-off (QA score against tokens read) drawn from a metrics.json-shaped report, and
the training curves from the recipes' histories."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from overstory.evaluation import plots
from overstory.evaluation.plots import plot_qa_vs_tokens_by_dataset, plot_training_curves


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


def test_training_curves_draw_r_qa_beside_the_reward_for_grpo_and_stitch(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """GRPO logs R_QA as TRL's column, STITCH inside its step's reward means: both get an R_QA line beside their
    reward; a run without R_QA (SFT's loss history) gets none."""
    drawn = {}

    def keep(fig, path):
        drawn.update({line.get_label(): list(line.get_ydata()) for ax in fig.axes for line in ax.get_lines()})
        return path

    monkeypatch.setattr(plots, "save_figure", keep)
    histories = {"grpo": [{"step": 1, "reward": 2.0, "rewards/qa_reward/mean": 0.5},
                          {"step": 2, "reward": 2.5, "rewards/qa_reward/mean": 0.75}],
                 "stitch": [{"step": 1, "reward": 1.0, "rewards": {"qa_reward": 0.25}, "sft_injection": True}],
                 "sft": [{"step": 5, "loss": 1.0}, {"step": 10, "loss": 0.8}]}
    plot_training_curves(histories, tmp_path / "curves.png")
    assert drawn["grpo: R_QA (mean, unweighted)"] == [0.5, 0.75] and drawn["grpo"] == [2.0, 2.5]
    assert drawn["stitch: R_QA (mean, unweighted)"] == [0.25]
    assert not any(label.startswith("sft: R_QA") for label in drawn) and drawn["sft: training loss"] == [1.0, 0.8]


def test_paired_planners_draw_a_panel_per_dataset_and_colour_what_the_questions_show(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One panel per dataset and one for all questions; a difference whose interval clears zero is coloured by its
    sign, one across zero grey; a dataset a comparison did not cover is left out of its panel."""
    from matplotlib.axes import Axes

    from overstory.evaluation.planner_paired import paired_planners

    def records(dataset: str, qa: list[float]) -> list[dict]:
        return [{"id": f"{dataset}{i}", "dataset": dataset, "range": "sentence..sentence", "qa_accuracy": value,
                 "tokens_given": 50.0} for i, value in enumerate(qa)]

    better = {"sft": records("squad", [1.0] * 6) + records("qasper", [0.0] * 6),
              "base": records("squad", [0.0] * 6) + records("qasper", [1.0] * 6)}
    drawn = []
    original = Axes.errorbar
    monkeypatch.setattr(Axes, "errorbar", lambda ax, *a, **kw: drawn.append(kw["color"]) or original(ax, *a, **kw))
    wide = Image.open(plots.plot_paired_planners(paired_planners(better, ["sft:base"], None), tmp_path / "two.png"))
    assert drawn == ["tab:blue", "tab:red", "0.4"]  # squad all better, qasper all worse, all: across 0
    narrow = paired_planners({k: [r for r in v if r["dataset"] == "squad"] for k, v in better.items()}, ["sft:base"],
                             None)
    assert Image.open(plots.plot_paired_planners(narrow, tmp_path / "one.png")).width < 0.8 * wide.width
