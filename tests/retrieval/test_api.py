"""The Python API (``overstory.retrieval.api``) on real shipped data and the built-in models (SmolLM2-135M-Instruct,
MiniLM) loaded in this process: retrieve and answer with naive and SmartChunk over a slice of the HotpotQA sample,
a scoped retrieve, the BM25 floor's retrieve-by-answering, and the bad input it refuses."""

from __future__ import annotations

import pytest

from overstory.core.config import ConfigError
from overstory.data_pipeline.corpora import load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.evaluation.pipeline import DATASETS, PipelineEvalConfig
from overstory.retrieval.api import Models, Retriever, documents_from


@pytest.fixture(scope="module")
def models():
    with Models.builtin() as loaded:
        yield loaded


@pytest.fixture(scope="module")
def hotpot():
    """The supporting documents of the sample's first two questions and eight other documents, their hierarchy,
    and those two questions."""
    documents, questions = load_corpus(DATASETS["hotpotqa"])
    asked = questions[:2]
    wanted = {span.doc_id for q in asked for span in q.evidence}
    kept = [d for d in documents if d.id in wanted] + [d for d in documents if d.id not in wanted][:8]
    return kept, build_hierarchies(kept, HierarchyConfig()), asked


def test_naive_retrieves_and_answers_a_hotpotqa_question(models, hotpot) -> None:
    documents, chunks, (question, _) = hotpot
    retriever = Retriever.build("naive", documents, chunks, models)
    assert retriever.index_cost.roles["embedder"]["calls"] >= 1
    found = retriever.retrieve(question.question, k=4)
    ids = {c.id for c in chunks}
    assert len(found.evidence) == 4 and all(hit.id in ids and hit.level == "paragraph" for hit in found.evidence)
    scores = [hit.score for hit in found.evidence]
    assert all(isinstance(s, float) for s in scores) and scores == sorted(scores, reverse=True)
    assert {hit.doc_id for hit in found.evidence} & {span.doc_id for span in question.evidence}
    assert set(found.cost.roles) == {"embedder"} and found.cost.roles["embedder"]["calls"] == 1
    answered = retriever.answer(question.question)
    assert not answered.failure and answered.text and answered.evidence[0].id == found.evidence[0].id
    assert answered.cost.roles["generator"]["calls"] == 1 and answered.cost.roles["generator"]["prompt_tokens"] > 0
    assert answered.evidence[0].score == pytest.approx(found.evidence[0].score)


def test_smartchunk_retrieves_from_the_planned_range(models, hotpot) -> None:
    documents, chunks, (_, question) = hotpot
    retriever = Retriever.build("smartchunk", documents, chunks, models, config={"planner_max_tokens": 32})
    found = retriever.retrieve(question.question, k=3)
    low, high = found.details["plan"]
    order = ["sentence", "paragraph", "subsection", "section", "document"]
    assert len(found.evidence) == 3
    assert all(order.index(low) <= order.index(hit.level) <= order.index(high) for hit in found.evidence)
    assert found.cost.roles["planner"]["calls"] == 1 and "generator" not in found.cost.roles
    assert retriever.max_k == len(chunks)  # the planner may plan any range, sentence..document the widest


def test_a_scoped_retrieve_returns_only_that_documents_chunks(models, hotpot) -> None:
    documents, chunks, (question, _) = hotpot
    other = next(d.id for d in documents if d.id not in {span.doc_id for span in question.evidence})
    retriever = Retriever.build("naive", documents, chunks, models, config={"index": "bm25", "levels": ["sentence"]})
    found = retriever.retrieve(question.question, k=10, scope=other)
    assert found.evidence and {hit.doc_id for hit in found.evidence} == {other}
    assert {hit.id for hit in found.evidence} <= {c.id for c in chunks if c.doc_id == other}


def test_the_bm25_floor_retrieves_by_answering_within_its_document(models) -> None:
    articles, questions = load_corpus(DATASETS["squad"])
    question = questions[0]
    article = next(a for a in articles if a.id == question.evidence[0].doc_id)
    floor = Retriever.build("bm25_floor", [article], build_hierarchies([article], HierarchyConfig()), models)
    found = floor.retrieve(question.question, scope=article.id)
    assert [hit.level for hit in found.evidence] == ["paragraph"] and found.evidence[0].score is None
    assert found.details["prediction"] in found.evidence[0].text and found.cost.calls == 0


def test_bad_input_is_refused_with_what_is_wrong(models, hotpot) -> None:
    documents, chunks, (question, _) = hotpot
    with pytest.raises(ConfigError) as harness:
        PipelineEvalConfig(strategies="naïve")
    with pytest.raises(ConfigError) as api:
        Retriever.build("naïve", documents, chunks, models)
    assert str(api.value) == str(harness.value)
    with pytest.raises(ConfigError, match=r"unknown config key 'naive.kk'; did you mean 'naive.k'\?"):
        Retriever.build("naive", documents, chunks, models, config={"kk": 3})
    with pytest.raises(ConfigError, match="lattice.tree"):
        Retriever.build("lattice", documents, chunks, models)
    with pytest.raises(ConfigError, match=r"documents\[0\]: missing field\(s\) title"):
        documents_from([{"id": "a", "text": "x"}])
    with pytest.raises(ConfigError, match="repeated id"):
        documents_from([documents[0], documents[0]])
    with pytest.raises(ConfigError, match="not among the documents given"):
        Retriever.build("naive", documents[:1], chunks, models)
    retriever = Retriever.build("naive", documents, chunks, models, config={"index": "bm25"})
    for bad in ({"question": " "}, {"question": question.question, "k": 0},
                {"question": question.question, "scope": "hotpotqa/no-such-document"}):
        with pytest.raises(ValueError):
            retriever.retrieve(**bad)
    paragraphs = sum(c.level == "paragraph" for c in chunks)  # what naive indexes (naive.levels)
    assert retriever.max_k == paragraphs and len(retriever.retrieve(question.question, k=paragraphs).evidence) == \
        paragraphs
    with pytest.raises(ValueError, match=f"k={paragraphs + 1} is more than the naive index can return: at most "
                                         f"{paragraphs} chunks"):
        retriever.retrieve(question.question, k=paragraphs + 1)
