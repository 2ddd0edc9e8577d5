"""LATTICE traversal traces as distillation data: slates, a split by query, and the rows each student trains on.

A slate (one line of ``overstory data lattice-traces``) is a query, its candidates' texts, the teacher's raw
scores 0-100 by position (None where the reply left a candidate out) and reasoning, and whether each candidate
leads to gold. The split is by query: every slate of a held-out query is held out, so the agreement measured
there (``overstory eval lattice``) is on questions the student never saw, as a document split is for the planner.
Several traces files (say, one per dataset) are read as one set of slates (``read_trace_files``): the split is over
the union of their queries, and a query traced in two files is refused, since its slates would be two searches'.

Targets, per candidate: ``teacher`` = the teacher's raw score / 100 (distillation); ``gold`` = 1 if the
candidate leads to a gold leaf, else 0 (training on relevance labels, never reported as distillation); ``mix`` =
their mean. Only slates the teacher's reply parsed are used, and only candidates it scored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from overstory.data_pipeline.splits import document_bucket
from overstory.models.scorer import slate_completion, slate_prompt

Targets = Literal["teacher", "gold", "mix"]


@dataclass(frozen=True)
class TracedSlate:
    """One teacher-scored slate from the traversal traces."""

    id: str
    query_id: str
    query: str
    texts: list[str]
    leaf: bool
    teacher_scores: list[float | None]
    reasoning: str
    leads_to_gold: list[bool]

    def targets(self, kind: Targets) -> list[float | None]:
        """Per-candidate targets in [0, 1] (None: the teacher did not score it)."""
        out: list[float | None] = []
        for score, gold in zip(self.teacher_scores, self.leads_to_gold, strict=True):
            if score is None:
                out.append(None)
            elif kind == "teacher":
                out.append(score / 100.0)
            elif kind == "gold":
                out.append(float(gold))
            else:
                out.append(0.5 * score / 100.0 + 0.5 * float(gold))
        return out


def read_slates(path: str | Path) -> list[TracedSlate]:
    """The parsed, at-least-partly scored slates of a traces file (others are left out: nothing to learn)."""
    slates = []
    with open(path) as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_number}: not a JSON line ({exc.msg})") from exc
            scores = record.get("raw_scores", [])
            if not record.get("parsed", True) or all(s is None for s in scores):
                continue
            slates.append(TracedSlate(id=record["id"], query_id=record["query_id"], query=record["query"],
                                      texts=record["texts"], leaf=bool(record["leaf"]), teacher_scores=scores,
                                      reasoning=record.get("reasoning", ""), leads_to_gold=record["leads_to_gold"]))
    return slates


def read_trace_files(paths: list[str]) -> list[TracedSlate]:
    """The slates of every traces file in order (``read_slates``), refusing a query that appears in two of them."""
    slates: list[TracedSlate] = []
    seen: dict[str, str] = {}  # query id -> the file that traced it
    for path in paths:
        found = read_slates(path)
        for query_id in sorted({s.query_id for s in found}):
            if query_id in seen:
                raise ValueError(f"question {query_id} is traced in both {seen[query_id]} and {path}: a question's "
                                 f"slates must come from one search; drop it from one file")
            seen[query_id] = path
        slates += found
    return slates


def heldout_queries(query_ids: set[str], val_fraction: float) -> set[str]:
    """The held-out queries: those whose hash bucket falls below ``val_fraction`` (at least one, at most all but
    one, when there are two or more), independent of which other queries exist."""
    if val_fraction <= 0 or len(query_ids) < 2:
        return set()
    ranked = sorted(query_ids, key=document_bucket)
    held = {q for q in ranked if document_bucket(q) < val_fraction}
    if not held:
        held = {ranked[0]}
    if len(held) == len(ranked):
        held.discard(ranked[-1])
    return held


def split_slates(slates: list[TracedSlate], val_fraction: float) -> tuple[list[TracedSlate], list[TracedSlate]]:
    """(train, held out), by query."""
    held = heldout_queries({s.query_id for s in slates}, val_fraction)
    return [s for s in slates if s.query_id not in held], [s for s in slates if s.query_id in held]


def llm_rows(slates: list[TracedSlate], max_candidate_chars: int, max_reasoning_chars: int) -> list[dict]:
    """TRL's conversational prompt-completion rows: the scorer's own slate prompt, and the teacher's reply
    rewritten in canonical form (its reasoning, its ranking, its scores) as the completion. Only fully scored
    slates: a student should learn to score every candidate."""
    rows = []
    for slate in slates:
        if any(s is None for s in slate.teacher_scores):
            continue
        prompt = slate_prompt(slate.query, slate.texts, slate.leaf, max_chars=max_candidate_chars)
        completion = slate_completion(slate.teacher_scores, slate.reasoning, max_reasoning_chars)
        rows.append({"prompt": [{"role": "user", "content": prompt}],
                     "completion": [{"role": "assistant", "content": completion}]})
    return rows


def pointwise_rows(slates: list[TracedSlate], targets: Targets, max_candidate_chars: int) -> dict[str, list]:
    """(query, candidate text, target) columns for a pointwise cross-encoder loss; every scored candidate of
    every slate, internal-node descriptions and leaves alike. A candidate seen in several slates of a query
    appears once per slate: its targets differ with the slate, and the teacher's view is what is learned."""
    columns: dict[str, list] = {"query": [], "text": [], "label": []}
    for slate in slates:
        for text, target in zip(slate.texts, slate.targets(targets), strict=True):
            if target is not None:
                columns["query"].append(slate.query)
                columns["text"].append(text[:max_candidate_chars])
                columns["label"].append(target)
    return columns


def listwise_rows(slates: list[TracedSlate], targets: Targets, max_candidate_chars: int,
                  label_scale: float) -> dict[str, list]:
    """(query, [candidate texts], [targets * label_scale]) columns for a listwise loss; slates with at least two
    scored candidates (one candidate has no order)."""
    columns: dict[str, list] = {"query": [], "docs": [], "labels": []}
    for slate in slates:
        pairs = [(text[:max_candidate_chars], target * label_scale)
                 for text, target in zip(slate.texts, slate.targets(targets), strict=True) if target is not None]
        if len(pairs) >= 2:
            columns["query"].append(slate.query)
            columns["docs"].append([text for text, _ in pairs])
            columns["labels"].append([label for _, label in pairs])
    return columns
