"""Every corpus loader on the shipped real samples, and clear errors for bad input."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import get_args

import pytest

from overstory.core.config import ConfigError
from overstory.data_pipeline.corpora import LOADERS, CorpusConfig, CorpusError, CorpusKind, load_corpus

DATA = Path(__file__).resolve().parents[2] / "data"
SQUAD = DATA / "squad" / "dev-v2.0-articles.json"


def test_hotpotqa() -> None:
    documents, questions = load_corpus("hotpotqa", DATA / "hotpotqa")
    assert len(documents) == 400 and len(questions) == 40
    assert len({d.id for d in documents}) == 400 and all(d.id.startswith("hotpotqa/") for d in documents)
    docs = {d.id: d for d in documents}
    raw_questions = {q["_id"]: q for q in json.loads((DATA / "hotpotqa" / "questions.json").read_text())}
    for q in questions:
        gold_titles = {title for title, _ in raw_questions[q.id]["supporting_facts"]}
        assert {docs[s.doc_id].title for s in q.evidence} == gold_titles  # evidence docs exist and are gold
        assert q.answers == [raw_questions[q.id]["answer"]] and q.metadata["type"] in ("bridge", "comparison")
        for span in q.evidence:
            assert (span.start, span.end) == (0, len(docs[span.doc_id].text))
        assert len(q.metadata["supporting_sentences"]) == len(raw_questions[q.id]["supporting_facts"])
        for doc_id, start, end in q.metadata["supporting_sentences"]:
            assert docs[doc_id].text[start:end].strip()
    corpus = json.loads((DATA / "hotpotqa" / "corpus.json").read_text())
    by_title = {d.title: d for d in documents}
    for title, sentences in corpus.items():  # "".join(sentences) is the paragraph; spans give them back
        doc = by_title[title]
        assert doc.text == "".join(sentences)
        assert [doc.text[s:e] for s, e in doc.metadata["sentence_spans"]] == sentences


def test_hotpotqa_context_titles_missing_from_corpus_are_added(tmp_path: Path) -> None:
    questions = json.loads((DATA / "hotpotqa" / "questions.json").read_text())[:1]
    (tmp_path / "questions.json").write_text(json.dumps(questions))
    documents, loaded = load_corpus("hotpotqa", tmp_path)  # no corpus.json: all from the context
    assert len(documents) == len(questions[0]["context"]) and len(loaded[0].evidence) >= 1


def test_squad_answer_offsets_reproduce_answers() -> None:
    documents, questions = load_corpus(CorpusConfig("squad", str(SQUAD)))
    assert [d.title for d in documents] == ["Normans", "Computational_complexity_theory", "Southern_California"]
    assert [d.id for d in documents] == ["squad/normans", "squad/computational-complexity-theory",
                                         "squad/southern-california"]
    assert len(questions) == 950
    docs = {d.id: d for d in documents}
    raw = {qa["id"]: qa for article in json.loads(SQUAD.read_text())["data"]
           for paragraph in article["paragraphs"] for qa in paragraph["qas"]}
    answerable = [q for q in questions if q.answers]
    assert 0 < len(answerable) < len(questions)  # SQuAD 2.0 has unanswerable questions
    for q in answerable:
        doc = docs[q.evidence[0].doc_id]
        assert doc.text[q.evidence[0].start:q.evidence[0].end] == raw[q.id]["answers"][0]["text"]
        para_start, para_end = doc.metadata["paragraph_spans"][q.metadata["paragraph"]]
        paragraph = doc.text[para_start:para_end]
        for answer in raw[q.id]["answers"]:  # every answer, shifted by its paragraph, reproduces its text
            start = para_start + answer["answer_start"]
            assert doc.text[start:start + len(answer["text"])] == answer["text"] and answer["text"] in paragraph
        assert q.answers == list(dict.fromkeys(a["text"] for a in raw[q.id]["answers"]))
    for q in questions:
        assert bool(q.answers) != q.metadata["is_impossible"] and bool(q.evidence) == bool(q.answers)
    assert sum(len(d.metadata["paragraph_spans"]) for d in documents) == 126
    for doc in documents:
        spans = doc.metadata["paragraph_spans"]
        assert "\n\n".join(doc.text[s:e] for s, e in spans) == doc.text


def test_markdown_folder_records_headings() -> None:
    documents, questions = load_corpus("text", DATA / "markdown")
    assert [d.id for d in documents] == ["levels.md", "serving.md"] and questions == []
    levels = documents[0]
    assert levels.title == "Chunk levels"
    assert [h[:2] for h in levels.metadata["headings"]] == [[1, "Chunk levels"], [2, "Small levels"],
                                                            [2, "Large levels"]]
    for depth, title, start, end in levels.metadata["headings"]:
        assert levels.text[start:end] == "#" * depth + " " + title


def test_text_folder_recursive_txt_and_code_fences(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "b.md").write_text("# Setup\n\n```sh\n# not a heading\npip install x\n```\n")
    (tmp_path / "a.txt").write_text("# plain text, not markdown\n\nSecond paragraph.\n")
    (tmp_path / "skip.rst").write_text("ignored")
    documents, _ = load_corpus("text", tmp_path)
    assert [d.id for d in documents] == ["a.txt", "notes/b.md"]
    assert documents[0].title == "a" and "headings" not in documents[0].metadata
    assert [h[1] for h in documents[1].metadata["headings"]] == ["Setup"]


def test_jsonl() -> None:
    documents, questions = load_corpus(CorpusConfig("jsonl", str(DATA / "jsonl" / "sample.jsonl")))
    assert len(documents) == 5 and documents[0].id == "normans-0" and documents[0].title == "Normans"
    assert questions == [] and all(d.text.strip() for d in documents)


def test_limit_docs_keeps_questions_about_kept_documents() -> None:
    documents, questions = load_corpus(CorpusConfig("squad", str(SQUAD), limit_docs=1))
    assert len(documents) == 1
    assert any(q.metadata["is_impossible"] for q in questions)  # unanswerable ones stay with their article
    assert all(q.metadata["doc_id"] == documents[0].id for q in questions)
    assert all(s.doc_id == documents[0].id for q in questions for s in q.evidence)
    documents, questions = load_corpus("hotpotqa", DATA / "hotpotqa", limit_docs=50)
    kept = {d.id for d in documents}
    assert len(documents) == 50 and all(set(q.gold_doc_ids) <= kept for q in questions)


def test_every_config_kind_has_a_loader() -> None:
    assert set(get_args(CorpusKind)) == set(LOADERS)


def test_bad_input(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(CorpusError, match="not found"):
        load_corpus("squad", tmp_path / "missing.json")
    with pytest.raises(CorpusError, match="unknown corpus kind 'wiki'; kinds are hotpotqa, squad, text, jsonl, "
                                          "qasper, narrativeqa"):
        load_corpus("wiki", tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"data": [')
    with pytest.raises(CorpusError, match="bad.json is not valid JSON"):
        load_corpus("squad", bad)
    bad.write_text('{"data": [{"title": "x"}]}')
    with pytest.raises(CorpusError, match=r"data\[0\]: missing field\(s\) paragraphs"):
        load_corpus("squad", bad)
    bad.write_text(json.dumps({"data": [{"title": "x", "paragraphs": [{"context": "Paris is big.", "qas": [
        {"id": "q", "question": "?", "answers": [{"text": "Paris", "answer_start": 3}]}]}]}]}))
    with pytest.raises(CorpusError, match="question q: answer_start 3 does not point at 'Paris'"):
        load_corpus("squad", bad)

    (tmp_path / "questions.json").write_text(json.dumps([{"_id": "a", "question": "?", "answer": "x",
                                                          "supporting_facts": [], "context": [["T", "oops"]]}]))
    with pytest.raises(CorpusError, match=r"question 0: context entries must be \[title, \[sentences\]\]"):
        load_corpus("hotpotqa", tmp_path)
    (tmp_path / "questions.json").write_text("[]")
    (tmp_path / "corpus.json").write_text('["not", "a", "mapping"]')
    with pytest.raises(CorpusError, match="corpus.json: expected a mapping title -> sentences"):
        load_corpus("hotpotqa", tmp_path)

    lines = tmp_path / "docs.jsonl"
    lines.write_text('{"id": "a", "text": "fine"}\n{"id": "b", "text": "   "}\n{"id": "c"}\n')
    with pytest.raises(CorpusError, match="docs.jsonl:3: missing field"):
        load_corpus("jsonl", lines)
    lines.write_text('{"id": "a", "text": "fine"}\n{"id": "a", "text": "again"}\n')
    with pytest.raises(CorpusError, match="docs.jsonl:2: duplicate document id 'a'"):
        load_corpus("jsonl", lines)
    lines.write_text('{"id": "a", "text": "fine"}\n{"id": "b", "text": "   "}\n')
    with caplog.at_level(logging.WARNING):
        documents, _ = load_corpus("jsonl", lines)
    assert [d.id for d in documents] == ["a"] and "'b' has empty text; skipped" in caplog.text

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CorpusError, match="no .txt or .md files"):
        load_corpus("text", empty)
    with pytest.raises(ConfigError, match="limit_docs"):
        CorpusConfig("text", str(tmp_path), limit_docs=-1)
