"""How closely a distilled LATTICE student scores like its teacher, on the teacher's slates of the student's held-out
questions (``overstory eval lattice`` with ``agreement_traces``).

Two figures, each beside what it must beat. Kendall tau between the teacher's and the student's scores of a slate's
candidates, averaged over the slates where both express an order. Top-1 agreement: the student's best candidate is
among the teacher's best; a student that ties several candidates at its top is scored by the share of its tied best
that the teacher also ranks first, which is what picking one of them at random would give in expectation (taking the
first of the tie, as ``argmax`` does, credited a student that scored every candidate alike with the slate order's
bias: on the CPU teacher's held-out slates the first candidate is the teacher's best in 63% of them, by their order,
not the student's judgement). Beside it, over the same slates: ``top1_chance`` (a random pick's expected agreement)
and ``top1_first_candidate`` (always the first candidate); and how many slates the student scored flat (all its
scores equal: no order, so no tau, and a chance-level top-1). Each slate's scores are kept in a JSONL file so the
figures can be derived again without scoring again."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from overstory.core.config import ConfigError
from overstory.core.records import read_jsonl
from overstory.retrieval.lattice.scorers import Slate, SlateScorer


def heldout_slates(paths: list[str], model: str) -> list[dict]:
    """The parsed slates of the student's held-out questions, from every traces file in order."""
    heldout_file = Path(model).parent / "heldout_queries.json"
    if not heldout_file.exists():
        raise ConfigError(f"{heldout_file} not found: agreement needs the student's held-out queries "
                          f"(written by `overstory train distill-scorer`)")
    held = set(json.loads(heldout_file.read_text()))
    return [r for path in paths for r in read_jsonl(path) if r["query_id"] in held and r.get("parsed", True)]


def _mean(values: list[float]) -> float | None:
    return round(float(np.mean(values)), 4) if values else None


def agreement(student: SlateScorer, teacher_slates: list[dict], record: Path | None = None) -> dict:
    """The student's scores on the teacher's slates, over the candidates both scored. Slates where the teacher scored
    every candidate alike (``teacher_ties``) have no best and no order, so they count in neither figure; slates the
    student scored flat (``student_flat``) count in top-1 at chance and have no tau. ``tau_undefined`` is the two
    together. With ``record``, each slate's teacher and student scores are written there, one JSON line a slate."""
    from scipy.stats import kendalltau

    slates = [Slate(s["query_id"], s["query"], s["node_ids"], s["texts"], bool(s["leaf"])) for s in teacher_slates]
    scored = student.score(slates)
    taus, top1, chance, first = [], [], [], []
    teacher_ties = student_flat = 0
    for slate, reply in zip(teacher_slates, scored, strict=True):
        both = [i for i, t in enumerate(slate["raw_scores"]) if t is not None and i in reply.scores]
        if not both:
            continue
        teacher = np.array([slate["raw_scores"][i] for i in both], dtype=float)
        student_scores = np.array([reply.scores[i] for i in both], dtype=float)
        if len(set(teacher)) < 2:
            teacher_ties += 1
            continue
        teacher_best = teacher == teacher.max()
        student_best = student_scores == student_scores.max()
        top1.append(float(teacher_best[student_best].mean()))
        chance.append(float(teacher_best.mean()))
        first.append(float(teacher_best[0]))
        if student_best.all():
            student_flat += 1
            continue
        taus.append(float(kendalltau(teacher, student_scores).statistic))
    if record is not None:
        record.parent.mkdir(parents=True, exist_ok=True)
        with open(record, "w") as handle:
            for slate, reply in zip(teacher_slates, scored, strict=True):
                handle.write(json.dumps({"query_id": slate["query_id"], "node_ids": slate["node_ids"],
                                         "teacher": slate["raw_scores"],
                                         "student": [reply.scores.get(i) for i in range(len(slate["node_ids"]))]})
                             + "\n")
    return {"kendall_tau": _mean(taus), "top1_agreement": _mean(top1), "top1_chance": _mean(chance),
            "top1_first_candidate": _mean(first), "n_slates": len(teacher_slates), "n_top1": len(top1),
            "n_tau": len(taus), "teacher_ties": teacher_ties, "student_flat": student_flat,
            "tau_undefined": teacher_ties + student_flat}


def agreement_cell(agree: dict | None) -> str:
    """The table's cell: tau / top-1, the slates, and top-1's two references with the student's flat slates."""
    if not agree:
        return "-"

    def shown(key: str) -> str:
        return "-" if agree.get(key) is None else f"{agree[key]}"

    cell = f"{shown('kendall_tau')} / {shown('top1_agreement')} ({agree['n_slates']} slates"
    if "top1_chance" in agree:  # figures written before the tie-aware top-1 have no references
        cell += (f"; top-1 by chance {shown('top1_chance')}, first candidate {shown('top1_first_candidate')}; "
                 f"flat on {agree['student_flat']} of {agree['n_top1']}")
    return cell + ")"
