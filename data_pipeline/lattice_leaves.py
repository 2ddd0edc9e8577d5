"""The leaves of a LATTICE tree as corpus chunks, and the gold leaves of a question: what the traces job
(``overstory data lattice-traces``) searches for and what the evaluations (``eval lattice``, ``eval pipeline``)
score and answer from.

A tree keeps only its leaves' ids; the chunks behind them (their text and character spans) are rebuilt from the
corpus with the hierarchy settings the tree was built with, so the spans locate each question's evidence.
"""

from __future__ import annotations

from collections.abc import Iterable

from overstory.core.records import Chunk, Document, QAExample
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies, chunks_at_levels
from overstory.retrieval.lattice.tree import Tree


def gold_leaves(questions: Iterable[QAExample], leaves: Iterable[Chunk]) -> dict[str, set[str]]:
    """Question id -> the leaf chunks overlapping its evidence spans (questions without any are left out)."""
    by_doc: dict[str, list[Chunk]] = {}
    for chunk in leaves:
        by_doc.setdefault(chunk.doc_id, []).append(chunk)
    gold = {}
    for question in questions:
        hits = {c.id for span in question.evidence for c in by_doc.get(span.doc_id, [])
                if c.start < span.end and span.start < c.end}
        if hits:
            gold[question.id] = hits
    return gold


def tree_leaf_chunks(tree: Tree, documents: Iterable[Document], hierarchy: HierarchyConfig,
                     leaf_level: str) -> list[Chunk]:
    """The corpus's chunks at ``leaf_level`` that are leaves of ``tree`` (rebuilt with the tree's hierarchy
    settings, so their spans locate the evidence)."""
    tree_leaves = {n.id for n in tree.nodes.values() if n.leaf}
    return [c for c in chunks_at_levels(build_hierarchies(documents, hierarchy), leaf_level) if c.id in tree_leaves]
