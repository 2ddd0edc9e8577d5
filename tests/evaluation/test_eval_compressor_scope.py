"""`overstory eval compressor`'s document scope on the shipped QASPER dev papers (real papers, real questions, MiniLM
served by the embedded engine): under ``scope: auto`` each question ranks only its own paper's sections, as
``eval pipeline`` searches them; under ``scope: corpus`` it ranks every paper's, and its top chunks come from several
papers. The sections are embedded as ``direct_encode`` embeds them (no LLM: the scope is what is under test)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from overstory.core.config import ConfigError, load_config
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.evaluation.compressor import EvalCompressorConfig, HeldOut, build_report, print_table, rank
from overstory.models.registry import MINILM
from overstory.retrieval.index import chunk_text_for_index
from overstory.retrieval.metrics import recall_at_k
from overstory.serving.client import Client
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.in_process import in_process_client

ROOT = Path(__file__).resolve().parents[2]
QASPER = CorpusConfig("qasper", str(ROOT / "data/qasper"), split="dev")
K = 5


@pytest.fixture(scope="module")
def embedder() -> Iterator[Client]:
    with EmbeddedEngine(ServeConfig(port=0, roles={"embedder": RoleConfig(model=MINILM, kind="embedding")})) as engine:
        yield in_process_client(engine)


@pytest.fixture(scope="module")
def held_out(embedder: Client) -> tuple[HeldOut, np.ndarray]:
    """The six dev papers' sections as the held-out upper-level chunks, the questions whose evidence lies in them,
    and the sections' direct_encode embeddings."""
    documents, questions = load_corpus(QASPER)
    chunks = {c.id: c for c in build_hierarchies(documents, HierarchyConfig())}
    upper = [c for c in chunks.values() if c.level == "section"]
    kept = [q for q in questions if q.evidence and {s.doc_id for s in q.evidence} <= {c.doc_id for c in upper}]
    data = HeldOut([], chunks, upper, [], [], np.zeros((len(upper), 384)), kept, len({c.doc_id for c in upper}))
    return data, embedder.embed("embedder", [chunk_text_for_index(c) for c in upper])


def config(scope: str, corpus: CorpusConfig = QASPER) -> EvalCompressorConfig:
    return EvalCompressorConfig(checkpoint="c", data="d.jsonl", corpus=corpus, out="o", k=K, scope=scope)


def test_under_scope_auto_a_qasper_question_ranks_its_own_papers_sections_only(held_out, embedder) -> None:
    data, vectors = held_out
    assert data.n_documents == 6 and len(data.questions) >= 10
    assert config("auto").scope_mode == "document"
    ranked = rank(data, vectors, embedder, K, config("auto").scope_mode)
    for question, hits in zip(data.questions, ranked):
        own = question.metadata["doc_id"]
        sections = sum(c.doc_id == own for c in data.upper)
        assert len(hits) == min(K, sections) and {h.chunk.doc_id for h in hits} == {own}, question.id


def test_under_scope_corpus_a_question_ranks_every_papers_sections(held_out, embedder) -> None:
    data, vectors = held_out
    corpus = rank(data, vectors, embedder, K, config("corpus").scope_mode)
    assert all(len(hits) == K for hits in corpus)
    foreign = Counter(h.chunk.doc_id for q, hits in zip(data.questions, corpus) for h in hits
                      if h.chunk.doc_id != q.metadata["doc_id"])
    assert len(foreign) >= 2  # other papers' sections reach the top-k (MiniLM ranks related papers' sections high)
    assert any(len({h.chunk.doc_id for h in hits}) > 1 for hits in corpus)
    # within its own paper a question's gold sections only move up: recall@k is never lower than over the corpus
    document = rank(data, vectors, embedder, K, "document")
    for question, own_hits, all_hits in zip(data.questions, document, corpus):
        assert recall_at_k([h.chunk for h in own_hits], question.evidence, K) >= \
            recall_at_k([h.chunk for h in all_hits], question.evidence, K), question.id


def test_the_scope_is_named_in_metrics_and_the_table(held_out, capsys) -> None:
    data, _ = held_out
    row = {"cosine_to_target": 0.5, f"recall@{K}": 0.5, f"recall@{K}_ci95": [0.4, 0.6], "seconds": 1.0,
           "llm_prompt_tokens": 0, "llm_completion_tokens": 0, "speedup_vs_summarize": 1.0, "repairs": {}}
    per_paper = Counter(c.doc_id for c in data.upper)
    for scope, mode, title in (("auto", "document", "qasper, document scope: each question searched within its own "
                                                    "document (of 6)"),
                               ("corpus", "corpus", "qasper, open corpus: every question searched over all 6 "
                                                    "documents")):
        report = build_report(config(scope), data, {"compressor": "c"}, {"compressor": "set-compressor"},
                              {"mean_pool": row})
        assert (report["dataset"], report["scope"], report["config"]["scope"]) == ("qasper", mode, scope)
        expected = len(data.upper) if mode == "corpus" else \
            np.mean([per_paper[q.metadata["doc_id"]] for q in data.questions])
        assert report["candidates_per_question"] == pytest.approx(expected)
        print_table(report, K)
        assert title in capsys.readouterr().out


def test_the_scope_setting_is_checked_and_the_configs_follow_the_dataset() -> None:
    with pytest.raises(ConfigError, match="scope: 'paper' is not a scope"):
        config("paper")
    with pytest.raises(ConfigError, match="scope: document needs questions that are each about one document"):
        config("document", CorpusConfig("hotpotqa", "data/hotpotqa"))
    assert config("auto", CorpusConfig("hotpotqa", "data/hotpotqa")).scope_mode == "corpus"
    for name in ("compressor.yaml", "compressor-qasper.yaml"):  # squad and qasper: each paper's own questions
        loaded = load_config(EvalCompressorConfig, ROOT / "configs/eval" / name, ["checkpoint=c", "data=d", "out=o"])
        assert (loaded.scope, loaded.scope_mode) == ("auto", "document"), name
