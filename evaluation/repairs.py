"""Repairs: what a strategy or an evaluation fixed up inside an item it still answered, counted by kind.

A failed question has no answer and is counted among the failures. A repaired one has an answer that rests on a
stand-in: a planner reply without a plan answered from the fallback range (``plan_unparsed``), a truncated or
malformed tool call (``tool_failures.truncated_call``), a slate whose scores could not be read (``failed_slates``,
``all_slates_failed``), a summary replaced by the encoder on the raw text. Its figures are real but measure the
stand-in, so every table shows the repairs beside the failures.

Strategies put their counts into an answer's ``details``. A count is a repair when its name ends in one of
``REPAIR_SUFFIXES`` (or is a dict of counts under a name ending in ``_failures``), or is one of the slate-reply
problems of LATTICE's scorer (``SLATE_PROBLEMS``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from overstory.models.scorer import SlateParse

REPAIR_SUFFIXES = ("_unparsed", "_failures", "_failed", "_fallbacks", "_truncated", "failed_slates")
# a slate reply's problems (models/scorer.py) and the candidates the search left unscored (retrieval/lattice)
SLATE_PROBLEMS = (*SlateParse().problems, "unscored_candidates")


def is_repair(key: str) -> bool:
    """Whether a details count named ``key`` is a repair.

    >>> [is_repair(k) for k in ("plan_unparsed", "all_slates_failed", "missing", "turns", "slates")]
    [True, True, True, False, False]
    """
    return key.endswith(REPAIR_SUFFIXES) or key in SLATE_PROBLEMS


def repair_counts(details: Iterable[Mapping]) -> dict[str, int]:
    """The repairs of many answers by kind, from their ``details`` (zero counts left out; a bool counts as 0/1).

    >>> repair_counts([{"plan_unparsed": 1, "plan": ["sentence", "paragraph"]},
    ...                {"tool_failures": {"truncated_call": 2}, "turns": 3, "slates": 4, "failed_slates": 4,
    ...                 "all_slates_failed": 1, "question_truncated": False}])
    {'plan_unparsed': 1, 'tool_failures.truncated_call': 2, 'failed_slates': 4, 'all_slates_failed': 1}
    """
    counts: Counter[str] = Counter()
    for record in details:
        for key, value in record.items():
            if isinstance(value, Mapping) and key.endswith("_failures"):
                counts.update({f"{key}.{kind}": int(n) for kind, n in value.items()})
            elif isinstance(value, int) and is_repair(key):
                counts[key] += int(value)
    return {key: n for key, n in counts.items() if n}


def repairs_cell(repairs: Mapping[str, int] | None) -> str:
    """A table cell: the repairs by kind, most frequent first; ``0`` for none, ``-`` where the report predates the
    count (an older metrics.json).

    >>> repairs_cell({"plan_unparsed": 2, "tool_failures.truncated_call": 5}), repairs_cell({}), repairs_cell(None)
    ('tool_failures.truncated_call 5, plan_unparsed 2', '0', '-')
    """
    if repairs is None:
        return "-"
    ordered = sorted(repairs.items(), key=lambda item: -item[1])
    return ", ".join(f"{kind} {n}" for kind, n in ordered) or "0"
