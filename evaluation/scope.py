"""Where an evaluation searches each question: within its own document, or over the whole corpus.

QASPER, NarrativeQA and SQuAD ask each question about one given document (a paper, a story, an article); HotpotQA's
questions are posed over the open corpus (``CorpusConfig.document_scoped`` says which). An evaluation's ``scope``
setting picks: ``auto`` follows the dataset, ``document`` insists on the question's document, ``corpus`` searches
everything for every question (on a document-scoped dataset, a harder open-corpus variant, named so in tables).
``eval pipeline`` and ``eval compressor`` resolve it here, so both read a setting the same way.
"""

from __future__ import annotations

from overstory.core.config import ConfigError
from overstory.core.records import QAExample
from overstory.data_pipeline.corpora import CorpusConfig

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
