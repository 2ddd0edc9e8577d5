"""Two eval pipeline runs compared question by question: the same strategies on the same questions under two
settings that should not change the answers much (the generator in float32 and in bfloat16, say), or a change that
should. Unpaired tables put each run's mean beside the other's with overlapping intervals; pairing each question
with itself says how many answers changed at all, and the interval of the mean difference is much narrower.

    python scripts/compare_answers.py runs/teacher/eval/pipeline-hotpotqa-float32 runs/teacher/eval/pipeline-hotpotqa

Reads ``<run>/predictions/<strategy>.jsonl`` of both runs (every strategy both hold) and writes a JSON report that
the results page renders (table kind ``answers_paired``).
"""

from __future__ import annotations

import json
from pathlib import Path

from overstory.evaluation.markdown import grid
from overstory.retrieval.metrics import bootstrap_interval

METRICS = ("token_f1", "exact_match", "recall@5", "judge")


def _answers(run: Path, strategy: str) -> dict[str, dict]:
    """Question id -> its record in ``run``'s predictions of ``strategy`` (the last record of an id wins)."""
    path = run / "predictions" / f"{strategy}.jsonl"
    return {record["id"]: record for record in map(json.loads, path.read_text().splitlines()) if record}


def compare_strategy(first: dict[str, dict], second: dict[str, dict]) -> dict:
    """The questions both answered: how many, how many got the same prediction and the same evidence, and per metric
    the two means, the mean of second - first with its 95% bootstrap interval, and how many questions went up or down.

    >>> a = {"q1": {"prediction": "x", "evidence": ["p"], "token_f1": 1.0}, "q2": {"prediction": "y", "token_f1": 0.0}}
    >>> b = {"q1": {"prediction": "x", "evidence": ["p"], "token_f1": 1.0}, "q2": {"prediction": "z", "token_f1": 0.5}}
    >>> row = compare_strategy(a, b)
    >>> row["questions"], row["same_prediction"], row["metrics"]["token_f1"]["higher"]
    (2, 1, 1)
    """
    common = [qid for qid in first if qid in second]
    row = {"questions": len(common),
           "same_prediction": sum(first[q].get("prediction") == second[q].get("prediction") for q in common),
           "same_evidence": sum(first[q].get("evidence") == second[q].get("evidence") for q in common),
           "failed": [sum(bool(run[q].get("failure")) for q in common) for run in (first, second)], "metrics": {}}
    for metric in METRICS:
        pairs = [(first[q][metric], second[q][metric]) for q in common
                 if first[q].get(metric) is not None and second[q].get(metric) is not None]
        if pairs:
            row["metrics"][metric] = paired_difference(pairs)
    return row


def paired_difference(pairs: list[tuple[float, float]]) -> dict:
    """One metric over questions paired with themselves, ``(first, second)`` each: both means, the mean of
    second - first with its 95% bootstrap interval, and how many questions went up and down.

    >>> figures = paired_difference([(0.0, 1.0), (1.0, 1.0), (1.0, 0.0), (0.0, 1.0)])
    >>> figures["n"], figures["delta"], figures["higher"], figures["lower"]
    (4, 0.25, 2, 1)
    """
    deltas = [b - a for a, b in pairs]
    return {"n": len(pairs), "first": sum(a for a, _ in pairs) / len(pairs),
            "second": sum(b for _, b in pairs) / len(pairs), "delta": sum(deltas) / len(deltas),
            "delta_ci95": bootstrap_interval(deltas), "higher": sum(d > 0 for d in deltas),
            "lower": sum(d < 0 for d in deltas)}


def compare_runs(first: str | Path, second: str | Path) -> dict:
    """Every strategy both runs answered, compared by :func:`compare_strategy`, with each run's served models."""
    first, second = Path(first), Path(second)
    names = sorted({p.stem for p in (first / "predictions").glob("*.jsonl") if not p.stem.endswith(".runs")}
                   & {p.stem for p in (second / "predictions").glob("*.jsonl") if not p.stem.endswith(".runs")})
    if not names:
        raise ValueError(f"{first} and {second} have no strategy's predictions in common")

    def served(run: Path) -> dict:
        metrics = run / "metrics.json"
        return json.loads(metrics.read_text()).get("served", {}) if metrics.exists() else {}

    return {"first": str(first), "second": str(second), "served": {"first": served(first), "second": served(second)},
            "strategies": {name: compare_strategy(_answers(first, name), _answers(second, name)) for name in names}}


def difference_cell(figures: dict | None, digits: int = 3) -> str:
    """A table cell for :func:`paired_difference`'s figures: the signed mean difference and its 95% interval (the
    difference itself where one question gives no interval; ``-`` without figures).

    >>> difference_cell({"delta": 0.25, "delta_ci95": [-0.5, 1.0]})
    '+0.250 [-0.500, +1.000]'
    """
    if not figures:
        return "-"
    low, high = figures["delta_ci95"] or (figures["delta"], figures["delta"])
    return f"{figures['delta']:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def paired_table(report: dict) -> str:
    """One row per strategy and metric: the questions both runs hold, the same predictions among them, the questions
    that failed (no answer) in each run, each run's mean, the mean difference (second - first) with its interval, and
    the questions up and down."""
    rows = []
    for name, row in report["strategies"].items():
        for metric, figures in row["metrics"].items():
            rows.append([name, metric, str(figures["n"]), f"{row['same_prediction']} of {row['questions']}",
                         " / ".join(map(str, row["failed"])), f"{figures['first']:.3f}", f"{figures['second']:.3f}",
                         difference_cell(figures),
                         f"{figures['higher']} / {figures['lower']}"])
    return grid(["strategy", "metric", "questions", "same prediction", "failed (first / second)", "first", "second",
                 "second - first (95% interval)", "questions up / down"], rows)
