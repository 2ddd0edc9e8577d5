"""Document scope: a QASPER question is answered from its own paper only, by the naive strategy, SmartChunk,
LATTICE and A-RAG over the six shipped QASPER papers with the real built-in models (SmolLM2-135M generating and
planning, MiniLM embedding, an untrained MiniLM cross-encoder scoring LATTICE's slates); the same question over the
open corpus still searches every paper. FABLE and Orion-RAG have their scope tests beside their own fixtures
(test_fable.py, test_orion.py): their indexes take an LLM pass over every paper to build."""

from __future__ import annotations

from pathlib import Path

import pytest

from overstory.core.config import ConfigError
from overstory.core.records import Chunk, level_range
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies, chunks_at_levels
from overstory.models.registry import MINILM, SMOLLM2
from overstory.retrieval.answer import AnswerConfig
from overstory.retrieval.arag import ARagConfig, ARagStrategy
from overstory.retrieval.lattice.keywords import fallback_keywords
from overstory.retrieval.lattice.search import SearchConfig
from overstory.retrieval.lattice.strategy import LatticeStrategy, LatticeStrategyConfig
from overstory.retrieval.lattice.top_down import TopDownBuilder
from overstory.retrieval.lattice.tree import Node
from overstory.retrieval.naive import NaiveConfig, NaiveStrategy
from overstory.retrieval.smartchunk import SmartChunkConfig, SmartChunkStrategy
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.in_process import in_process_client
from tests.serving.cross_encoder_fixture import build_tiny_cross_encoder

ROOT = Path(__file__).resolve().parents[2]
# each answer reads the first 300 characters of its 3 passages (the default 1,500 made its prompt about 1,100 tokens):
# these tests check the chunks each strategy retrieved, which the answer settings do not change
ANSWER = AnswerConfig(max_tokens=16, max_chunk_chars=300)
# generic questions any of the six papers could answer: over the open corpus some of their evidence comes from
# other papers, which is the point of the scope
GENERIC = ("Which dataset do they evaluate on?", "What supervised machine learning models do they use?")


@pytest.fixture(scope="module")
def qasper():
    """The six shipped QASPER dev papers, their hierarchy and the generic questions (each about one paper)."""
    documents, questions = load_corpus(CorpusConfig("qasper", str(ROOT / "data/qasper/dev.json")))
    generic = [q for q in questions if q.question in GENERIC]
    assert len(generic) == len(GENERIC) and len({q.metadata["doc_id"] for q in generic}) == len(GENERIC)
    return documents, build_hierarchies(documents, HierarchyConfig()), generic


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    scorer = build_tiny_cross_encoder(tmp_path_factory.mktemp("scorer") / "ce")
    with EmbeddedEngine(ServeConfig(port=0, roles={
            "generator": RoleConfig(model=SMOLLM2), "planner": RoleConfig(model=SMOLLM2),
            "embedder": RoleConfig(model=MINILM, kind="embedding"),
            "scorer": RoleConfig(model=scorer, kind="cross-encoder")})) as engine:
        yield in_process_client(engine)


def scoped_and_open(strategy, questions, client) -> list[tuple[str, list[Chunk], list[Chunk]]]:
    """Per question: its paper, the evidence of the scoped answer and of the open-corpus one; every answer given."""
    out = []
    for question in questions:
        paper = question.metadata["doc_id"]
        scoped = strategy.answer(question.question, client.fork(), scope=[paper])
        opened = strategy.answer(question.question, client.fork())
        for answer in (scoped, opened):
            assert answer.failure in ("", "no_answer"), (answer.failure, answer.failure_detail)
            assert answer.raw or answer.failure == "no_answer"
        out.append((paper, scoped.evidence, opened.evidence))
    return out


def assert_scope_kept(results, k: int | None = None) -> None:
    """Every scoped answer's evidence is from the question's paper (and there is some); over the open corpus some
    question's top ``k`` evidence comes from another paper."""
    for paper, scoped, _ in results:
        assert scoped and {c.doc_id for c in scoped} == {paper}, (paper, {c.doc_id for c in scoped})
    assert any({c.doc_id for c in opened[:k]} - {paper} for paper, _, opened in results)


def test_naive(qasper, client):
    _, chunks, questions = qasper
    strategy = NaiveStrategy.build(chunks, client, NaiveConfig(k=5), ANSWER)
    results = scoped_and_open(strategy, questions, client)
    assert_scope_kept(results)
    for (_, scoped, opened), question in zip(results, questions):
        assert len(scoped) == 5
        # the open answer is the corpus search as it was before scopes existed
        corpus = strategy.index.search([question.question], 5, embed=lambda t: client.embed("embedder", t))[0]
        assert [c.id for c in opened] == [h.chunk.id for h in corpus]


