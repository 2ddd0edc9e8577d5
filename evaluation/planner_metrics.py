"""What `overstory eval planner` computes from plans: per-question outcomes, their summaries with 95% bootstrap
intervals, per dataset and overall, and the references a planner must beat.

A planner is judged per question (``plan_outcomes``): exact range against the training label and against the
gold levels where the dataset has them, both ends within one level, the two format rates and the completion
length; through the SmartChunk runtime (``qa_outcome``) the QA score, recall@k, the tokens of the chunks retrieved,
the tokens the generator was given (each chunk cut at ``READ_CHARS`` characters) and the mean size of the chunks
retrieved (the paper's Figure 4b). ``summarize`` turns a list of outcomes into
means with intervals (the differences here are a few points on a few hundred questions), and ``by_dataset``
does so per dataset, a question's dataset being the prefix of its document id (``qasper/...``,
``narrativeqa/...``, ``squad/...``).

The references, measured on the same questions: ``majority_baseline`` (always the training labels' most common
range, per dataset and overall) for planning accuracy, and ``fixed_ranges`` (every fixed range with its QA score
and tokens, the best one chosen on training questions) for the end-to-end trade-off.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from overstory.core.records import LEVEL_RANK, LEVELS, Chunk
from overstory.evaluation.repairs import repair_counts
from overstory.models.planner import parse_plan, strict_plan_valid
from overstory.retrieval.answer import tokens_given
from overstory.retrieval.metrics import bootstrap_interval, mean, percentile
from overstory.retrieval.smartchunk import READ_CHARS

# every range a planner can answer: (level_min, level_max) with level_min no larger than level_max
ALL_RANGES = tuple((low, high) for low in LEVELS for high in LEVELS if LEVEL_RANK[low] <= LEVEL_RANK[high])
# outcomes reported as a mean with its 95% bootstrap interval
RATES = ("accuracy", "accuracy_gold", "within_one_level", "format_valid", "format_valid_strict", "over_length",
         "qa_accuracy", "recall", "tokens_read", "tokens_given", "chunk_tokens")


def dataset_of(row: dict) -> str:
    """The dataset a planner row comes from: the prefix of its document id (every corpus loader names its
    documents ``<dataset>/<id>``)."""
    return row["doc_id"].split("/", 1)[0]


def _distance(a: str, b: str) -> int:
    return abs(LEVEL_RANK[a] - LEVEL_RANK[b])


def within_one(levels: tuple[str, str], label: tuple[str, str]) -> bool:
    """Both ends of the range within one level of the label's."""
    return _distance(levels[0], label[0]) <= 1 and _distance(levels[1], label[1]) <= 1


def plan_outcomes(rows: Sequence[dict], replies: Sequence[str], lengths: Sequence[int], length_limit: int,
                  fallback: tuple[str, str]) -> tuple[list[dict], list[tuple[str, str]]]:
    """Per question: the planning outcomes of one variant's reply, and the range the runtime answers from (the
    plan, or the runtime's ``fallback`` range when none could be parsed: a repair, ``plan_unparsed``). A row
    without a label (no ``level_min``) has no label-based outcomes (None), as a row without gold levels has no
    ``accuracy_gold``.

    >>> outcomes, ranges = plan_outcomes([{"doc_id": "squad/a", "level_min": "sentence", "level_max": "section"}],
    ...                                  ["no plan here"], [3], 128, ("sentence", "paragraph"))
    >>> ranges, outcomes[0]["plan_unparsed"], outcomes[0]["accuracy"]
    ([('sentence', 'paragraph')], 1, 0.0)
    """
    outcomes, ranges = [], []
    for row, text, length in zip(rows, replies, lengths):
        plan = parse_plan(text)
        label = (row["level_min"], row["level_max"]) if row.get("level_min") else None
        gold = (row["gold_level_min"], row["gold_level_max"]) if row.get("gold_level_min") else None
        outcomes.append({
            "dataset": dataset_of(row), "range": plan.levels if plan.valid else None,
            "accuracy": None if label is None else float(plan.valid and plan.levels == label),
            "accuracy_gold": None if gold is None else float(plan.valid and plan.levels == gold),
            "within_one_level": None if label is None else float(plan.valid and within_one(plan.levels, label)),
            "format_valid": float(plan.valid), "format_valid_strict": float(strict_plan_valid(text)),
            "completion_tokens": length, "over_length": float(length > length_limit),
            "plan_unparsed": int(not plan.valid)})
        ranges.append(plan.levels if plan.valid else fallback)
    return outcomes, ranges


