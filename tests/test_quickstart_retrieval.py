"""The quickstart's ``retrieval`` stage on the shipped corpora (real SQuAD articles and HotpotQA paragraphs, MiniLM
served by the embedded engine): a SQuAD question is searched within its own article, as ``eval pipeline`` searches
it, and HotpotQA's over the whole corpus; ``retrieval_scope`` overrides it and a bad value names the key."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from overstory.core.config import ConfigError
from overstory.data_pipeline.corpora import load_corpus
from overstory.data_pipeline.hierarchy import build_hierarchies, chunks_at_levels
from overstory.evaluation.report_tables import quickstart_table
from overstory.evaluation.scope import search_in_scope
from overstory.models.registry import MINILM
from overstory.quickstart import QuickstartConfig, run_retrieval_stage
from overstory.retrieval.index import BM25Index
from overstory.retrieval.metrics import mean, recall_at_k
from overstory.serving.client import Client
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.in_process import in_process_client

ROOT = Path(__file__).resolve().parents[1]
K = 5


def shipped(scope: str = "auto") -> QuickstartConfig:
    """The quickstart's corpora (the shipped SQuAD articles and HotpotQA sample) read from the repository."""
    corpora = {name: replace(c, path=str(ROOT / c.path)) for name, c in QuickstartConfig().corpora.items()}
    return QuickstartConfig(corpora=corpora, retrieval_scope=scope)


@pytest.fixture(scope="module")
def corpora() -> tuple[dict, dict]:
    """Each shipped corpus loaded (documents, questions) and its hierarchy, as the quickstart's first stage makes."""
    config = shipped()
    loaded = {name: load_corpus(corpus) for name, corpus in config.corpora.items()}
    return loaded, {name: build_hierarchies(docs, config.hierarchy) for name, (docs, _) in loaded.items()}


@pytest.fixture(scope="module")
def embedder() -> Iterator[Client]:
    with EmbeddedEngine(ServeConfig(port=0, roles={"embedder": RoleConfig(model=MINILM, kind="embedding")})) as engine:
        yield in_process_client(engine)


def squad_answerable(corpora) -> tuple[list, BM25Index]:
    (_, questions), chunks = corpora[0]["squad"], corpora[1]["squad"]
    return [q for q in questions if q.evidence], BM25Index.build(chunks_at_levels(chunks, ["paragraph"]))


def test_scope_auto_is_the_article_for_squad_and_the_corpus_for_hotpotqa() -> None:
    config = shipped()
    assert config.retrieval_scope == "auto"
    assert (config.retrieval_scope_of("squad"), config.retrieval_scope_of("hotpotqa")) == ("document", "corpus")
    assert shipped("corpus").retrieval_scope_of("squad") == "corpus"  # open-corpus SQuAD, when asked for


@pytest.mark.parametrize("scope, says", [("article", "is not a scope"), ("document", "open corpus")])
def test_a_bad_scope_names_the_key_and_the_corpus(scope: str, says: str) -> None:
    with pytest.raises(ConfigError, match="retrieval_scope") as caught:
        shipped(scope)
    assert says in str(caught.value)
    if scope == "document":
        assert "hotpotqa" in str(caught.value)


def test_squad_alone_may_insist_on_document_scope() -> None:
    defaults = QuickstartConfig()
    config = QuickstartConfig(corpora={"squad": shipped().corpora["squad"]}, rag_corpus="squad",
                              lattice=replace(defaults.lattice, corpus="squad"),
                              strategies=replace(defaults.strategies, corpora=["squad"]), retrieval_scope="document")
    assert config.retrieval_scope_of("squad") == "document"


def test_a_squad_question_is_searched_within_its_own_article(corpora) -> None:
    questions, index = squad_answerable(corpora)
    articles = {c.doc_id for c in index.chunks}
    assert len(articles) == 3 and len(questions) > 400
    scoped = search_in_scope(index, questions, K, "document")
    for question, hits in zip(questions, scoped):
        assert len(hits) == K and {h.chunk.doc_id for h in hits} == {question.metadata["doc_id"]}, question.id
    # the whole corpus brings in other articles' paragraphs for some questions: the scope is what keeps them out
    everywhere = search_in_scope(index, questions, K, "corpus")
    foreign = sum(any(h.chunk.doc_id != q.metadata["doc_id"] for h in hits) for q, hits in zip(questions, everywhere))
    assert foreign > 0
    # grouped searches rank as one question's own search does
    for question, hits in list(zip(questions, scoped))[::40]:
        alone = index.search([question.question], K, doc_ids=[question.metadata["doc_id"]])[0]
        assert [h.chunk.id for h in hits] == [h.chunk.id for h in alone], question.id


def test_the_stage_measures_squad_recall_within_each_article_and_records_the_scope(corpora, embedder) -> None:
    loaded, chunks = corpora
    stage = run_retrieval_stage(shipped(), loaded, chunks, embedder)
    squad, hotpotqa = stage["squad"], stage["hotpotqa"]
    assert (squad["scope"], hotpotqa["scope"]) == ("document", "corpus")
    assert squad["n_documents"] == 3 and hotpotqa["n_documents"] == len(loaded["hotpotqa"][0])

    questions, index = squad_answerable(corpora)
    assert squad["n_questions"] == len(questions)
    within = [index.search([q.question], K, doc_ids=[q.metadata["doc_id"]])[0] for q in questions]
    expected = mean([recall_at_k([h.chunk for h in hits], q.evidence, K) for q, hits in zip(questions, within)])
    assert squad[f"bm25_recall@{K}"] == pytest.approx(expected)
    everywhere = index.search([q.question for q in questions], K)
    corpus_wide = mean([recall_at_k([h.chunk for h in hits], q.evidence, K) for q, hits in zip(questions, everywhere)])
    assert expected > corpus_wide  # other articles' paragraphs no longer take gold paragraphs' places
    for kind in ("dense", "hybrid"):
        assert 0.5 < squad[f"{kind}_recall@{K}"] <= 1.0

    line = quickstart_table({"stages": {"retrieval": stage}})
    assert f"squad, {len(questions)} questions, each within its own document: bm25 recall@5" in line
    assert f"hotpotqa, {hotpotqa['n_questions']} questions over the whole corpus: bm25 recall@5" in line
