"""Where an evaluation searches each question: within its own document, or over the whole corpus.

QASPER, NarrativeQA and SQuAD ask each question about one given document (a paper, a story, an article); HotpotQA's
questions are posed over the open corpus (``CorpusConfig.document_scoped`` says which). An evaluation's ``scope``
setting picks: ``auto`` follows the dataset, ``document`` insists on the question's document, ``corpus`` searches
everything for every question (on a document-scoped dataset, a harder open-corpus variant, named so in tables).
``eval pipeline``, ``eval compressor`` and the quickstart resolve it here, so all read a setting the same way, and
the last two search an index in scope with ``search_in_scope``.
"""

from __future__ import annotations

from collections.abc import Sequence

from overstory.core.config import ConfigError
from overstory.core.records import QAExample
from overstory.data_pipeline.corpora import CorpusConfig
from overstory.retrieval.index import BM25Index, DenseIndex, Hit, HybridIndex

SCOPES = ("auto", "document", "corpus")


def resolve_scope(scope: str, corpus: CorpusConfig) -> str:
    """``document`` (each question within its own document) or ``corpus`` (everywhere) for the ``scope`` setting
    on ``corpus``; ConfigError, naming ``scope``, for an unknown setting or document scope on an open corpus.

    >>> resolve_scope("auto", CorpusConfig("qasper", "x")), resolve_scope("auto", CorpusConfig("hotpotqa", "x"))
    ('document', 'corpus')
    >>> resolve_scope("corpus", CorpusConfig("squad", "x"))
    'corpus'
    """
    if scope not in SCOPES:
        raise ConfigError(f"scope: {scope!r} is not a scope; choose from {', '.join(SCOPES)} (auto: the "
                          "question's document where the dataset has one, else the whole corpus)")
    if scope == "document" and not corpus.document_scoped:
        raise ConfigError(f"scope: document needs questions that are each about one document (squad, qasper, "
                          f"narrativeqa); {corpus.kind}'s are posed over the open corpus: use scope=auto")
    if scope == "auto":
        return "document" if corpus.document_scoped else "corpus"
    return scope


def question_scope(question: QAExample, mode: str) -> list[str] | None:
    """The documents a question is searched in: its own (``metadata["doc_id"]``, which the loaders of
    document-scoped datasets set) under the ``document`` mode, None (the whole corpus) under ``corpus``.

    >>> q = QAExample("q1", "Which dataset?", ["SQuAD"], [], "qasper", {"doc_id": "qasper/1"})
    >>> question_scope(q, "document"), question_scope(q, "corpus")
    (['qasper/1'], None)
    """
    if mode == "corpus":
        return None
    if not question.metadata.get("doc_id"):
        raise ConfigError(f"scope: question {question.id} names no document (metadata doc_id), so it cannot be "
                          "searched within its document; use scope=corpus")
    return [question.metadata["doc_id"]]


def search_in_scope(index: BM25Index | DenseIndex | HybridIndex, questions: Sequence[QAExample], k: int,
                    mode: str) -> list[list[Hit]]:
    """Each question's top ``k`` chunks of ``index``: among its own document's under the ``document`` mode, among all
    under ``corpus`` (``question_scope``; the index restricts the search). Questions that share a scope are
    searched, and embedded, in one call."""
    groups: dict[tuple[str, ...] | None, list[int]] = {}
    for i, question in enumerate(questions):
        scope = question_scope(question, mode)
        groups.setdefault(tuple(scope) if scope is not None else None, []).append(i)
    ranked: list[list[Hit]] = [[] for _ in questions]
    for scope, members in groups.items():
        for i, hits in zip(members, index.search([questions[i].question for i in members], k, doc_ids=scope)):
            ranked[i] = hits
    return ranked


def scope_title(report: dict) -> str:
    """What a table's questions were searched in, for its title (``dataset``, ``scope`` mode and ``n_documents``
    of a report).

    >>> scope_title({"dataset": "qasper", "scope": "corpus", "n_documents": 6})
    'qasper, open corpus: every question searched over all 6 documents'
    >>> scope_title({"dataset": "qasper", "scope": "document", "n_documents": 6})
    'qasper, document scope: each question searched within its own document (of 6)'
    """
    if report["scope"] == "document":
        return f"{report['dataset']}, document scope: each question searched within its own document " \
               f"(of {report['n_documents']})"
    return f"{report['dataset']}, open corpus: every question searched over all {report['n_documents']} documents"