def qa_outcome(correct: bool, recall: float | None, read: Sequence[Chunk]) -> dict:
    """The runtime's outcome for one question and range: QA score, recall@k, the tokens of the chunks retrieved
    (``tokens_read``), the tokens the generator was given of them (``tokens_given``: each cut at ``READ_CHARS``
    characters, so a range of whole sections or documents costs less than its chunks hold) and the mean size of the
    chunks retrieved."""
    tokens = [chunk.n_tokens for chunk in read]
    return {"qa_accuracy": float(correct), "recall": recall, "tokens_read": float(sum(tokens)),
            "tokens_given": tokens_given(read, READ_CHARS),
            "chunk_tokens": float(sum(tokens) / len(tokens)) if tokens else None}


def summarize(outcomes: Sequence[dict]) -> dict:
    """Means of the outcomes with their 95% bootstrap intervals (``ci95``), completion-length percentiles, the
    number of questions and the repairs by kind (``plan_unparsed``: answered from the fallback range). A rate no
    outcome has (no gold levels, no QA) is None.

    >>> summary = summarize([{"accuracy": 1.0, "completion_tokens": 10}, {"accuracy": 0.0, "completion_tokens": 30}])
    >>> summary["n"], summary["accuracy"], summary["median_completion_tokens"], summary["accuracy_gold"]
    (2, 0.5, 20.0, None)
    >>> summary["ci95"]["accuracy"]
    [0.0, 1.0]
    """
    summary: dict = {"n": len(outcomes), "ci95": {}}
    for key in RATES:
        values = [o.get(key) for o in outcomes]
        summary[key] = mean(values)
        interval = bootstrap_interval(values)
        summary["ci95"][key] = [round(x, 4) for x in interval] if interval else None
    lengths = [o["completion_tokens"] for o in outcomes if o.get("completion_tokens") is not None]
    summary["median_completion_tokens"] = percentile(lengths, 50)
    summary["p90_completion_tokens"] = percentile(lengths, 90)
    summary["repairs"] = repair_counts(outcomes)
    return summary


def by_dataset(outcomes: Sequence[dict]) -> dict[str, dict]:
    """``summarize`` per dataset, in order of first appearance."""
    groups: dict[str, list[dict]] = {}
    for outcome in outcomes:
        groups.setdefault(outcome["dataset"], []).append(outcome)
    return {name: summarize(group) for name, group in groups.items()}


def majority_range(rows: Sequence[dict]) -> tuple[str, str]:
    """The most common ``(level_min, level_max)`` among ``rows`` (ties: the first met)."""
    return Counter((r["level_min"], r["level_max"]) for r in rows).most_common(1)[0][0]


