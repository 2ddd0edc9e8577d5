"""The compressor's inputs straight from a corpus's hierarchy, for the objectives and methods that need no summary.

The set compressor reads an upper-level chunk's children's embeddings. ``overstory data summaries`` stores them in
``SummaryRecord``s beside an LLM summary (e_gt, the MSE objective's target); the contrastive objective and the
evaluation's methods other than ``summarize`` need only the children, so ``child_groups`` builds them here from
``build_hierarchies`` and an encoder, no LLM: one ``ChildGroup`` per chunk of the chosen levels, its children's
texts embedded (``c.text``, as the summaries job embeds them).

``question_counts`` sorts a corpus's questions about some documents into those retrieval can be scored on (text
evidence) and the ones left out, counted: evidence that is only a figure or table (QASPER's ``figure_table_only``),
and no text evidence at all (unanswerable, or evidence not found in the text). ``uncovered_questions`` counts the
kept questions whose evidence no upper-level chunk overlaps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from overstory.core.config import ConfigError
from overstory.core.records import Chunk, QAExample, check_upper_levels
from overstory.data_pipeline.hierarchy import HierarchyConfig
from overstory.retrieval.metrics import covers

Encode = Callable[[list[str]], np.ndarray]


@dataclass(frozen=True)
class GroupsConfig:
    """Which upper-level chunks of the corpus's hierarchy become compressor inputs, and how that hierarchy is built
    (the summaries configs' defaults: sections and subsections, SmolLM2's tokenizer, 256 / 1024 tokens)."""

    levels: list[str] = field(default_factory=lambda: ["subsection", "section"])
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)

    def __post_init__(self) -> None:
        if not self.levels:
            raise ConfigError("groups.levels must name at least one level, e.g. [subsection, section]")
        try:
            check_upper_levels(self.levels)
        except ValueError as exc:
            raise ConfigError(f"groups.levels: {exc}") from exc


@dataclass(frozen=True)
class ChildGroup:
    """An upper-level chunk as the compressor reads it, without a summary: a ``SummaryRecord``'s fields less the
    summary, its cost and e_gt (``target_embedding`` is None: there is no target to regress on)."""

    id: str
    doc_id: str
    level: str
    child_ids: list[str]
    child_embeddings: list[list[float]]
    encoder: str

    @property
    def target_embedding(self) -> None:
        return None


def upper_chunks(chunks: Iterable[Chunk], levels: Sequence[str]) -> list[Chunk]:
    """The chunks of ``levels`` that have children (what a compressor can compress), in their original order."""
    return [c for c in chunks if c.level in levels and c.children]


def child_groups(chunks: Sequence[Chunk], levels: Sequence[str], encode: Encode, encoder: str) -> list[ChildGroup]:
    """One ``ChildGroup`` per upper-level chunk of ``chunks`` (a whole hierarchy: the children must be in it); every
    child is embedded once, in one ``encode`` call, even where two groups share it."""
    by_id = {c.id: c for c in chunks}
    upper = upper_chunks(chunks, levels)
    child_ids = list(dict.fromkeys(cid for c in upper for cid in c.children))
    vectors = np.asarray(encode([by_id[cid].text for cid in child_ids]), dtype=np.float32) if child_ids else \
        np.zeros((0, 0), dtype=np.float32)
    row = {cid: i for i, cid in enumerate(child_ids)}
    return [ChildGroup(id=c.id, doc_id=c.doc_id, level=c.level, child_ids=list(c.children),
                       child_embeddings=vectors[[row[cid] for cid in c.children]].round(6).tolist(), encoder=encoder)
            for c in upper]


def question_docs(question: QAExample) -> set[str]:
    """The documents a question is about: its evidence's, else the one it names (``metadata["doc_id"]``: a QASPER
    question whose evidence is only a figure still belongs to its paper)."""
    return set(question.gold_doc_ids) or ({question.metadata["doc_id"]} if "doc_id" in question.metadata else set())


def question_counts(questions: Iterable[QAExample], docs: set[str], within: bool = False
                    ) -> tuple[list[QAExample], dict[str, int]]:
    """The questions about ``docs`` that have text evidence (the ones recall and the contrastive objective can use),
    and the counts of all of them: ``questions`` (kept), ``figure_table_only`` and ``no_text_evidence`` (left out).
    A question is about ``docs`` when one of its documents is among them, or with ``within`` every one (a HotpotQA
    question whose second article is not held out cannot be scored on the held-out chunks).

    >>> from overstory.core.records import Span
    >>> text = QAExample("q1", "?", [], [Span("a", 0, 5)], "qasper", {"doc_id": "a"})
    >>> figure = QAExample("q2", "?", [], [], "qasper", {"doc_id": "a", "figure_table_only": True})
    >>> other = QAExample("q3", "?", [], [Span("b", 0, 5)], "qasper", {"doc_id": "b"})
    >>> kept, counts = question_counts([text, figure, other], {"a"})
    >>> [q.id for q in kept], counts
    (['q1'], {'questions': 1, 'figure_table_only': 1, 'no_text_evidence': 0})
    """
    kept, counts = [], {"questions": 0, "figure_table_only": 0, "no_text_evidence": 0}
    for question in questions:
        about = question_docs(question)
        if not (about <= docs if within else about & docs) or not about:
            continue
        if question.evidence:
            kept.append(question)
        else:
            counts["figure_table_only" if question.metadata.get("figure_table_only") else "no_text_evidence"] += 1
    counts["questions"] = len(kept)
    return kept, counts


def uncovered_questions(questions: Iterable[QAExample], upper: Iterable[Chunk]) -> int:
    """How many ``questions`` have no span of evidence that any of the ``upper`` chunks overlaps: they can never be
    a positive, nor reach recall above 0."""
    by_doc: dict[str, list[Chunk]] = {}
    for chunk in upper:
        by_doc.setdefault(chunk.doc_id, []).append(chunk)
    return sum(not any(covers(c, span) for span in q.evidence for c in by_doc.get(span.doc_id, ()))
               for q in questions)
