"""A ``Retriever`` that persists and updates (``save``, ``load``, ``add_documents``, ``remove_documents``) for naive and
SmartChunk on real HotpotQA documents, cut by the harness's hierarchy code and embedded by the built-in MiniLM (the
planner: the built-in SmolLM2-135M-Instruct): a loaded retriever answers as the saved one did; an added document is
found while it is there; adding then removing it leaves every saved file as it was, byte for byte; the refusals
name what is wrong (another compressor for SmartChunk's upper levels too); a reader during updates sees the old or
the new index, never a mix. What an add costs and what fell back during it: naive and SmartChunk, and FABLE's trees and
Orion-RAG's tags asked of SmolLM2-135M-Instruct with replies cut short."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from overstory.core.config import ConfigError
from overstory.data_pipeline.corpora import load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.evaluation.pipeline import DATASETS
from overstory.models.compressor import SetCompressor, SetCompressorConfig, save_checkpoint
from overstory.models.registry import MINILM
from overstory.retrieval.api import (
    DocumentExistsError,
    IndexMismatchError,
    Models,
    Retriever,
    UnknownDocumentError,
)
from overstory.retrieval.fable.builder import FALLBACK_KINDS, ForestConfig
from overstory.retrieval.fable.strategy import FableStrategy
from overstory.retrieval.index_manifest import current_version
from overstory.serving.config import RoleConfig, ServeConfig
from tests.retrieval.test_fable_orion_updates import _tags_folder

SETTINGS = HierarchyConfig()
CONFIGS = {"naive": {"index": "hybrid"}, "smartchunk": {"planner_max_tokens": 32}}


@pytest.fixture(scope="module")
def models():
    with Models.builtin() as loaded:
        yield loaded


@pytest.fixture(scope="module")
def corpus():
    """(documents of A, their chunks, documents of B, their chunks, a question whose gold documents are B): B is
    the gold pair of the sample's first question, A five other documents."""
    documents, questions = load_corpus(DATASETS["hotpotqa"])
    question = questions[0]
    b_ids = set(question.gold_doc_ids)
    a_docs = [d for d in documents if d.id not in b_ids][:5]
    b_docs = [d for d in documents if d.id in b_ids]
    return (a_docs, build_hierarchies(a_docs, SETTINGS), b_docs, build_hierarchies(b_docs, SETTINGS), question)


def _files(folder: Path) -> dict[str, bytes]:
    """Every file of the version ``current`` names, by its path inside that version."""
    version = current_version(folder)
    assert version is not None
    return {str(p.relative_to(version)): p.read_bytes() for p in sorted(version.rglob("*")) if p.is_file()}


def _ranking(retriever: Retriever, question: str, k: int = 5) -> list[tuple[str, float | None]]:
    found = retriever.retrieve(question, k=k)
    assert not found.failure, found.failure_detail
    return [(hit.id, hit.score) for hit in found.evidence]


@pytest.mark.parametrize("name", ["naive", "smartchunk"])
def test_a_loaded_retriever_retrieves_as_the_saved_one(models, corpus, name: str, tmp_path) -> None:
    a_docs, a_chunks, _, _, question = corpus
    built = Retriever.build(name, a_docs, a_chunks, models, config=CONFIGS[name], settings=SETTINGS)
    built.save(tmp_path / "index")
    manifest = json.loads((current_version(tmp_path / "index") / "manifest.json").read_text())
    assert manifest["strategy"] == name and manifest["embedding_model"] == models.served_model("embedder")
    assert manifest["settings"]["hierarchy"]["subsection_tokens"] == SETTINGS.subsection_tokens
    loaded = Retriever.load(tmp_path / "index", models, settings=SETTINGS)
    assert loaded.strategy_name == name and loaded.doc_ids == built.doc_ids == {d.id for d in a_docs}
    assert loaded.index_cost.calls == 0 < built.index_cost.roles["embedder"]["calls"]
    ranked = _ranking(loaded, question.question)
    assert ranked and [i for i, _ in ranked] == [i for i, _ in _ranking(built, question.question)]
    assert [s for _, s in ranked] == pytest.approx([s for _, s in _ranking(built, question.question)])


