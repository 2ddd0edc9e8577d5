"""Planners compared question by question: the claims `overstory eval planner` tests are differences between two
planners (STITCH above SFT above the base model) or between a planner and the best fixed range (as good an answer for
fewer tokens), on the same held-out questions. Side by side, 30 questions a dataset give intervals so wide that
every row overlaps every other; paired with itself, each question's difference has a much narrower interval, and the
count of questions that went up and down says whether a mean moved on one question or on many.

Each compared planner's per-question outcomes (``question_records``: the range it answered from, its QA score and
the tokens the generator was given) are kept in its metrics as ``questions``; the best fixed range's come from the
same kept answers. ``paired_planners`` compares every configured pair (``paired: ["stitch:sft", ...]``: a planner
against another, the difference being the planner's value minus the other's) and every compared planner against the
best fixed range, overall and per dataset.
"""

from __future__ import annotations

from collections.abc import Sequence

from overstory.evaluation.markdown import grid
from overstory.evaluation.paired import difference_cell, paired_difference
from overstory.evaluation.planner_metrics import dataset_of

BEST_FIXED = "best fixed range"


def question_records(rows: Sequence[dict], ranges: Sequence[tuple[str, str]], outcomes: Sequence[dict]) -> list[dict]:
    """Per question: its id, dataset, the range answered from, the QA score and the tokens given (the runtime's
    outcomes of ``ranges``, one per row).

    >>> question_records([{"example_id": "q1", "doc_id": "squad/a"}], [("sentence", "paragraph")],
    ...                  [{"qa_accuracy": 1.0, "tokens_given": 80.0, "recall": 1.0}])
    [{'id': 'q1', 'dataset': 'squad', 'range': 'sentence..paragraph', 'qa_accuracy': 1.0, 'tokens_given': 80.0}]
    """
    return [{"id": row["example_id"], "dataset": dataset_of(row), "range": f"{low}..{high}",
             "qa_accuracy": outcome["qa_accuracy"], "tokens_given": outcome["tokens_given"]}
            for row, (low, high), outcome in zip(rows, ranges, outcomes)]


def parse_pair(text: str) -> tuple[str, str]:
    """``"stitch:sft"`` -> ``("stitch", "sft")``: a planner and the one it is compared against.

    >>> parse_pair("stitch:sft")
    ('stitch', 'sft')
    """
    first, sep, second = text.partition(":")
    if not sep or not first or not second:
        raise ValueError(f"{text!r} is not planner:other (e.g. stitch:sft)")
    return first, second


def _compare(planner: Sequence[dict], against: Sequence[dict]) -> dict:
    """``planner``'s records against ``against``'s on the questions both hold: how many, how many were answered from
    the same range, and per metric both means (``planner``, ``against``), the mean of planner - against (``delta``)
    with its 95% interval, and the questions where the planner is higher and lower."""
    theirs = {record["id"]: record for record in against}
    common = [(record, theirs[record["id"]]) for record in planner if record["id"] in theirs]
    cell: dict = {"n": len(common), "same_range": sum(a["range"] == b["range"] for a, b in common)}
    for metric in ("qa_accuracy", "tokens_given"):
        if common:
            figures = paired_difference([(b[metric], a[metric]) for a, b in common])
            cell[metric] = {"planner": figures.pop("second"), "against": figures.pop("first"), **figures}
    return cell


def paired_planners(questions: dict[str, list[dict]], pairs: Sequence[str], best_fixed: list[dict] | None) -> dict:
    """Every pair of ``pairs`` whose planners both have ``questions`` (the others listed as ``skipped``: a run that
    compares fewer planners), then every planner against ``best_fixed`` (the best fixed range's records), each overall
    and per dataset.

    >>> base = [{"id": "q1", "dataset": "squad", "range": "sentence..paragraph", "qa_accuracy": 0.0,
    ...          "tokens_given": 90.0}]
    >>> sft = [{**base[0], "range": "sentence..sentence", "qa_accuracy": 1.0, "tokens_given": 30.0}]
    >>> report = paired_planners({"base": base, "sft": sft}, ["sft:base", "stitch:sft"], None)
    >>> row = report["comparisons"][0]
    >>> row["planner"], row["against"], row["overall"]["qa_accuracy"]["delta"], row["overall"]["tokens_given"]["delta"]
    ('sft', 'base', 1.0, -60.0)
    >>> report["skipped"]
    ['stitch:sft']
    """
    wanted = [(text, parse_pair(text)) for text in pairs]
    comparisons = [(a, b) for _, (a, b) in wanted if a in questions and b in questions]
    records = dict(questions)
    if best_fixed is not None:
        comparisons += [(name, BEST_FIXED) for name in questions]
        records[BEST_FIXED] = best_fixed
    report = {"comparisons": [], "skipped": [text for text, (a, b) in wanted if a not in questions
                                             or b not in questions]}
    for planner, against in comparisons:
        mine, theirs = records[planner], records[against]
        datasets = dict.fromkeys(record["dataset"] for record in mine)
        report["comparisons"].append({
            "planner": planner, "against": against, "overall": _compare(mine, theirs),
            "by_dataset": {name: _compare([r for r in mine if r["dataset"] == name],
                                          [r for r in theirs if r["dataset"] == name]) for name in datasets}})
    return report


def paired_planners_table(report: dict) -> str:
    """``eval planner`` metrics.json's ``paired``: per comparison, each dataset then all questions: how many questions,
    how many were answered from the same range, the QA difference (the planner's minus the other's) with its 95%
    interval, the questions where the planner answered better and worse, and the difference in tokens given.

    >>> record = {"id": "q1", "dataset": "squad", "range": "sentence..sentence", "qa_accuracy": 1.0,
    ...           "tokens_given": 30.0}
    >>> print(paired_planners_table({"paired": paired_planners({"sft": [record]}, [], [
    ...     {**record, "qa_accuracy": 0.0, "tokens_given": 90.0, "range": "section..section"}])}))
    | comparison | dataset | questions | same range | QA difference (95% interval) | questions better / worse | ...
    | --- | --- | --- | --- | --- | --- | --- |
    | sft - best fixed range | squad | 1 | 0 | +1.000 [+1.000, +1.000] | 1 / 0 | -60 [-60, -60] |
    | sft - best fixed range | all | 1 | 0 | +1.000 [+1.000, +1.000] | 1 / 0 | -60 [-60, -60] |
    """
    rows = []
    for comparison in report["paired"]["comparisons"]:
        name = f"{comparison['planner']} - {comparison['against']}"
        for dataset, cell in [*comparison["by_dataset"].items(), ("all", comparison["overall"])]:
            qa, tokens = cell.get("qa_accuracy"), cell.get("tokens_given")
            rows.append([name, dataset, str(cell["n"]), str(cell["same_range"]), difference_cell(qa),
                         f"{qa['higher']} / {qa['lower']}" if qa else "-", difference_cell(tokens, 0)])
    return grid(["comparison", "dataset", "questions", "same range", "QA difference (95% interval)",
                 "questions better / worse", "tokens given difference"], rows)
