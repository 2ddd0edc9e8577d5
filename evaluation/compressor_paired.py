"""eval compressor's trained methods compared with its baselines question by question.

Side by side, recall@k intervals over ~120 questions are about +-0.08 wide, so a trained compressor 0.12 above
mean_pool can still touch its interval. Every method ranks the same questions, so pairing each question with itself
(the trained method's recall minus the baseline's) gives the difference its own, narrower interval and says on how
many questions the two ranked the evidence differently at all.
"""

from __future__ import annotations

from collections.abc import Sequence

from overstory.evaluation.markdown import grid
from overstory.evaluation.paired import difference_cell, paired_difference

# the untrained ways of embedding the upper levels every trained compressor is meant to beat
BASELINES = ("mean_pool", "direct_encode", "summarize")


def per_question_key(k: int) -> str:
    """The key of a method's recall@k per question (in the report's question order) in its metrics."""
    return f"recall@{k}_per_question"


def paired_methods(methods: dict[str, dict], trained: Sequence[str], k: int) -> list[dict]:
    """Every trained method against every baseline in ``methods`` that kept its per-question recall@k: the two means,
    the mean difference (trained minus baseline) with its 95% paired bootstrap interval, and on how many questions
    the trained method ranked the evidence better and worse.

    >>> methods = {"compressor": {"recall@5_per_question": [1.0, 1.0, 0.0]},
    ...            "mean_pool": {"recall@5_per_question": [0.0, 1.0, 0.0]}}
    >>> row = paired_methods(methods, ["compressor"], 5)[0]
    >>> row["method"], row["against"], row["delta"], row["higher"], row["lower"]
    ('compressor', 'mean_pool', 0.3333333333333333, 1, 0)
    """
    key = per_question_key(k)
    rows = []
    for method in trained:
        for baseline in BASELINES:
            if key in methods.get(baseline, {}) and key in methods[method]:
                pairs = list(zip(methods[baseline][key], methods[method][key], strict=True))
                rows.append({"method": method, "against": baseline, **paired_difference(pairs)})
    return rows


def paired_methods_table(report: dict) -> str:
    """``eval compressor`` metrics.json's ``paired``: a row per trained method and baseline.

    >>> report = {"config": {"k": 5}, "paired": [{"method": "compressor", "against": "mean_pool", "n": 3,
    ...     "first": 1 / 3, "second": 2 / 3, "delta": 1 / 3, "delta_ci95": [0.0, 1.0], "higher": 1, "lower": 0}]}
    >>> print(paired_methods_table(report))
    | method | against | questions | recall@5 (method) | recall@5 (against) | difference (95% interval) | ...
    | --- | --- | --- | --- | --- | --- | --- |
    | compressor | mean_pool | 3 | 0.667 | 0.333 | +0.333 [+0.000, +1.000] | 1 / 0 |
    """
    k = report["config"]["k"]
    rows = []
    for row in report["paired"]:
        rows.append([row["method"], row["against"], str(row["n"]), f"{row['second']:.3f}", f"{row['first']:.3f}",
                     difference_cell(row), f"{row['higher']} / {row['lower']}"])
    return grid(["method", "against", "questions", f"recall@{k} (method)", f"recall@{k} (against)",
                 "difference (95% interval)", "questions better / worse"], rows)