@pytest.mark.parametrize("name", ["naive", "smartchunk"])
def test_add_then_remove_finds_the_document_and_leaves_the_index_as_it_was(models, corpus, name: str,
                                                                           tmp_path) -> None:
    a_docs, a_chunks, b_docs, b_chunks, question = corpus
    retriever = Retriever.build(name, a_docs, a_chunks, models, config=CONFIGS[name], settings=SETTINGS)
    retriever.save(tmp_path / "before")
    before = _files(tmp_path / "before")
    assert not {hit.doc_id for hit in retriever.retrieve(question.question, k=5).evidence} & set(question.gold_doc_ids)

    cost = retriever.add_documents(b_docs, b_chunks)
    assert retriever.doc_ids == {d.id for d in a_docs + b_docs}
    # the add's cost: its embedding calls, and nothing else asked (no planner call, no fallback)
    assert set(cost.roles) == {"embedder"} and cost.roles["embedder"]["prompt_tokens"] > 0
    assert cost.calls == cost.roles["embedder"]["calls"] >= 1 and cost.fallbacks == {}
    found = retriever.retrieve(question.question, k=5)
    assert {hit.doc_id for hit in found.evidence} & set(question.gold_doc_ids), [h.doc_id for h in found.evidence]
    assert found.cost.roles["embedder"]["calls"] >= 1
    retriever.save(tmp_path / "added")
    added = _files(tmp_path / "added")
    assert added["index/chunks.jsonl"] != before["index/chunks.jsonl"]
    saved_b = Retriever.load(tmp_path / "added", models)
    assert {hit.doc_id for hit in saved_b.retrieve(question.question, k=5).evidence} & set(question.gold_doc_ids)

    retriever.remove_documents([d.id for d in b_docs])
    assert retriever.doc_ids == {d.id for d in a_docs}
    retriever.save(tmp_path / "after")
    after = _files(tmp_path / "after")
    assert sorted(after) == sorted(before)
    for path in before:
        assert after[path] == before[path], path
    assert not any(d.id in after["documents.jsonl"].decode() for d in b_docs)


def test_replace_swaps_a_documents_chunks_and_refusals_name_what_is_wrong(models, corpus, tmp_path) -> None:
    a_docs, a_chunks, b_docs, b_chunks, _ = corpus
    retriever = Retriever.build("naive", a_docs, a_chunks, models, config={"index": "bm25"}, settings=SETTINGS)
    with pytest.raises(DocumentExistsError, match=a_docs[0].id):
        retriever.add_documents(a_docs[:1], [c for c in a_chunks if c.doc_id == a_docs[0].id])
    edited = [{"id": a_docs[0].id, "title": a_docs[0].title, "text": "Zanzibarian quokkas sing."}]
    retriever.add_documents(edited, build_hierarchies([a_docs[0].__class__(**edited[0])], SETTINGS), replace=True)
    found = retriever.retrieve("Which quokkas sing?", k=1)
    assert found.evidence[0].doc_id == a_docs[0].id and "quokkas" in found.evidence[0].text
    assert sum(c.doc_id == a_docs[0].id for c in retriever.strategy.index.chunks) == 1
    with pytest.raises(UnknownDocumentError, match="hotpotqa/no-such-page"):
        retriever.remove_documents(["hotpotqa/no-such-page"])
    with pytest.raises(ConfigError, match="not among the documents"):
        retriever.add_documents(b_docs[:1], b_chunks)
    with pytest.raises(ValueError, match="empty"):
        retriever.remove_documents([d.id for d in a_docs])
    assert retriever.doc_ids == {d.id for d in a_docs}  # nothing changed by a refused update


def test_load_refuses_another_embedding_model_settings_or_index(models, corpus, tmp_path) -> None:
    a_docs, a_chunks, _, _, _ = corpus
    Retriever.build("naive", a_docs, a_chunks, models, settings=SETTINGS).save(tmp_path / "index")
    with pytest.raises(IndexMismatchError, match="subsection_tokens|hierarchy"):
        Retriever.load(tmp_path / "index", models, settings=HierarchyConfig(subsection_tokens=128))
    with pytest.raises(IndexMismatchError, match="'hybrid'.*'bm25'"):
        Retriever.load(tmp_path / "index", models, config={"index": "bm25"})
    with pytest.raises(IndexMismatchError, match="levels"):
        Retriever.load(tmp_path / "index", models, config={"levels": ["sentence"]})
    manifest_path = current_version(tmp_path / "index") / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "embedding_model": "builtin:another-embedder"}))
    with pytest.raises(IndexMismatchError, match="embedding_model is 'builtin:another-embedder'"):
        Retriever.load(tmp_path / "index", models)
    with pytest.raises(IndexMismatchError, match="no saved Retriever"):
        Retriever.load(tmp_path, models)
    floor = Retriever.build("bm25_floor", a_docs, a_chunks, models)
    with pytest.raises(ConfigError, match="naive, smartchunk"):
        floor.save(tmp_path / "floor")


def test_a_reader_during_updates_sees_the_old_or_the_new_index(models, corpus) -> None:
    a_docs, a_chunks, b_docs, b_chunks, question = corpus
    retriever = Retriever.build("naive", a_docs, a_chunks, models, config={"index": "bm25"})
    b_id, done, seen, errors = b_docs[0].id, threading.Event(), [], []

    def read() -> None:
        while not done.is_set():
            try:
                found = retriever.retrieve(question.question, k=3, scope=b_id)
            except ValueError:
                continue  # B is not held now: the scope is refused
            except Exception as exc:  # noqa: BLE001  # any other error is what this test looks for
                errors.append(repr(exc))
                return
            seen.append({hit.doc_id for hit in found.evidence})

    reader = threading.Thread(target=read)
    reader.start()
    for _ in range(15):
        retriever.add_documents(b_docs, b_chunks)
        retriever.remove_documents([d.id for d in b_docs])
    done.set()
    reader.join()
    assert not errors and all(docs == {b_id} for docs in seen)


