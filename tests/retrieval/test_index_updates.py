"""Flat indexes that persist and update, on real HotpotQA documents cut by the harness's hierarchy code and embedded
by MiniLM: an added document is found, a removed one leaves nothing, nothing else changes, build(A) + add(B) ranks as
build(A + B), saves are atomic for a concurrent reader, and the manifest refuses another embedding model, setting or
format.

The embed function memoises MiniLM's vectors by text: MiniLM's float output for one text shifts in the last bits
with the batch it is padded in, and what these tests compare exactly is the index's bookkeeping, not the encoder's
batch invariance."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies, chunks_at_levels
from overstory.models.registry import MINILM, load_sentence_encoder
from overstory.retrieval.index import (
    BM25Index,
    DenseIndex,
    DocumentExistsError,
    HybridIndex,
    IndexMismatchError,
    UnknownDocumentError,
    load_index,
)
from overstory.retrieval.index_manifest import chunks_hash, current_version, read_versioned

ROOT = Path(__file__).resolve().parents[2]
KINDS = ["dense", "bm25", "hybrid"]
LEVELS = ["paragraph", "sentence"]  # several chunks per document, so the per-document rows matter


@pytest.fixture(scope="module")
def corpus():
    """(chunks of A, chunks of B, B's questions, A's questions): B is the gold documents of three questions,
    A the gold documents of nine others and six more pages."""
    documents, questions = load_corpus(CorpusConfig(kind="hotpotqa", path=str(ROOT / "data" / "hotpotqa")))
    b_questions, a_questions = questions[:3], questions[3:12]
    b_docs = {d for q in b_questions for d in q.gold_doc_ids}
    a_docs = {d for q in a_questions for d in q.gold_doc_ids} - b_docs
    a_docs |= set([d.id for d in documents if d.id not in b_docs | a_docs][:6])
    chosen = [d for d in documents if d.id in a_docs | b_docs]
    chunks = chunks_at_levels(build_hierarchies(chosen, HierarchyConfig()), LEVELS)
    return ([c for c in chunks if c.doc_id in a_docs], [c for c in chunks if c.doc_id in b_docs],
            b_questions, a_questions)


@pytest.fixture(scope="module")
def embed():
    encoder = load_sentence_encoder(MINILM)
    memo: dict[str, np.ndarray] = {}

    def encode(texts: list[str]) -> np.ndarray:
        missing = [t for t in dict.fromkeys(texts) if t not in memo]
        if missing:
            memo.update(zip(missing, encoder.encode(missing, batch_size=64)))
        return np.stack([memo[t] for t in texts])

    return encode


@pytest.fixture(scope="module")
def built(corpus, embed):
    """Each kind over A only (the members are shared: updates make new indexes and leave these untouched)."""
    a = corpus[0]
    dense, bm25 = DenseIndex.build(a, embed, embedding_model=MINILM), BM25Index.build(a)
    return {"dense": dense, "bm25": bm25, "hybrid": HybridIndex(dense, bm25)}


def _ranking(index, queries: list[str], k: int = 8, doc_ids=None) -> list[list[tuple[str, float]]]:
    return [[(h.chunk.id, h.score) for h in row] for row in index.search(queries, k, doc_ids=doc_ids)]


def _doc_ids(chunks) -> list[str]:
    return list(dict.fromkeys(c.doc_id for c in chunks))


@pytest.mark.parametrize("kind", KINDS)
def test_an_added_document_is_found_and_its_rows_are_right(built, corpus, kind: str) -> None:
    a, b, b_questions, _ = corpus
    index = built[kind].with_documents(b)
    assert [c.id for c in index.chunks] == [c.id for c in a + b]
    for question in b_questions:
        top = {h.chunk.doc_id for h in index.search([question.question], 5)[0]}
        assert top & set(question.gold_doc_ids), question.question
    for doc_id in _doc_ids(b):  # a scoped search finds exactly that document's chunks
        own = [c.id for c in b if c.doc_id == doc_id]
        assert sorted(h.chunk.id for h in index.search(["anything at all"], 999, doc_ids=[doc_id])[0]) == sorted(own)
    assert not {h.chunk.doc_id for row in built[kind].search([q.question for q in b_questions], 8) for h in row} \
        & set(_doc_ids(b))


@pytest.mark.parametrize("kind", KINDS)
def test_a_removed_document_leaves_nothing_and_nothing_else_changes(built, corpus, kind: str, tmp_path) -> None:
    """Add B then remove it: no chunk, row, vector or BM25 term of B is left, and the index equals the one never
    given B: chunks, vectors bit for bit, rankings and scores exactly, saved files byte for byte."""
    a, b, b_questions, a_questions = corpus
    before = built[kind]
    plus = before.with_documents(b)
    after = plus.without_documents(_doc_ids(b))
    assert after.chunks == before.chunks
    assert not set(_doc_ids(b)) & set(after.rows if kind != "hybrid" else after.dense.rows)
    assert after.search([q.question for q in b_questions], 5, doc_ids=_doc_ids(b)) == [[]] * len(b_questions)
    queries = [q.question for q in a_questions + b_questions]
    assert _ranking(after, queries) == _ranking(before, queries)
    if kind != "bm25":
        dense_before, dense_plus, dense_after = (i if kind == "dense" else i.dense for i in (before, plus, after))
        assert np.array_equal(dense_plus.embeddings[:len(a)], dense_before.embeddings)  # old rows untouched
        assert np.array_equal(dense_after.embeddings, dense_before.embeddings)
        # Dense scores do not depend on the rest of the corpus: a search over A's documents is unchanged by B.
        assert _ranking(dense_plus, queries, doc_ids=_doc_ids(a)) == _ranking(dense_before, queries)
    if kind != "dense":
        bm25_before, bm25_plus, bm25_after = (i if kind == "bm25" else i.bm25 for i in (before, plus, after))
        b_terms = set(bm25_plus.model.vocab_dict) - set(bm25_before.model.vocab_dict)
        assert b_terms and not b_terms & set(bm25_after.model.vocab_dict)
    before_files, after_files = before.save(tmp_path / "before"), after.save(tmp_path / "after")
    names = sorted(p.relative_to(before_files) for p in before_files.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(after_files) for p in after_files.rglob("*") if p.is_file())
    assert all((before_files / n).read_bytes() == (after_files / n).read_bytes() for n in names)


@pytest.mark.parametrize("kind", KINDS)
def test_building_then_adding_ranks_as_building_everything(built, corpus, embed, kind: str) -> None:
    a, b, b_questions, a_questions = corpus
    dense, bm25 = DenseIndex.build(a + b, embed), BM25Index.build(a + b)
    whole = {"dense": dense, "bm25": bm25, "hybrid": HybridIndex(dense, bm25)}[kind]
    updated = built[kind].with_documents(b)
    queries = [q.question for q in a_questions + b_questions]
    assert updated.chunks == whole.chunks
    assert _ranking(updated, queries) == _ranking(whole, queries)
    scope = [*b_questions[0].gold_doc_ids, *_doc_ids(a)[:5]]
    assert _ranking(updated, queries, doc_ids=scope) == _ranking(whole, queries, doc_ids=scope)


@pytest.mark.parametrize("kind", KINDS)
def test_updates_refuse_what_they_cannot_do_and_replace_when_asked(built, corpus, kind: str) -> None:
    a, b, _, _ = corpus
    index = built[kind].with_documents(b[:0])  # a copy to update in place
    first = a[0].doc_id
    with pytest.raises(DocumentExistsError, match=f"document '{first}'.*replace=True"):
        index.add_documents([c for c in a if c.doc_id == first])
    with pytest.raises(UnknownDocumentError, match="document 'hotpotqa/no-such-page'"):
        index.remove_documents([first, "hotpotqa/no-such-page"])
    with pytest.raises(ValueError, match="leave the index empty"):
        index.remove_documents(_doc_ids(a))
    with pytest.raises(TypeError, match="list of document ids"):
        index.remove_documents(first)
    assert index.chunks == built[kind].chunks  # every refusal left the index as it was
    old = [c for c in a if c.doc_id == first]
    new = [replace(old[0], id=f"{old[0].id}-v2", text="Zanzibar quokka orchestra.")]
    index.add_documents(new, replace=True)
    assert [c.id for c in index.chunks if c.doc_id == first] == [new[0].id]
    assert len(index.chunks) == len(a) - len(old) + 1
    assert index.search(["Zanzibar quokka orchestra"], 1)[0][0].chunk.id == new[0].id
    index.remove_documents([first])
    assert first not in {c.doc_id for c in index.chunks} and len(index.chunks) == len(a) - len(old)


def test_the_manifest_records_the_model_and_settings_and_refuses_others(built, corpus, embed, tmp_path) -> None:
    a = corpus[0]
    index = HybridIndex(built["dense"], built["bm25"], extra_settings={"levels": LEVELS})
    index.save(tmp_path / "hybrid")
    files = current_version(tmp_path / "hybrid")
    manifest = json.loads((files / "manifest.json").read_text())
    assert manifest == {"format_version": 1, "kind": "hybrid", "corpus_hash": chunks_hash(a), "n_chunks": len(a),
                        "n_documents": len(_doc_ids(a)), "embedding_model": MINILM,
                        "settings": {"rrf_k": 60, "depth": 50, "backend": "numpy", "k1": 1.5, "b": 0.75,
                                     "levels": LEVELS}}
    loaded = load_index(tmp_path / "hybrid", embed, embedding_model=MINILM, settings={"levels": LEVELS, "k1": 1.5})
    assert loaded.embedding_model == MINILM and loaded.extra_settings == {"levels": LEVELS}
    with pytest.raises(IndexMismatchError, match=f"embedding_model is '{MINILM}' .* embeds with 'builtin:e5-small'"):
        load_index(tmp_path / "hybrid", embed, embedding_model="builtin:e5-small")
    with pytest.raises(IndexMismatchError, match=r"setting 'levels' is \['paragraph', 'sentence'\] .* \['paragraph'\]"):
        load_index(tmp_path / "hybrid", embed, settings={"levels": ["paragraph"]})
    with pytest.raises(IndexMismatchError, match="setting 'k1' is 1.5 .* asks for 1.2"):
        load_index(tmp_path / "hybrid", embed, settings={"k1": 1.2})
    (files / "manifest.json").write_text(json.dumps({**manifest, "format_version": 2}))
    with pytest.raises(IndexMismatchError, match="format_version is 2 .* reads 1"):
        load_index(tmp_path / "hybrid", embed)
    (files / "manifest.json").write_text(json.dumps({**manifest, "corpus_hash": chunks_hash(a[1:])}))
    with pytest.raises(IndexMismatchError, match="corpus_hash .* altered"):
        load_index(tmp_path / "hybrid", embed)


def test_a_folder_without_manifest_loads_with_a_warning_and_a_save_upgrades_it(built, embed, tmp_path) -> None:
    """The layout before manifests (the index's files directly in the folder) still loads, with a warning."""
    legacy = tmp_path / "legacy"
    built["dense"]._write(legacy)
    with pytest.warns(UserWarning, match="no manifest"):
        loaded = load_index(legacy, embed, embedding_model="builtin:e5-small")  # unknown: nothing to check
    assert loaded.chunks == built["dense"].chunks and np.array_equal(loaded.embeddings, built["dense"].embeddings)
    loaded.save(legacy)
    assert sorted(p.name for p in legacy.iterdir()) == ["current", current_version(legacy).name]
    assert load_index(legacy, embed).chunks == built["dense"].chunks


def test_a_reader_during_saves_sees_the_old_or_the_new_index(built, corpus, embed, tmp_path) -> None:
    """A thread loads the folder over and over while the main thread saves two different indexes into it in turn:
    every load is one whole index (its chunk count, corpus hash, vectors and BM25 model agree with its manifest,
    which load_index checks, and with one of the two), never a mix and never a failure."""
    small, big = built["hybrid"], built["hybrid"].with_documents(corpus[1])
    signatures = {(len(i.chunks), chunks_hash(i.chunks)) for i in (small, big)}
    folder = tmp_path / "index"
    small.save(folder)
    seen, errors, stop = [], [], threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                index = load_index(folder, embed)
            except Exception as exc:  # noqa: BLE001 - any failure is what this test counts
                errors.append(repr(exc))
                continue
            assert len(index.dense.embeddings) == index.bm25.model.scores["num_docs"] == len(index.chunks)
            seen.append((len(index.chunks), chunks_hash(index.chunks)))

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(30):
        (big if i % 2 == 0 else small).save(folder)
    stop.set()
    reader.join()
    assert errors == [] and seen and set(seen) <= signatures
    assert len([p for p in folder.iterdir() if p.name.startswith("v-")]) == 2  # the newest and the one before


def test_a_reader_slower_than_two_saves_reads_again(built, corpus, tmp_path) -> None:
    """The version a reader resolved is removed by the second save after it; the reader then reads the newest."""
    folder = tmp_path / "index"
    built["bm25"].save(folder)
    big = built["bm25"].with_documents(corpus[1])
    calls: list[Path] = []

    def slow_read(files: Path, versioned: bool) -> int:
        calls.append(files)
        if len(calls) == 1:  # two saves land after this reader resolved `current`
            big.save(folder)
            big.save(folder)
        return BM25Index._read(files, None, None).model.scores["num_docs"]

    assert read_versioned(folder, slow_read) == len(big.chunks)
    assert len(calls) == 2 and not calls[0].exists()
