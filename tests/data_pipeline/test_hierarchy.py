"""Hierarchy invariants on the real SQuAD articles, markdown structure, ids and round trips."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from overstory.core.config import ConfigError
from overstory.core.records import LEVEL_RANK, LEVELS, Document, level_range
from overstory.data_pipeline.corpora import load_corpus
from overstory.data_pipeline.hierarchy import (
    HierarchyConfig,
    build_hierarchies,
    build_hierarchy,
    chunks_at_levels,
    load_hierarchies,
    save_hierarchies,
)

DATA = Path(__file__).resolve().parents[2] / "data"
SQUAD = DATA / "squad" / "dev-v2.0-articles.json"
CFG = HierarchyConfig()


@pytest.fixture(scope="module")
def squad(tokenizer):
    documents, _ = load_corpus("squad", SQUAD)
    return documents, build_hierarchies(documents, CFG)


def _squash(text: str) -> str:
    return "".join(text.split())


def test_offsets_reproduce_the_text(squad) -> None:
    documents, chunks = squad
    docs = {d.id: d for d in documents}
    for c in chunks:
        assert docs[c.doc_id].text[c.start:c.end] == c.text
        assert c.text == c.text.strip() and c.n_tokens > 0 and c.title == docs[c.doc_id].title


def test_token_counts_come_from_the_tokenizer(squad, tokenizer) -> None:
    _, chunks = squad
    for c in chunks[::50]:
        assert c.n_tokens == len(tokenizer(c.text, add_special_tokens=False)["input_ids"])


def test_every_sentence_under_exactly_one_paragraph(squad) -> None:
    _, chunks = squad
    by_id = {c.id: c for c in chunks}
    listed = Counter(child for c in chunks if c.level == "paragraph" for child in c.children)
    sentences = [c for c in chunks if c.level == "sentence"]
    assert set(listed) == {s.id for s in sentences} and set(listed.values()) == {1}
    for s in sentences:
        assert by_id[s.parent].level == "paragraph" and s.id in by_id[s.parent].children
    paragraphs = chunks_at_levels(chunks, "paragraph")
    for p in paragraphs:  # sentences tile their paragraph
        assert _squash("".join(by_id[k].text for k in p.children)) == _squash(p.text)
    assert len(sentences) > 3 * len(paragraphs)  # pysbd really split: about 5 sentences per paragraph


def test_levels_nest(squad) -> None:
    documents, chunks = squad
    by_id = {c.id: c for c in chunks}
    assert Counter(c.level for c in chunks)["document"] == len(documents)
    for doc in documents:  # every level exists for every document
        assert {c.level for c in chunks if c.doc_id == doc.id} == set(LEVELS)
    for c in chunks:
        if c.parent is None:
            assert c.level == "document" and c.id == f"{c.doc_id}#doc"
            continue
        parent = by_id[c.parent]
        assert LEVEL_RANK[parent.level] == LEVEL_RANK[c.level] + 1 and c.id in parent.children
        assert parent.start <= c.start < c.end <= parent.end and parent.doc_id == c.doc_id
    for c in chunks:  # children exist, are in text order and do not overlap
        kids = [by_id[k] for k in c.children]
        assert all(a.end <= b.start for a, b in zip(kids, kids[1:]))
        assert bool(kids) == (c.level != "sentence")


def test_paragraphs_are_the_squad_paragraphs(squad) -> None:
    documents, chunks = squad
    paragraphs = chunks_at_levels(chunks, "paragraph")
    assert len(paragraphs) == 126
    spans = [tuple(s) for d in documents for s in d.metadata["paragraph_spans"]]
    assert [(c.start, c.end) for c in paragraphs] == spans


def test_grouped_levels_respect_budgets(squad) -> None:
    documents, chunks = squad
    for level, budget in (("subsection", CFG.subsection_tokens), ("section", CFG.section_tokens)):
        groups = chunks_at_levels(chunks, level)
        assert all(c.n_tokens <= budget or len(c.children) == 1 for c in groups)
        assert any(len(c.children) > 1 for c in groups)  # grouping happened
    smaller = build_hierarchies(documents, HierarchyConfig(subsection_tokens=128, section_tokens=512))
    assert len(chunks_at_levels(smaller, "section")) > len(chunks_at_levels(chunks, "section"))
    assert all(c.n_tokens <= 128 or len(c.children) == 1 for c in chunks_at_levels(smaller, "subsection"))


def test_one_paragraph_document_has_every_level(tokenizer) -> None:
    doc = Document("tiny", "Tiny", "  One sentence here. And a second one.\n")
    chunks = build_hierarchy(doc, tokenizer, CFG)
    assert Counter(c.level for c in chunks) == {"document": 1, "section": 1, "subsection": 1, "paragraph": 1,
                                                "sentence": 2}
    assert [c.id for c in chunks] == ["tiny#doc", "tiny#sec0", "tiny#ss0", "tiny#p0", "tiny#s0", "tiny#s1"]
    assert chunks[0].text == "One sentence here. And a second one."


def test_ids_are_deterministic_and_round_trip(squad, tmp_path: Path) -> None:
    documents, chunks = squad
    again = build_hierarchies(documents, CFG)
    assert again == chunks
    assert len({c.id for c in chunks}) == len(chunks)
    assert chunks_at_levels(chunks, "paragraph")[3].id == "squad/normans#p3"
    assert save_hierarchies(tmp_path / "h.jsonl", chunks) == len(chunks)
    assert load_hierarchies(tmp_path / "h.jsonl") == chunks


def test_markdown_headings_become_sections(tokenizer) -> None:
    documents, _ = load_corpus("text", DATA / "markdown")
    chunks = build_hierarchy(documents[0], tokenizer, CFG)
    sections = chunks_at_levels(chunks, "section")
    subsections = chunks_at_levels(chunks, "subsection")
    assert len(sections) == 1 and sections[0].text.startswith("# Chunk levels")
    # the paragraph before the first "##" forms its own subsection
    assert [s.text.splitlines()[0] for s in subsections[1:]] == ["## Small levels", "## Large levels"]
    assert all(not c.text.startswith("#") for c in chunks_at_levels(chunks, ["paragraph", "sentence"]))


def test_markdown_sections_at_other_depths(tokenizer) -> None:
    text = "Preamble line.\n\n## One\n\nAlpha text.\n\n### One.a\n\nBeta text.\n\n## Two\n\nGamma text.\n"
    doc = Document("d.md", "d", text, {"headings": [[2, "One", 16, 22], [3, "One.a", 37, 46], [2, "Two", 60, 66]]})
    assert [text[s:e] for _, _, s, e in doc.metadata["headings"]] == ["## One", "### One.a", "## Two"]
    chunks = build_hierarchy(doc, tokenizer, CFG)
    assert [c.text.splitlines()[0] for c in chunks_at_levels(chunks, "section")] == [
        "Preamble line.", "## One", "## Two"]
    assert [c.text for c in chunks_at_levels(chunks, "paragraph")] == [
        "Preamble line.", "Alpha text.", "Beta text.", "Gamma text."]
    assert [c.text.splitlines()[0] for c in chunks_at_levels(chunks, "subsection")] == [
        "Preamble line.", "Alpha text.", "### One.a", "Gamma text."]
    only_headings = Document("h.md", "h", "# Title\n## Sub\n", {"headings": [[1, "Title", 0, 7], [2, "Sub", 8, 14]]})
    assert len(chunks_at_levels(build_hierarchy(only_headings, tokenizer, CFG), "paragraph")) == 1


def test_hotpotqa_uses_its_own_sentence_split(tokenizer) -> None:
    documents, _ = load_corpus("hotpotqa", DATA / "hotpotqa", limit_docs=20)
    chunks = build_hierarchies(documents, CFG)
    sentences = chunks_at_levels(chunks, "sentence")
    expected = [doc.text[s:e].strip() for doc in documents for s, e in doc.metadata["sentence_spans"]]
    assert [c.text for c in sentences] == [t for t in expected if t]
    assert len(chunks_at_levels(chunks, "paragraph")) == 20  # a HotpotQA document is one paragraph


def test_errors(tokenizer) -> None:
    with pytest.raises(ValueError, match="empty text"):
        build_hierarchy(Document("x", "", "  \n"), tokenizer, CFG)
    with pytest.raises(ValueError, match="unknown level 'chapter'; levels are sentence, paragraph"):
        chunks_at_levels([], ["sentence", "chapter"])
    with pytest.raises(ValueError, match="unknown level 'chapter'"):
        level_range("sentence", "chapter")
    with pytest.raises(ValueError, match="larger than"):
        level_range("section", "sentence")
    with pytest.raises(ConfigError, match="hierarchy.section_tokens"):
        HierarchyConfig(subsection_tokens=512, section_tokens=256)
    with pytest.raises(ConfigError, match="hierarchy.subsection_tokens"):
        HierarchyConfig(subsection_tokens=0)
    with pytest.raises(ConfigError, match="hierarchy.tokenizer"):
        HierarchyConfig(tokenizer="")