def majority_baseline(train_rows: Sequence[dict], rows: Sequence[dict]) -> dict:
    """The reference a planner must beat to have learned anything from the question: always answering the
    training labels' most common range. Scored on ``rows`` as the variants are (against the label and, where
    there is one, the gold range), with intervals: overall, and per dataset both with the overall majority and with
    the dataset's own (``dataset_label``: the majority of that dataset's training rows, when it has any).

    >>> train = [{"level_min": "sentence", "level_max": "section", "doc_id": "squad/a"}] * 2 + [
    ...     {"level_min": "sentence", "level_max": "document", "doc_id": "squad/b"}]
    >>> held_out = [{"level_min": "sentence", "level_max": "section", "doc_id": "squad/c"},
    ...             {"level_min": "paragraph", "level_max": "document", "doc_id": "squad/c"}]
    >>> report = majority_baseline(train, held_out)
    >>> report["label"], report["accuracy"], report["within_one_level"]
    (['sentence', 'section'], 0.5, 1.0)
    """
    def score(label: tuple[str, str], subset: Sequence[dict]) -> dict:
        outcomes = [{"accuracy": float(label == (r["level_min"], r["level_max"])),
                     "accuracy_gold": float(label == (r["gold_level_min"], r["gold_level_max"]))
                     if r.get("gold_level_min") else None,
                     "within_one_level": float(within_one(label, (r["level_min"], r["level_max"])))} for r in subset]
        summary = summarize(outcomes)
        return {"label": list(label), **{k: summary[k] for k in ("n", "accuracy", "accuracy_gold",
                                                                 "within_one_level")},
                "ci95": {k: summary["ci95"][k] for k in ("accuracy", "accuracy_gold", "within_one_level")}}

    overall = majority_range(train_rows)
    report = score(overall, rows)
    report["by_dataset"] = {}
    for name in dict.fromkeys(dataset_of(r) for r in rows):
        subset = [r for r in rows if dataset_of(r) == name]
        own = [r for r in train_rows if dataset_of(r) == name]
        entry = score(overall, subset)
        if own:
            entry["dataset_label"] = score(majority_range(own), subset)
        report["by_dataset"][name] = entry
    return report


def spread_over_datasets(rows: Sequence[dict], n: int) -> list[dict]:
    """The first ``n`` rows taken one dataset at a time (file order within a dataset), so that a selection from a
    mix written dataset after dataset represents every dataset.

    >>> rows = [{"doc_id": d} for d in ("qasper/a", "qasper/b", "qasper/c", "squad/d")]
    >>> [r["doc_id"] for r in spread_over_datasets(rows, 3)]
    ['qasper/a', 'squad/d', 'qasper/b']
    """
    queues: dict[str, list[dict]] = {}
    for row in rows:
        queues.setdefault(dataset_of(row), []).append(row)
    ordered = [q[i] for i in range(max((len(q) for q in queues.values()), default=0)) for q in queues.values()
               if i < len(q)]
    return ordered[:n]


def fixed_ranges(train_rows: Sequence[dict], rows: Sequence[dict], ranges: Sequence[tuple[str, str]],
                 answer: Callable[[dict, str, str], dict]) -> dict:
    """Every fixed range in ``ranges`` answered on the held-out ``rows`` (``answer(row, low, high)`` gives a
    ``qa_outcome``): QA score and tokens read with intervals, overall and per dataset; and ``best``, the range
    with the highest QA score on ``train_rows`` (fewer tokens given breaks ties), chosen there and reported here.
    """
    report: dict = {"ranges": {}}
    for low, high in ranges:
        outcomes = [{"dataset": dataset_of(r), **answer(r, low, high)} for r in rows]
        report["ranges"][f"{low}..{high}"] = {**_qa_summary(summarize(outcomes)),
                                              "by_dataset": {k: _qa_summary(v) for k, v in
                                                             by_dataset(outcomes).items()}}
    if train_rows:
        chosen = {}
        for low, high in ranges:
            on_train = summarize([answer(r, low, high) for r in train_rows])
            chosen[f"{low}..{high}"] = (on_train["qa_accuracy"] or 0.0, -(on_train["tokens_given"] or 0.0))
        best = max(chosen, key=chosen.__getitem__)
        report["best"] = {"range": best, "train_qa_accuracy": chosen[best][0], "selection_questions": len(train_rows),
                          **report["ranges"][best]}
    return report


def _qa_summary(summary: dict) -> dict:
    keys = ("qa_accuracy", "recall", "tokens_read", "tokens_given", "chunk_tokens")
    return {"n": summary["n"], **{k: summary[k] for k in keys}, "ci95": {k: summary["ci95"][k] for k in keys}}