def test_smartchunk_plans_on_the_questions_paper(qasper, client):
    documents, chunks, questions = qasper
    strategy = SmartChunkStrategy.build(documents, chunks, client, SmartChunkConfig(planner_max_tokens=64), ANSWER)
    for question in questions:
        paper = question.metadata["doc_id"]
        own = client.fork()
        answer = strategy.answer(question.question, own, scope=[paper])
        assert answer.failure == "" and answer.details["planner_document"] == paper
        assert answer.evidence and {c.doc_id for c in answer.evidence} == {paper}
        low, high = answer.details["plan"]
        assert {c.level for c in answer.evidence} <= set(level_range(low, high))
        # the planner read the named paper: no embedding request went to guessing it (only the range search's)
        assert own.stats.roles["planner"].requests == 1 and own.stats.roles["embedder"].requests == 1
    opened = [strategy.answer(q.question, client.fork()) for q in questions]
    assert all(a.failure == "" for a in opened)
    assert any({c.doc_id for c in a.evidence} - {q.metadata["doc_id"]} for a, q in zip(opened, questions))
    with pytest.raises(ConfigError, match="qasper/none are not in the corpus"):
        strategy.answer(questions[0].question, client.fork(), scope=["qasper/none"])


def test_lattice_searches_the_papers_leaves(qasper, client):
    """A tree over all six papers' paragraphs (k-means on MiniLM, no LLM: token_budget=0), searched whole and cut to
    one paper."""
    _, chunks, questions = qasper
    paragraphs = chunks_at_levels(chunks, ["paragraph"])
    leaves = [Node(c.id, leaf=True, text=c.text, doc_id=c.doc_id) for c in paragraphs]
    builder = TopDownBuilder(client=None, embed=lambda texts: client.embed("embedder", texts), m_max=6,
                             token_budget=0)
    tree = builder.build(leaves, {leaf.id: fallback_keywords(leaf.text) for leaf in leaves})
    depth = max(tree.depth(leaf.id) for leaf in tree.leaves())
    config = LatticeStrategyConfig(scorer="cross_encoder", search=SearchConfig(iterations=depth, top_k=10))
    strategy = LatticeStrategy(tree, paragraphs, config, ANSWER)
    results = scoped_and_open(strategy, questions, client)
    assert_scope_kept(results)
    cut = strategy.tree_for([questions[0].metadata["doc_id"]])
    assert strategy.tree_for([questions[0].metadata["doc_id"]]) is cut  # cut once per scope
    assert {n.doc_id for n in cut.leaves()} == {questions[0].metadata["doc_id"]}
    assert sum(1 for _ in cut.leaves()) == sum(c.doc_id == questions[0].metadata["doc_id"] for c in paragraphs)
    with pytest.raises(ConfigError, match="no leaf of the document"):
        strategy.answer(questions[0].question, client.fork(), scope=["qasper/none"])


def test_arag_tools_stay_in_the_paper(qasper, client):
    """The agent's searches and reads over one paper (two turns, the first a constrained tool call)."""
    _, chunks, questions = qasper
    strategy = ARagStrategy.build(chunks, client, ARagConfig(max_turns=2, max_tokens=64, max_context_tokens=6000,
                                                             first_tool_choice="required"))
    found = 0
    for question in questions:
        paper = question.metadata["doc_id"]
        answer = strategy.answer(question.question, client.fork(), scope=[paper])
        assert answer.details["calls"], answer.details  # the first turn called a tool
        assert {c.doc_id for c in answer.evidence} <= {paper}, answer.details["calls"]
        found += len(answer.evidence)
    assert found  # the agent's searches returned chunks, all of them from the question's paper
    paper = questions[0].metadata["doc_id"]
    wide = strategy.keyword_search(["dataset"], top_k=20)
    assert len({strategy.chunks[n].doc_id for n in wide.chunk_ids}) > 1  # the open corpus: every paper
    narrow = strategy.keyword_search(["dataset"], top_k=20, scope=[paper])
    assert narrow.chunk_ids and {strategy.chunks[n].doc_id for n in narrow.chunk_ids} == {paper}
    other = next(n for n in wide.chunk_ids if strategy.chunks[n].doc_id != paper)
    refused = strategy.read_chunk([other], scope=[paper])
    assert refused.chunk_ids == [] and "not in the document this question is about" in refused.text
