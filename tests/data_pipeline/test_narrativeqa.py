"""The NarrativeQA loader on the slice shipped in data/narrativeqa: paragraphs grouped under the word budget with
spans that reproduce the text, both reference answers, the set filter, the hub layout, and missing summaries."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from overstory.core.config import ConfigError
from overstory.data_pipeline import narrativeqa
from overstory.data_pipeline.corpora import CorpusConfig, CorpusError, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchy, chunks_at_levels
from overstory.data_pipeline.narrativeqa import LONG_SENTENCE_WORDS, PARAGRAPH_WORDS, read_narrativeqa

DATA = Path(__file__).resolve().parents[2] / "data" / "narrativeqa"
SUMMARIES = DATA / "third_party" / "wikipedia" / "summaries.csv"


def rows(path: Path) -> list[dict]:
    with path.open(encoding="utf-8", newline="") as fh:
        return list(csv.DictReader(fh))


def words(text: str) -> int:
    return len(text.split())


def test_documents_are_the_summaries_with_titles() -> None:
    documents, questions = load_corpus(CorpusConfig("narrativeqa", str(DATA)))
    listed = rows(DATA / "documents.csv")
    summaries = {r["document_id"]: r["summary"] for r in rows(SUMMARIES)}
    assert [d.id for d in documents] == [f"narrativeqa/{r['document_id']}" for r in listed]
    assert [d.title for d in documents] == [r["wiki_title"] for r in listed]
    assert all(d.text == summaries[d.metadata["document_id"]] for d in documents)
    assert len(documents) == 6 and len(questions) == len(rows(DATA / "qaps.csv")) == 177


def assert_grouped(doc, budget: int) -> None:
    """Sentences in order and stripped, covering the text; paragraphs are runs of whole sentences within
    ``budget`` words, unless one sentence alone exceeds it."""
    text, sentences, paragraphs = doc.text, doc.metadata["sentence_spans"], doc.metadata["paragraph_spans"]
    assert all(a[1] <= b[0] for a, b in zip(sentences, sentences[1:]))
    assert all(text[s:e] == text[s:e].strip() and text[s:e] for s, e in sentences)
    assert " ".join(text[s:e] for s, e in sentences).split() == text.split()
    starts, ends = {s for s, _ in sentences}, {e for _, e in sentences}
    assert all(a[1] <= b[0] for a, b in zip(paragraphs, paragraphs[1:]))
    inside = [[x for x in sentences if s <= x[0] and x[1] <= e] for s, e in paragraphs]
    assert sum(map(len, inside)) == len(sentences)
    for (s, e), held in zip(paragraphs, inside, strict=True):
        assert s in starts and e in ends
        assert words(text[s:e]) <= budget or len(held) == 1


def test_paragraphs_group_sentences_under_the_budget() -> None:
    documents, _ = load_corpus(CorpusConfig("narrativeqa", str(DATA)))
    for doc in documents:
        assert_grouped(doc, PARAGRAPH_WORDS)
    assert sum(len(d.metadata["paragraph_spans"]) for d in documents) > 2 * len(documents)  # grouping did split


def test_budget_is_configurable_and_the_hierarchy_keeps_the_paragraphs(tokenizer) -> None:
    default, _ = load_corpus(CorpusConfig("narrativeqa", str(DATA)))
    small, _ = load_corpus(CorpusConfig("narrativeqa", str(DATA), paragraph_words=40))
    assert sum(len(d.metadata["paragraph_spans"]) for d in small) > sum(len(d.metadata["paragraph_spans"])
                                                                         for d in default)
    for doc in small:
        assert_grouped(doc, 40)
    doc = default[0]
    chunks = build_hierarchy(doc, tokenizer, HierarchyConfig())
    assert [[c.start, c.end] for c in chunks_at_levels(chunks, "paragraph")] == doc.metadata["paragraph_spans"]
    assert [[c.start, c.end] for c in chunks_at_levels(chunks, "sentence")] == doc.metadata["sentence_spans"]
    with pytest.raises(ConfigError, match="corpus.paragraph_words must be >= 0 and applies to narrativeqa only"):
        CorpusConfig("qasper", str(DATA), paragraph_words=40)


def test_stray_quotes_do_not_make_one_long_sentence() -> None:
    """Sister Act's summary has unpaired ' marks (the summaries were rebuilt from tokens); pysbd alone returns a
    sentence of about 500 words there, which the loader splits again."""
    documents, _ = load_corpus(CorpusConfig("narrativeqa", str(DATA)))
    doc = {d.metadata["document_id"]: d for d in documents}["f7bb9eb9306b79cad4b6466f2ac3dcbd0e5fa63a"]
    assert " ' " in doc.text
    assert max(words(doc.text[s:e]) for s, e in doc.metadata["sentence_spans"]) <= LONG_SENTENCE_WORDS
    assert max(words(doc.text[s:e]) for s, e in doc.metadata["paragraph_spans"]) <= PARAGRAPH_WORDS


def test_both_reference_answers_are_kept() -> None:
    _, questions = load_corpus(CorpusConfig("narrativeqa", str(DATA)))
    raw = rows(DATA / "qaps.csv")
    assert [q.question for q in questions] == [r["question"] for r in raw]
    for q, r in zip(questions, raw, strict=True):
        assert q.metadata["references"] == [r["answer1"], r["answer2"]]
        assert q.answers == list(dict.fromkeys([r["answer1"], r["answer2"]]))
        assert q.metadata["doc_id"] == f"narrativeqa/{r['document_id']}" and q.evidence == []
    assert questions[0].answers == ["He is a high school student in Phoenix.",
                                    "A loner and outsider student with a radio station."]
    assert questions[0].id == "0025577043f5090cd603c6aea60f26e236195594/0"
    assert len({q.id for q in questions}) == len(questions)


def test_set_filter() -> None:
    documents, questions = load_corpus(CorpusConfig("narrativeqa", str(DATA), split="test"))
    assert len(documents) == 6 and len(questions) == 177  # the shipped summaries are all from the test set
    documents, questions = load_corpus(CorpusConfig("narrativeqa", str(DATA), split="train"))
    assert documents == [] and questions == []
    with pytest.raises(ConfigError, match="corpus.split: 'dev' is not a narrativeqa split; splits are train, valid"):
        CorpusConfig("narrativeqa", str(DATA), split="dev")


def test_missing_summaries_are_skipped_and_counted(tmp_path: Path) -> None:
    folder = tmp_path / "narrativeqa"
    shutil.copytree(DATA, folder)
    summaries = rows(SUMMARIES)
    dropped, blanked = summaries[0]["document_id"], summaries[1]["document_id"]
    summaries = summaries[1:]  # the first document has no summary row at all
    summaries[0]["summary"] = ""  # the second has an empty one
    target = folder / "third_party" / "wikipedia" / "summaries.csv"
    with target.open("w", encoding="utf-8", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(summaries[0]))
        writer.writeheader()
        writer.writerows(summaries)
    documents, questions, report = read_narrativeqa(folder)
    lost = sum(1 for r in rows(DATA / "qaps.csv") if r["document_id"] in {dropped, blanked})
    assert len(documents) == 4 and {d.metadata["document_id"] for d in documents}.isdisjoint({dropped, blanked})
    assert report.missing_summaries == 2 and report.questions_without_summary == lost > 0
    assert len(questions) == 177 - lost


def test_bad_input(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="NarrativeQA folder not found"):
        load_corpus("narrativeqa", tmp_path / "missing")
    (tmp_path / "documents.csv").write_text("document_id,set\nx,test\n")
    with pytest.raises(CorpusError, match="documents.csv: missing column\\(s\\) kind, wiki_title"):
        load_corpus("narrativeqa", tmp_path)


def test_hub_layout_gives_the_same_documents_and_questions(monkeypatch) -> None:
    """deepmind/narrativeqa cannot be reached here: its rows (one per question, the document and summary nested)
    are built from the official slice and handed to the loader in place of ``datasets.load_dataset``."""
    listed = {r["document_id"]: r for r in rows(DATA / "documents.csv")}
    summaries = {r["document_id"]: r["summary"] for r in rows(SUMMARIES)}
    hub = [("test", {"document": {"id": r["document_id"], "kind": listed[r["document_id"]]["kind"],
                                  "summary": {"text": summaries[r["document_id"]],
                                              "title": listed[r["document_id"]]["wiki_title"]}},
                     "question": {"text": r["question"]}, "answers": [{"text": r["answer1"]}, {"text": r["answer2"]}]})
           for r in rows(DATA / "qaps.csv")]
    asked = []
    monkeypatch.setattr(narrativeqa, "hub_rows", lambda name, split, hint: asked.append((name, split)) or iter(hub))
    from_hub = read_narrativeqa(Path("hub:deepmind/narrativeqa"), split="test")
    official = read_narrativeqa(DATA, split="test")
    assert asked == [("deepmind/narrativeqa", "test")]
    assert from_hub[0] == official[0] and from_hub[1] == official[1]


def test_offline_hub_error_says_what_to_pass() -> None:
    with pytest.raises(CorpusError, match=r"could not load 'deepmind/narrativeqa' from the Hugging Face hub.*official "
                                          r"files instead: a NarrativeQA folder with documents.csv"):
        load_corpus(CorpusConfig("narrativeqa", "hub:deepmind/narrativeqa", split="valid"))
