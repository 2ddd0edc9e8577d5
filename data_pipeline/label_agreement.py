"""How far SmartChunk's pseudo-labels agree with gold granularity labels: a measure of the labelling method.

The pseudo-label job (``pseudo_labels.py``) stores, beside each label found by retrieving and answering, the gold
levels read off the question's annotated evidence (``gold_labels.py``) where the dataset has them (QASPER,
SQuAD). Over the questions that have both, this reports how often the pseudo-label's ``(level_min,
level_max)`` is the gold range, each end alone, both ends within one level, and the mean signed offset of each
end in levels (positive: the pseudo-label is coarser than the evidence needs), each rate with a 95% bootstrap
interval; ``coverage`` is the fraction of gold-labelled questions that got a pseudo-label at all (the backbone
answered one of its attempts correctly). ``confusion`` counts gold against pseudo level, per end, for the PNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from overstory.core.plots import plt, save_figure
from overstory.core.records import LEVEL_RANK, LEVELS, PseudoLabel
from overstory.retrieval.metrics import bootstrap_interval


def _rate(values: list[float]) -> dict:
    interval = bootstrap_interval(values)
    return {"value": round(float(np.mean(values)), 4) if values else None,
            "ci95": [round(x, 4) for x in interval] if interval else None}


def label_agreement(labels: Sequence[PseudoLabel]) -> dict:
    """Agreement of the pseudo-labels with the gold levels stored beside them (see the module docstring).

    >>> def label(pseudo, gold):
    ...     return PseudoLabel("q", "d", "?", ["a"], *pseudo, pseudo[0] is not None, 1, [], [], "", "m", "f1",
    ...                        *gold)
    >>> report = label_agreement([label(("sentence", "paragraph"), ("sentence", "paragraph")),
    ...                           label(("sentence", "subsection"), ("sentence", "paragraph")),
    ...                           label((None, None), ("paragraph", "paragraph"))])
    >>> report["gold"], report["both"], report["exact_range"]["value"], report["level_min"]["value"]
    (3, 2, 0.5, 1.0)
    >>> report["max_offset_levels"]["value"], report["within_one"]["value"]
    (0.5, 1.0)
    """
    gold = [x for x in labels if x.gold_level_min and x.gold_level_max]
    both = [x for x in gold if x.correct and x.level_min and x.level_max]

    def offset(pseudo: str, truth: str) -> int:
        return LEVEL_RANK[pseudo] - LEVEL_RANK[truth]

    offsets = [(offset(x.level_min, x.gold_level_min), offset(x.level_max, x.gold_level_max)) for x in both]
    confusion = {end: {g: {p: 0 for p in LEVELS} for g in LEVELS} for end in ("level_min", "level_max")}
    for x in both:
        confusion["level_min"][x.gold_level_min][x.level_min] += 1
        confusion["level_max"][x.gold_level_max][x.level_max] += 1
    return {
        "labels": len(labels), "gold": len(gold), "both": len(both),
        "coverage": _rate([float(x in both) for x in gold]),
        "exact_range": _rate([float(lo == 0 and hi == 0) for lo, hi in offsets]),
        "level_min": _rate([float(lo == 0) for lo, _ in offsets]),
        "level_max": _rate([float(hi == 0) for _, hi in offsets]),
        "within_one": _rate([float(abs(lo) <= 1 and abs(hi) <= 1) for lo, hi in offsets]),
        "min_offset_levels": _rate([float(lo) for lo, _ in offsets]),
        "max_offset_levels": _rate([float(hi) for _, hi in offsets]),
        "confusion": confusion,
    }


def plot_agreement(report: dict, title: str, path: str | Path) -> Path:
    """Two heatmaps, gold level (rows) against pseudo-label level (columns), for level_min and level_max."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, end in zip(axes, ("level_min", "level_max")):
        grid = np.array([[report["confusion"][end][g][p] for p in LEVELS] for g in LEVELS])
        ax.imshow(grid, cmap="Blues")
        for i in range(len(LEVELS)):
            for j in range(len(LEVELS)):
                ax.text(j, i, str(grid[i, j]), ha="center", va="center", fontsize=9)
        ax.set_xticks(range(len(LEVELS)), LEVELS, rotation=30)
        ax.set_yticks(range(len(LEVELS)), LEVELS)
        ax.set_xlabel("pseudo-label")
        ax.set_ylabel("gold")
        rate = report[end]["value"]
        ax.set_title(f"{end}: agree {rate:.0%}" if rate is not None else end)
    fig.suptitle(f"{title}: {report['both']} of {report['gold']} gold-labelled questions pseudo-labelled")
    return save_figure(fig, path)
