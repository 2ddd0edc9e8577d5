"""Hierarchy invariants on the real SQuAD articles, markdown structure, ids and round trips."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from data_pipeline.corpora import CorpusConfig, load_corpus
from data_pipeline.formats import LEVEL_RANK, LEVELS, Document
from data_pipeline.hierarchy import (
    HierarchyConfig,
    build_hierarchies,
    build_hierarchy,
    cached_tokenizer,
    level_range,
    load_hierarchies,
    save_hierarchies,
)
from overstory.config import ConfigError

DATA = Path(__file__).resolve().parents[2] / "data"
CFG = HierarchyConfig()


@pytest.fixture(scope="module")
def squad():
    documents, _ = load_corpus(CorpusConfig("squad", str(DATA / "squad" / "dev-v2.0-articles.json")))
    return documents, build_hierarchies(documents, CFG)


def test_offsets_reproduce_the_text(squad) -> None:
    documents, chunks = squad
    docs = {d.id: d for d in documents}
    for c in chunks:
        assert docs[c.doc_id].text[c.start:c.end] == c.text
        assert c.text == c.text.strip() and c.n_tokens > 0


def test_every_sentence_under_exactly_one_paragraph(squad) -> None:
    _, chunks = squad
    by_id = {c.id: c for c in chunks}
    listed = Counter(child for c in chunks if c.level == "paragraph" for child in c.children)
    sentences = [c for c in chunks if c.level == "sentence"]
    assert set(listed) == {s.id for s in sentences} and set(listed.values()) == {1}
    for s in sentences:
        assert by_id[s.parent].level == "paragraph" and s.id in by_id[s.parent].children


def test_levels_nest(squad) -> None:
    documents, chunks = squad
    by_id = {c.id: c for c in chunks}
    assert Counter(c.level for c in chunks)["document"] == len(documents)
    assert {c.level for c in chunks} == set(LEVELS)
    for c in chunks:
        if c.parent is None:
            assert c.level == "document"
            continue
        parent = by_id[c.parent]
        assert LEVEL_RANK[parent.level] == LEVEL_RANK[c.level] + 1
        assert parent.start <= c.start < c.end <= parent.end and parent.doc_id == c.doc_id
    for c in chunks:  # siblings are in text order and do not overlap
        kids = [by_id[k] for k in c.children]
        assert all(a.end <= b.start for a, b in zip(kids, kids[1:]))


def test_paragraphs_are_the_squad_paragraphs(squad) -> None:
    documents, chunks = squad
    paragraphs = [c for c in chunks if c.level == "paragraph"]
    assert len(paragraphs) == 126
    spans = [tuple(s) for d in documents for s in d.metadata["paragraph_spans"]]
    assert sorted((c.start, c.end) for c in paragraphs) == sorted(spans)


def test_grouped_levels_respect_budgets(squad) -> None:
    _, chunks = squad
    by_id = {c.id: c for c in chunks}
    for level, budget in (("subsection", CFG.subsection_tokens), ("section", CFG.section_tokens)):
        for c in (c for c in chunks if c.level == level):
            total = sum(by_id[k].n_tokens for k in c.children) if level == "subsection" else \
                sum(by_id[p].n_tokens for k in c.children for p in by_id[k].children)
            assert total <= budget or len(c.children) == 1
    smaller = build_hierarchies(load_corpus(CorpusConfig("squad", str(DATA / "squad" / "dev-v2.0-articles.json")))[0],
                                HierarchyConfig(subsection_tokens=128, section_tokens=512))
    assert Counter(c.level for c in smaller)["section"] > Counter(c.level for c in chunks)["section"]


def test_ids_are_deterministic_and_round_trip(squad, tmp_path: Path) -> None:
    documents, chunks = squad
    again = build_hierarchies(documents, CFG)
    assert [c.id for c in again] == [c.id for c in chunks]
    assert len({c.id for c in chunks}) == len(chunks)
    save_hierarchies(tmp_path / "h.jsonl", chunks)
    assert load_hierarchies(tmp_path / "h.jsonl") == chunks


def test_markdown_headings_become_sections() -> None:
    documents, _ = load_corpus(CorpusConfig("text", str(DATA / "markdown")))
    chunks = build_hierarchy(documents[0], cached_tokenizer(CFG.tokenizer), CFG)
    sections = [c for c in chunks if c.level == "section"]
    subsections = [c for c in chunks if c.level == "subsection"]
    assert len(sections) == 1 and sections[0].text.startswith("# Chunk levels")
    assert [s.text.splitlines()[0] for s in subsections[1:]] == ["## Small levels", "## Large levels"]
    assert all(not c.text.startswith("#") for c in chunks if c.level == "paragraph")


def test_hotpotqa_uses_its_own_sentence_split() -> None:
    documents, _ = load_corpus(CorpusConfig("hotpotqa", str(DATA / "hotpotqa"), limit_docs=20))
    chunks = build_hierarchies(documents, CFG)
    assert Counter(c.level for c in chunks)["sentence"] == sum(len(d.metadata["sentence_spans"]) for d in documents)


def test_errors() -> None:
    with pytest.raises(ValueError, match="empty text"):
        build_hierarchy(Document("x", "", "  \n"), cached_tokenizer(CFG.tokenizer), CFG)
    with pytest.raises(ValueError, match="unknown level 'chapter'"):
        level_range("sentence", "chapter")
    with pytest.raises(ValueError, match="larger than"):
        level_range("section", "sentence")
    with pytest.raises(ConfigError, match="hierarchy.section_tokens"):
        HierarchyConfig(subsection_tokens=512, section_tokens=256)
