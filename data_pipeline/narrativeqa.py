"""NarrativeQA loader, summaries setting: Wikipedia plot summaries and the questions asked about them.

Reads the official layout (a folder with ``documents.csv``, ``third_party/wikipedia/summaries.csv``
and ``qaps.csv``) or the hub layout of ``deepmind/narrativeqa`` (``hub:deepmind/narrativeqa`` through
``datasets.load_dataset``; one row per question, the document and its summary nested in it).
``split`` keeps one set (``train``, ``valid``, ``test``; the hub calls ``valid`` ``validation``).

One Document per summary (id ``narrativeqa/<document_id>``, title = the Wikipedia title), its text
the summary as given. A summary is one block with no paragraph breaks, so paragraphs are made
here: pysbd sentences, grouped greedily in order while a paragraph stays within
``paragraph_words`` words (a sentence longer than that is a paragraph alone). The budget counts
whitespace-separated words, not tokens: the loader then needs no tokenizer (loading one costs
more than reading the corpus, and the paragraphs stay the same whichever tokenizer the hierarchy
counts with). The default, 90 words, is about 115 tokens of the built-in SmolLM2 tokenizer on
these summaries (1.28 tokens per word over all 355 of them), close to the 120-token paragraph
aimed at. ``sentence_spans`` and ``paragraph_spans`` are recorded for the hierarchy builder.

Questions keep both reference answers (``answers``, in order, the second dropped only when it
repeats the first word for word); NarrativeQA marks no evidence, so ``evidence`` is empty and
``metadata["doc_id"]`` names the summary. Question ids are ``<document_id>/<n>``, n counting the
document's questions in file order. Rows with a missing or empty summary are skipped with their
questions, counted (``NarrativeQAReport``) and logged.
"""

from __future__ import annotations

import csv
import json
import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overstory.core.records import Document, QAExample
from overstory.core.text import split_sentences
from overstory.data_pipeline.corpus_files import SPLITS, CorpusError, Loaded
from overstory.data_pipeline.hub import hub_name, hub_rows

log = logging.getLogger(__name__)

PARAGRAPH_WORDS = 90
LONG_SENTENCE_WORDS = 100
_SENTENCE_END = re.compile(r"[.!?]['\"]?\s+(?=[A-Z])")
HUB_SPLITS = {"train": "train", "valid": "validation", "test": "test"}  # official name -> hub name
OFFICIAL_SPLITS = {hub: official for official, hub in HUB_SPLITS.items()}
LOCAL_HINT = "a NarrativeQA folder with documents.csv, third_party/wikipedia/summaries.csv and qaps.csv"
SUMMARIES = Path("third_party") / "wikipedia" / "summaries.csv"


@dataclass
class NarrativeQAReport:
    """Counts a reader should know: summaries kept, and rows skipped because a summary was missing."""

    documents: int = 0
    questions: int = 0
    missing_summaries: int = 0  # documents listed without a summary (no row, or an empty one)
    questions_without_summary: int = 0


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """pysbd sentences of ``text`` as ``(start, end)`` spans without surrounding whitespace, each found
    after the previous one (a sentence pysbd altered is joined to the one before it). A "sentence" of
    more than ``LONG_SENTENCE_WORDS`` words is pysbd lost inside a stray quote (the summaries were
    rebuilt from tokens and keep unpaired ' marks); it is split again after . ! ? before a capital.

    >>> sentence_spans("Mark starts a radio station. Nobody knows who he is.")
    [(0, 28), (29, 52)]
    """
    spans = []
    for start, end in split_sentences(text, 0, len(text)):  # the hierarchy builder's tiling of the text
        cuts = [start, end]
        if len(text[start:end].split()) > LONG_SENTENCE_WORDS:
            cuts[1:1] = [start + m.end() for m in _SENTENCE_END.finditer(text[start:end])]
        for a, b in zip(cuts, cuts[1:]):
            piece = text[a:b]
            if piece.strip():
                spans.append((a + len(piece) - len(piece.lstrip()), a + len(piece.rstrip())))
    return spans


def group_paragraphs(text: str, sentences: list[tuple[int, int]], budget: int) -> list[tuple[int, int]]:
    """Consecutive sentences grouped while a group holds at most ``budget`` words; a longer sentence
    is a group alone. Returns the groups' spans.

    >>> text = "One two three. Four five. Six seven eight nine."
    >>> group_paragraphs(text, [(0, 14), (15, 25), (26, 47)], budget=5)
    [(0, 25), (26, 47)]
    """
    groups: list[list[int]] = []
    words = 0
    for start, end in sentences:
        n = len(text[start:end].split())
        if groups and words + n <= budget:
            groups[-1][1] = end
            words += n
        else:
            groups.append([start, end])
            words = n
    return [(start, end) for start, end in groups]


def summary_document(document_id: str, title: str, summary: str, budget: int, extra: dict[str, Any]) -> Document:
    """A summary as a Document with its sentence and paragraph spans."""
    sentences = sentence_spans(summary)
    paragraphs = group_paragraphs(summary, sentences, budget)
    return Document(f"narrativeqa/{document_id}", title, summary,
                    {"sentence_spans": [list(s) for s in sentences], "paragraph_spans": [list(p) for p in paragraphs],
                     "document_id": document_id, **extra})


