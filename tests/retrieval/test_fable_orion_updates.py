"""FABLE's forest and Orion-RAG's tags persist and update through ``Retriever``, on real HotpotQA documents with the
built-in models (SmolLM2-135M-Instruct builds the trees, writes the tags and selects; MiniLM embeds): a saved index
loads as it was and retrieves alike, an added document gets its own tree or tags (only its strings embedded) and is
found, and removing it leaves the index as it was before the add.

Orion's tags of the documents built over are the tagger's own fallback tags written as the tagging job writes them
(``fallback_master_tags``, ``fallback_paragraph_tags``): the strategy's indexing is what is tested here; the added
document is tagged by the served generator."""

from __future__ import annotations

import json

import numpy as np
import pytest

from overstory.core.records import write_jsonl
from overstory.data_pipeline.corpora import load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.evaluation.pipeline import DATASETS
from overstory.retrieval.api import Models, Retriever
from overstory.retrieval.index_manifest import current_version
from overstory.retrieval.orion.tagger import (
    ChunkingConfig,
    chunk_document,
    fallback_master_tags,
    fallback_paragraph_tags,
)
from overstory.retrieval.orion.tags import ChunkTags, DocumentTags

pytestmark = pytest.mark.slow
SETTINGS = HierarchyConfig()
CHUNKING = ChunkingConfig(chunk_chars=800)


@pytest.fixture(scope="module")
def models():
    with Models.builtin() as loaded:
        yield loaded


@pytest.fixture(scope="module")
def corpus():
    """(A's documents and hierarchy, B's, the question B answers): B is one gold document of the sample's first
    question, A three other documents."""
    documents, questions = load_corpus(DATASETS["hotpotqa"])
    question = questions[0]
    a_docs = [d for d in documents if d.id not in question.gold_doc_ids][:3]
    b_docs = [d for d in documents if d.id == question.gold_doc_ids[0]]
    return a_docs, build_hierarchies(a_docs, SETTINGS), b_docs, build_hierarchies(b_docs, SETTINGS), question


def _files(folder) -> dict[str, bytes]:
    version = current_version(folder)
    return {str(p.relative_to(version)): p.read_bytes() for p in sorted(version.rglob("*")) if p.is_file()}


def _vectors(folder) -> dict[str, np.ndarray]:
    with np.load(current_version(folder) / "index" / "vectors.npz") as stored:
        return dict(zip(stored["strings"].tolist(), stored["vectors"]))


def test_fable_saves_loads_adds_a_tree_and_drops_it(models, corpus, tmp_path) -> None:
    a_docs, a_chunks, b_docs, b_chunks, question = corpus
    config = {"mode": "docs", "max_tokens": 24}
    retriever = Retriever.build("fable", a_docs, a_chunks, models, config=config, settings=SETTINGS)
    retriever.save(tmp_path / "before")
    before = _files(tmp_path / "before")
    loaded = Retriever.load(tmp_path / "before", models, settings=SETTINGS)
    assert loaded.strategy.forest.ids == retriever.strategy.forest.ids
    assert [h.id for h in loaded.retrieve(question.question).evidence] == \
        [h.id for h in retriever.retrieve(question.question).evidence]

    retriever.add_documents(b_docs, b_chunks)
    forest = retriever.strategy.forest
    b_id = b_docs[0].id
    assert b_id in forest.roots and forest.ids[:len(loaded.strategy.forest.ids)] == loaded.strategy.forest.ids
    found = retriever.retrieve(question.question, scope=b_id)
    assert found.evidence and {h.doc_id for h in found.evidence} == {b_id}

    retriever.remove_documents([b_id])
    retriever.save(tmp_path / "after")
    after = _files(tmp_path / "after")
    assert sorted(after) == sorted(before) and all(after[p] == before[p] for p in before)


def _tags_folder(documents, folder) -> str:
    """An orion-tags out folder over ``documents``: fallback tags, and the job's settings file."""
    write_jsonl(folder / "masters.jsonl", [DocumentTags(d.id, d.title, fallback_master_tags(d.title, d.text, 5),
                                                        "fallback") for d in documents])
    write_jsonl(folder / "chunks.jsonl", [
        ChunkTags(c.id, c.doc_id, c.title, c.text, c.start, c.end, fallback_paragraph_tags(c.text, c.title),
                  "fallback") for d in documents for c in chunk_document(d, CHUNKING)])
    (folder / "chunks.settings.json").write_text(json.dumps(
        {"chunking": {"chunk_chars": CHUNKING.chunk_chars, "overlap_chars": 0},
         "tagging": {"max_attempts": 1, "max_tokens": 64}, "served": {"generator": "builtin:smollm2-135m-instruct"}}))
    return str(folder)


def test_orion_saves_loads_tags_an_added_document_and_drops_it(models, corpus, tmp_path) -> None:
    a_docs, a_chunks, b_docs, b_chunks, question = corpus
    config = {"tags": _tags_folder(a_docs, tmp_path), "rewrite_max": 0, "prune": False}
    retriever = Retriever.build("orion", a_docs, a_chunks, models, config=config, settings=SETTINGS)
    retriever.save(tmp_path / "before")
    before, before_vectors = _files(tmp_path / "before"), _vectors(tmp_path / "before")
    loaded = Retriever.load(tmp_path / "before", models)
    ranked = loaded.retrieve(question.question, k=3)
    assert loaded.index_cost.calls == 0 and ranked.cost.roles["embedder"]["calls"] == 1
    assert [(h.id, h.score) for h in ranked.evidence] == \
        [(h.id, h.score) for h in retriever.retrieve(question.question, k=3).evidence]

    retriever.add_documents(b_docs, b_chunks)
    strategy, b_id = retriever.strategy, b_docs[0].id
    windows = [c.id for c in chunk_document(b_docs[0], CHUNKING)]  # cut with the folder's recorded chunking
    assert [r.id for r in strategy.records if r.doc_id == b_id] == windows and b_id in strategy.masters
    assert strategy.embedded == 2 * len(windows)  # each new chunk's path and text, nothing else
    found = retriever.retrieve(question.question, k=3)
    assert b_id in {h.doc_id for h in found.evidence}

    retriever.remove_documents([b_id])
    retriever.save(tmp_path / "after")
    after, after_vectors = _files(tmp_path / "after"), _vectors(tmp_path / "after")
    assert sorted(after) == sorted(before)
    assert all(after[p] == before[p] for p in before if not p.endswith(".npz"))  # a zip stamps the time it is written
    assert list(after_vectors) == list(before_vectors)
    assert all(np.array_equal(after_vectors[s], before_vectors[s]) for s in before_vectors)