def test_a_smartchunk_index_records_its_compressor_and_refuses_another(corpus, tmp_path) -> None:
    """``upper: compressor``: the index's manifest names the served compressor (an untrained set compressor over
    MiniLM, saved as `train compressor` saves one), and a load where another compressor made the saved vectors is
    refused naming both."""
    a_docs, a_chunks, _, _, _ = corpus
    checkpoint = save_checkpoint(SetCompressor(SetCompressorConfig(encoder=MINILM)), tmp_path / "compressor", {})
    serve = ServeConfig(port=0, roles={"embedder": RoleConfig(model=MINILM, kind="embedding"),
                                       "compressor": RoleConfig(model=str(checkpoint), kind="compression")})
    with Models.builtin(serve) as models:
        served = models.served_model("compressor")
        built = Retriever.build("smartchunk", a_docs, a_chunks, models, config={"upper": "compressor"},
                                settings=SETTINGS)
        assert built.index_cost.roles["compressor"]["calls"] >= 1
        built.save(tmp_path / "index")
        manifest_path = current_version(tmp_path / "index") / "index" / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        assert served and manifest["compressor_model"] == served
        assert manifest["embedding_model"] == models.served_model("embedder")
        assert Retriever.load(tmp_path / "index", models).doc_ids == built.doc_ids
        manifest_path.write_text(json.dumps({**manifest, "compressor_model": "another-compressor"}))
        with pytest.raises(IndexMismatchError, match=f"compressor_model is 'another-compressor' in the saved index "
                                                     f"but the served compressor is '{served}'"):
            Retriever.load(tmp_path / "index", models)


@pytest.mark.slow
def test_an_add_reports_the_llm_calls_and_fallbacks_of_fable_and_orion(models, corpus, tmp_path) -> None:
    """What an add cost and what fell back, checked against the strategies' own records. The forest's and the tags'
    settings cut every reply to 2 tokens, which no chunking, summary or tag reply fits (the real model's reply,
    unusable): FABLE's chunk and summary replies fall back (its internal nodes of source "fallback") and so do
    Orion-RAG's master and paragraph tags (its records of source "fallback"; one reply asked for each)."""
    a_docs, a_chunks, b_docs, b_chunks, _ = corpus
    a_doc, a_hierarchy = a_docs[:1], [c for c in a_chunks if c.doc_id == a_docs[0].id]
    b_doc, b_hierarchy = b_docs[:1], [c for c in b_chunks if c.doc_id == b_docs[0].id]
    cut = ForestConfig(segment_max_tokens=2, summary_max_tokens=2)
    built = FableStrategy.build(a_doc, a_hierarchy, models.client, forest=cut)
    internal = [n for n in built.forest.nodes.values() if n.kind != "leaf"]
    assert built.fallbacks["summary"] == len(internal) > 0  # what Retriever.build's index_cost reports
    built.forest.save(tmp_path / "forest.json")
    fable = Retriever.build("fable", a_doc, a_hierarchy, models, config={"mode": "docs"}, forest=str(tmp_path /
                                                                                                  "forest.json"))
    assert fable.index_cost.fallbacks == {}  # a forest read, none built
    cost = fable.add_documents(b_doc, b_hierarchy)
    added = [n for n in fable.strategy.forest.nodes.values() if n.doc_id == b_doc[0].id]
    internal = [n for n in added if n.kind != "leaf"]
    sentences = sum(c.level == "sentence" for c in b_hierarchy)
    assert set(cost.fallbacks) == set(FALLBACK_KINDS) and cost.fallbacks["group"] == 0
    assert cost.fallbacks["summary"] == sum(n.source == "fallback" for n in internal) == len(internal) > 0
    assert cost.fallbacks["chunk"] == int(sentences > 1)  # one chunking window; a single sentence needs no call
    assert cost.roles["generator"]["calls"] == len(internal) + cost.fallbacks["chunk"]
    assert cost.roles["embedder"]["calls"] >= 1

    tags = Path(_tags_folder(a_docs, tmp_path))
    recorded = json.loads((tags / "chunks.settings.json").read_text())
    (tags / "chunks.settings.json").write_text(json.dumps({**recorded, "tagging": {"max_attempts": 1,
                                                                                  "max_tokens": 2}}))
    orion = Retriever.build("orion", a_docs, a_chunks, models, settings=SETTINGS,
                            config={"tags": str(tags), "rewrite_max": 0, "prune": False})
    assert orion.index_cost.fallbacks == {}  # the tags were read, none written
    cost = orion.add_documents(b_doc, b_hierarchy)
    strategy = orion.strategy
    records = [r for r in strategy.records if r.doc_id == b_doc[0].id]
    assert strategy.masters[b_doc[0].id].source == "fallback" and records
    assert cost.fallbacks == {"master_tags": 1, "paragraph_tags": sum(r.source == "fallback" for r in records)}
    assert cost.fallbacks["paragraph_tags"] == len(records)
    assert cost.roles["generator"]["calls"] == 1 + len(records) and cost.roles["embedder"]["calls"] >= 1
