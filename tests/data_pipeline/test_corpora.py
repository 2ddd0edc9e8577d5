"""Every corpus loader on the shipped real samples, and clear errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_pipeline.corpora import CorpusConfig, CorpusError, load_corpus
from overstory.config import ConfigError

DATA = Path(__file__).resolve().parents[2] / "data"


def test_hotpotqa() -> None:
    documents, questions = load_corpus(CorpusConfig("hotpotqa", str(DATA / "hotpotqa")))
    assert len(documents) == 400 and len(questions) == 40
    docs = {d.id: d for d in documents}
    for q in questions:
        assert len(q.evidence) == 2 or q.metadata["type"] == "comparison"
        for span in q.evidence:
            assert (span.start, span.end) == (0, len(docs[span.doc_id].text))
        for doc_id, start, end in q.metadata["supporting_sentences"]:
            assert docs[doc_id].text[start:end].strip()
    raw = json.loads((DATA / "hotpotqa" / "corpus.json").read_text())
    title = next(iter(raw))
    doc = docs[f"hotpotqa:{title}"]
    assert [doc.text[s:e] for s, e in doc.metadata["sentence_spans"]] == raw[title]


def test_squad_answer_offsets_reproduce_answers() -> None:
    documents, questions = load_corpus(CorpusConfig("squad", str(DATA / "squad" / "dev-v2.0-articles.json")))
    assert [d.title for d in documents] == ["Normans", "Computational_complexity_theory", "Southern_California"]
    assert len(questions) == 950
    docs = {d.id: d for d in documents}
    answerable = [q for q in questions if q.answers]
    assert 0 < len(answerable) < len(questions)  # SQuAD 2.0 has unanswerable questions
    for q in answerable:
        span = q.evidence[0]
        assert docs[span.doc_id].text[span.start:span.end] in q.answers
    for q in questions:
        assert bool(q.answers) != q.metadata["is_impossible"]
    assert sum(len(d.metadata["paragraph_spans"]) for d in documents) == 126


def test_markdown_folder_records_headings() -> None:
    documents, questions = load_corpus(CorpusConfig("text", str(DATA / "markdown")))
    assert [d.id for d in documents] == ["levels.md", "serving.md"] and questions == []
    levels = documents[0]
    assert levels.title == "Chunk levels"
    assert [h[:2] for h in levels.metadata["headings"]] == [[1, "Chunk levels"], [2, "Small levels"],
                                                            [2, "Large levels"]]
    for _, title, start, end in levels.metadata["headings"]:
        assert title in levels.text[start:end]


def test_jsonl() -> None:
    documents, _ = load_corpus(CorpusConfig("jsonl", str(DATA / "jsonl" / "sample.jsonl")))
    assert len(documents) == 5 and documents[0].id == "normans-0" and documents[0].title == "Normans"


def test_limit_docs_drops_questions_about_dropped_documents() -> None:
    documents, questions = load_corpus(CorpusConfig("squad", str(DATA / "squad" / "dev-v2.0-articles.json"),
                                                    limit_docs=1))
    assert len(documents) == 1
    assert questions and all(s.doc_id == documents[0].id for q in questions for s in q.evidence)


def test_bad_input(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="not found"):
        load_corpus(CorpusConfig("squad", str(tmp_path / "missing.json")))
    bad = tmp_path / "bad.json"
    bad.write_text('{"data": [')
    with pytest.raises(CorpusError, match="bad.json is not valid JSON"):
        load_corpus(CorpusConfig("squad", str(bad)))
    bad.write_text('{"data": [{"title": "x"}]}')
    with pytest.raises(CorpusError, match=r"data\[0\]: missing field\(s\) paragraphs"):
        load_corpus(CorpusConfig("squad", str(bad)))
    lines = tmp_path / "docs.jsonl"
    lines.write_text('{"id": "a", "text": "fine"}\n{"id": "b", "text": "   "}\n{"id": "c"}\n')
    with pytest.raises(CorpusError, match="docs.jsonl:3: missing field"):
        load_corpus(CorpusConfig("jsonl", str(lines)))
    lines.write_text('{"id": "a", "text": "fine"}\n{"id": "b", "text": "   "}\n')
    documents, _ = load_corpus(CorpusConfig("jsonl", str(lines)))
    assert [d.id for d in documents] == ["a"]  # the empty document is skipped with a warning
    with pytest.raises(CorpusError, match="no .txt or .md files"):
        load_corpus(CorpusConfig("text", str(tmp_path)))
    with pytest.raises(ConfigError, match="limit_docs"):
        CorpusConfig("text", str(tmp_path), limit_docs=-1)