def load_narrativeqa(path: Path, split: str = "", paragraph_words: int = 0) -> Loaded:
    """Documents and questions of NarrativeQA at ``path`` (see the module docstring); logs the report."""
    documents, questions, report = read_narrativeqa(path, split, paragraph_words)
    log.info("NarrativeQA %s: %s", path, json.dumps(vars(report)))
    return documents, questions


def read_narrativeqa(path: Path, split: str = "", paragraph_words: int = 0,
                     ) -> tuple[list[Document], list[QAExample], NarrativeQAReport]:
    """Documents, questions and the loading report; ``split`` "" keeps every set, ``paragraph_words``
    0 means ``PARAGRAPH_WORDS``."""
    if split and split not in SPLITS["narrativeqa"]:
        raise CorpusError(f"{path}: unknown NarrativeQA set {split!r}; sets are {', '.join(SPLITS['narrativeqa'])}")
    if paragraph_words < 0:
        raise CorpusError(f"paragraph_words must be >= 0 (0 = the default {PARAGRAPH_WORDS}), got {paragraph_words}")
    budget = paragraph_words or PARAGRAPH_WORDS
    name = hub_name(path)
    rows = _hub_records(name, split) if name is not None else _official_records(path, split)
    report = NarrativeQAReport()
    documents: dict[str, Document] = {}
    questions: list[QAExample] = []
    skipped: set[str] = set()
    asked: Counter = Counter()  # questions so far per document, for the ids
    for record in rows:
        document_id = record["document_id"]
        if record["kind"] == "document":
            if not record["summary"].strip():
                skipped.add(document_id)
                log.warning("%s: document %s has no summary; skipped with its questions", record["where"], document_id)
                continue
            documents[document_id] = summary_document(document_id, record["title"], record["summary"], budget,
                                                      {"set": record["set"], "kind": record["story_kind"]})
            continue
        if document_id not in documents:
            if document_id not in skipped:
                raise CorpusError(f"{record['where']}: question about unknown document {document_id}")
            report.questions_without_summary += 1
            continue
        questions.append(QAExample(
            id=f"{document_id}/{asked[document_id]}", question=record["question"],
            answers=list(dict.fromkeys(a for a in record["answers"] if a.strip())), evidence=[], dataset="narrativeqa",
            metadata={"doc_id": f"narrativeqa/{document_id}", "set": record["set"], "references": record["answers"]}))
        asked[document_id] += 1
    report.documents, report.questions, report.missing_summaries = len(documents), len(questions), len(skipped)
    return list(documents.values()), questions, report


def _read_csv(path: Path, columns: tuple[str, ...]) -> list[dict[str, str]]:
    if not path.is_file():
        raise CorpusError(f"NarrativeQA file not found: {path}")
    with path.open(encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise CorpusError(f"{path}: missing column(s) {', '.join(missing)}")
        return list(reader)


def _official_records(folder: Path, split: str) -> Iterator[dict[str, Any]]:
    """Documents (in documents.csv order, with their summaries) then questions, as plain records."""
    if not folder.is_dir():
        raise CorpusError(f"NarrativeQA folder not found: {folder} (expected {LOCAL_HINT})")
    docs_path, summaries_path, qaps_path = folder / "documents.csv", folder / SUMMARIES, folder / "qaps.csv"
    listed = _read_csv(docs_path, ("document_id", "set", "kind", "wiki_title"))
    summaries = {row["document_id"]: row for row in _read_csv(summaries_path, ("document_id", "set", "summary"))}
    for n, row in enumerate(listed, 2):  # line numbers: the header is line 1
        if split and row["set"] != split:
            continue
        summary = summaries.get(row["document_id"], {}).get("summary") or ""
        yield {"kind": "document", "document_id": row["document_id"], "title": row["wiki_title"],
               "summary": summary, "set": row["set"], "story_kind": row["kind"],
               "where": f"{docs_path}:{n} / {summaries_path}"}
    for n, row in enumerate(_read_csv(qaps_path, ("document_id", "set", "question", "answer1", "answer2")), 2):
        if split and row["set"] != split:
            continue
        yield {"kind": "question", "document_id": row["document_id"], "question": row["question"],
               "answers": [row["answer1"], row["answer2"]], "set": row["set"], "where": f"{qaps_path}:{n}"}


def _hub_records(name: str, split: str) -> Iterator[dict[str, Any]]:
    """The hub rows (one per question, the document nested) as the same records: each document the
    first time it is seen, then its question."""
    seen: set[str] = set()
    for n, (hub_split, row) in enumerate(hub_rows(name, HUB_SPLITS[split] if split else "", LOCAL_HINT)):
        where = f"{name}[{hub_split}] row {n}"
        try:
            document, question, answers = row["document"], row["question"]["text"], [a["text"] for a in row["answers"]]
            document_id, summary = document["id"], document["summary"]
        except (KeyError, TypeError) as exc:
            raise CorpusError(f"{where}: not NarrativeQA's hub layout ({type(exc).__name__}: {exc})") from exc
        set_name = OFFICIAL_SPLITS.get(hub_split, hub_split)
        if document_id not in seen:
            seen.add(document_id)
            yield {"kind": "document", "document_id": document_id, "title": summary.get("title", ""),
                   "summary": summary.get("text") or "", "set": set_name, "story_kind": document.get("kind", ""),
                   "where": where}
        yield {"kind": "question", "document_id": document_id, "question": question, "answers": answers,
               "set": set_name, "where": where}
