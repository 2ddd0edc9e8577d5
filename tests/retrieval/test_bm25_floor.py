"""The BM25 sentence floor on the real shipped QASPER questions: its evidence is one paragraph of the question's own
paper, its answer a sentence of that paragraph sharing the most content words with the question; no model is asked,
and a question without a document is refused."""

from __future__ import annotations

import pytest

from overstory.core.config import ConfigError
from overstory.core.records import Document
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.data_pipeline.qasper import paragraphs_at
from overstory.evaluation.pipeline import PipelineEvalConfig
from overstory.retrieval.bm25_floor import BM25FloorStrategy, content_words
from overstory.serving.client import Client
from tests.conftest import ROOT


class NoModel:
    """Stands in for a stack: the floor must never send a request, so any request fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"bm25_floor reached the client ({name})")


@pytest.fixture(scope="module")
def qasper() -> tuple[list[Document], list, BM25FloorStrategy]:
    documents, questions = load_corpus(CorpusConfig("qasper", str(ROOT / "data/qasper"), split="dev"))
    return documents, questions, BM25FloorStrategy.build(build_hierarchies(documents, HierarchyConfig()))


def test_evidence_is_a_paragraph_of_the_paper_and_the_answer_its_best_sentence(qasper) -> None:
    documents, questions, floor = qasper
    by_id = {d.id: d for d in documents}
    for question in questions:
        paper = by_id[question.metadata["doc_id"]]
        result = floor.answer(question.question, NoModel(), scope=[paper.id])
        assert not result.failure and len(result.evidence) == 1
        top = result.evidence[0]
        assert top.doc_id == paper.id and top.level == "paragraph"
        paragraph = paragraphs_at(paper, [(top.start, top.end)])
        assert len(paragraph) == 1 and paragraph[0].strip() == top.text  # one whole paragraph of the paper
        assert result.prediction and result.prediction in top.text  # a sentence of it, verbatim
        sentences = floor.sentences[top.id]
        assert result.prediction in [s.text for s in sentences]
        asked = content_words(question.question)
        best = max(len(asked & content_words(s.text)) for s in sentences)
        assert len(asked & content_words(result.prediction)) == best
        assert asked & content_words(top.text)  # ranked by the question's words, not a zero-score pick


def test_the_paragraph_that_shares_the_question_words_wins_within_its_own_document() -> None:
    text = "Intro\n\nWe study birds. Owls hunt at night.\n\nOur corpus has 500 German news articles. It is new."
    docs = [Document("d1", "D1", text, {}),
            Document("d2", "D2", "Another paper uses a German news corpus of 900 articles.", {})]
    floor = BM25FloorStrategy.build(build_hierarchies(docs, HierarchyConfig()))
    result = floor.answer("How many German news articles are in the corpus?", NoModel(), scope=["d1"])
    assert result.prediction == "Our corpus has 500 German news articles."
    assert result.evidence[0].doc_id == "d1" and result.details["paragraph"] == result.evidence[0].id


def test_a_question_without_its_document_is_refused(qasper) -> None:
    documents, questions, floor = qasper
    with pytest.raises(ConfigError, match="the open corpus"):
        floor.answer(questions[0].question, Client(NoModel()), scope=None)
    with pytest.raises(ConfigError, match="qasper/nope has no paragraph"):
        floor.answer(questions[0].question, NoModel(), scope=["qasper/nope"])
    with pytest.raises(ConfigError, match="strategies: bm25_floor answers within each question's own document"):
        PipelineEvalConfig(strategies="naive,bm25_floor", data="hotpotqa")
    with pytest.raises(ConfigError, match="scope=corpus"):
        PipelineEvalConfig(strategies="bm25_floor", data="qasper", scope="corpus")
