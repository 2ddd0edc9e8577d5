"""A stack that cannot serve a role a strategy needs (a wrong role name in a config) answers every question's request
with the same 4xx: each strategy raises ``RequestRefused`` naming the request instead of recording one failed
question after another (the pipeline stops on it: tests/evaluation/test_pipeline.py). Real embedded server, real
MiniLM embedder, no chat model: the refusal is the server's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.models.registry import MINILM
from overstory.retrieval.answer import AnswerConfig
from overstory.retrieval.arag import ARagConfig, ARagStrategy
from overstory.retrieval.naive import NaiveConfig, NaiveStrategy
from overstory.retrieval.smartchunk import SmartChunkConfig, SmartChunkStrategy
from overstory.retrieval.strategy import RequestRefused
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.in_process import in_process_client

ROOT = Path(__file__).resolve().parents[2]
ANSWER = AnswerConfig(max_tokens=16)


@pytest.fixture(scope="module")
def setup():
    """A shipped QASPER paper, its hierarchy, a question about it and a client of a stack that serves only the
    embedder."""
    documents, questions = load_corpus(CorpusConfig("qasper", str(ROOT / "data/qasper/dev.json")))
    documents = [d for d in documents if d.id == questions[0].metadata["doc_id"]]
    with EmbeddedEngine(ServeConfig(port=0, roles={"embedder": RoleConfig(model=MINILM, kind="embedding")})) as engine:
        yield documents, build_hierarchies(documents, HierarchyConfig()), questions[0], in_process_client(engine)


def test_naive_raises_on_the_refused_answer_request(setup):
    _, chunks, question, client = setup
    strategy = NaiveStrategy.build(chunks, client, NaiveConfig(k=3), ANSWER)
    with pytest.raises(RequestRefused, match=r"the answer \(role 'generator'\): .*\(HTTP 4\d\d\)"):
        strategy.answer(question.question, client.fork(), scope=[question.metadata["doc_id"]])


def test_smartchunk_raises_on_the_refused_plan_request(setup):
    documents, chunks, question, client = setup
    strategy = SmartChunkStrategy.build(documents, chunks, client, SmartChunkConfig(), ANSWER)
    with pytest.raises(RequestRefused, match=r"SmartChunk's plan or retrieval .*\(HTTP 4\d\d\)"):
        strategy.answer(question.question, client.fork(), scope=[question.metadata["doc_id"]])


def test_arag_raises_on_the_refused_agent_request(setup):
    _, chunks, question, client = setup
    strategy = ARagStrategy.build(chunks, client, ARagConfig())
    own = client.fork()
    with pytest.raises(RequestRefused, match=r"A-RAG's agent or its tools .*\(HTTP 4\d\d\)"):
        strategy.answer(question.question, own)
    assert own.stats.roles["generator"].requests == 1  # asked once, not retried turn after turn
