"""The answer-grounded labelling rule: a pseudo-label's range read off where its answer lies, not off what
retrieval returned.

SmartChunk's method labels a question with the smallest and largest level among the chunks the backbone read
when it answered correctly, so a label's top is whatever the widened retrieval of that attempt returned: the
third attempt reads subsections and sections whatever the question needs. This rule keeps the method's search
(retrieve, answer, widen) and its verdict, and reads the range off the answer instead, applying
``gold_labels.py``'s rule to the units that hold the answer in place of annotated evidence:

1. the answer's place: the best-ranked retrieved chunk that holds the backbone's reply (at least ``min_recall`` of
   its normalised tokens occur in the chunk: half by default, as the F1 correctness rule's threshold), narrowed to
   its smallest descendants that still hold it (a section holding the answer in one sentence becomes that sentence,
   the first one where several repeat it; a paragraph whose sentences each hold a part of it becomes those
   sentences). One place, not every retrieved chunk that mentions the answer: a term a paper repeats in its abstract,
   method and results would otherwise widen the range to the whole paper, which measures repetition, not what the
   question needs;
2. ``level_min``: the smallest level among the place's units; ``level_max``: the smallest level with one chunk
   holding them all (``gold_labels.smallest_holding``), never below ``level_min``.

A label whose reply no retrieved chunk holds (a yes/no reply, an answer put together from several places) is
counted as ungrounded and left without a range under this rule: it never takes the method's range in its name.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace

from overstory.core.records import LEVEL_RANK, Chunk, PseudoLabel, Span
from overstory.data_pipeline.gold_labels import smallest_holding
from overstory.retrieval.metrics import normalize_answer


def _tokens(text: str) -> Counter:
    return Counter(normalize_answer(text).split())


def answer_recall(chunk: Chunk, answer: Counter) -> float:
    """The share of the answer's tokens (with their counts) that occur in ``chunk``; 0 for an empty answer."""
    return sum((answer & _tokens(chunk.text)).values()) / sum(answer.values()) if answer else 0.0


def holds(chunk: Chunk, answer: Counter, min_recall: float) -> bool:
    """Whether at least ``min_recall`` of the answer's tokens (with their counts) occur in ``chunk``.

    >>> chunk = Chunk("s0", "d", "sentence", "We use the CNN and Daily Mail corpora.", None, [], 0, 38, 9)
    >>> holds(chunk, _tokens("CNN, Daily Mail, CBT"), 0.5), holds(chunk, _tokens("Yes"), 0.5)
    (True, False)
    """
    return bool(answer) and answer_recall(chunk, answer) >= min_recall


def answer_units(label: PseudoLabel, chunks_by_id: Mapping[str, Chunk], min_recall: float = 0.5) -> list[Chunk]:
    """The answer's place (rule step 1): the smallest chunks holding the label's answer under the best-ranked
    retrieved chunk that holds it, in text order; empty when no retrieved chunk holds it."""
    answer = _tokens(label.answer)

    def narrowed(chunk: Chunk) -> list[Chunk]:
        children = [chunks_by_id[c] for c in chunk.children]
        # one child holding all the chunk holds: that child (of equals the earliest; a repeat is not needed)
        best = max(children, key=lambda child: answer_recall(child, answer), default=None)
        if best is not None and answer_recall(best, answer) >= answer_recall(chunk, answer):
            return narrowed(best)
        inner = [child for child in children if holds(child, answer, min_recall)]  # each holding a part
        return [unit for child in inner for unit in narrowed(child)] if inner else [chunk]

    for chunk_id in label.retrieved_ids:  # in rank order
        if holds(chunks_by_id[chunk_id], answer, min_recall):
            return narrowed(chunks_by_id[chunk_id])
    return []


def grounded_range(label: PseudoLabel, chunks_by_id: Mapping[str, Chunk],
                   min_recall: float = 0.5) -> tuple[str, str] | None:
    """``(level_min, level_max)`` of a correct label by the answer-grounded rule, or None when it cannot be grounded.
    ``chunks_by_id`` holds the hierarchy of the label's document (``smallest_holding`` passes over any other's).

    >>> chunks = {c.id: c for c in [
    ...     Chunk("p0", "d", "paragraph", "Paris is in France. Rome is in Italy.", None, ["s0", "s1"], 0, 37, 9),
    ...     Chunk("s0", "d", "sentence", "Paris is in France.", "p0", [], 0, 19, 4),
    ...     Chunk("s1", "d", "sentence", "Rome is in Italy.", "p0", [], 20, 37, 4)]}
    >>> label = PseudoLabel("q", "d", "?", ["France"], "sentence", "paragraph", True, 1, ["p0"], ["paragraph"],
    ...                     "France", "m", "f1")
    >>> grounded_range(label, chunks), grounded_range(replace(label, answer="France, Italy"), chunks)
    (('sentence', 'sentence'), ('sentence', 'paragraph'))
    """
    if not label.correct:
        return None
    units = answer_units(label, chunks_by_id, min_recall)
    if not units:
        return None
    level_min = min((u.level for u in units), key=LEVEL_RANK.__getitem__)
    holding = smallest_holding([Span(u.doc_id, u.start, u.end) for u in units], chunks_by_id.values())
    return level_min, max(level_min, holding, key=LEVEL_RANK.__getitem__)


def ground_labels(labels: Sequence[PseudoLabel], chunks: Sequence[Chunk],
                  min_recall: float = 0.5) -> tuple[list[PseudoLabel], dict[str, int]]:
    """Every label with its range by the answer-grounded rule (``source="grounded"``; a correct label that cannot be
    grounded keeps ``correct`` and loses its range), and the counts: ``grounded``, ``ungrounded`` (no retrieved chunk
    holds the reply) and ``unlabelled`` (no attempt was correct)."""
    by_doc: dict[str, dict[str, Chunk]] = {}
    for chunk in chunks:
        by_doc.setdefault(chunk.doc_id, {})[chunk.id] = chunk
    counts = Counter(grounded=0, ungrounded=0, unlabelled=0)
    out = []
    for label in labels:
        found = grounded_range(label, by_doc.get(label.doc_id, {}), min_recall)
        counts["unlabelled" if not label.correct else "grounded" if found else "ungrounded"] += 1
        level_min, level_max = found or (None, None)
        out.append(replace(label, level_min=level_min, level_max=level_max, source="grounded"))
    return out, dict(counts)
