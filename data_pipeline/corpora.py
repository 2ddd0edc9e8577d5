"""Corpus loaders: HotpotQA, SQuAD, folders of .txt/.md files, and JSONL -> Documents (+ questions).

Each loader returns ``(documents, questions)``; plain corpora have no questions. Loaders record the
structure the source already knows, so the hierarchy builder does not have to guess it:
``metadata["sentence_spans"]`` (HotpotQA ships its sentences split), ``metadata["paragraph_spans"]``
(SQuAD paragraphs) and ``metadata["headings"]`` (markdown). Documents with empty text are skipped
with a warning: they have nothing to chunk, and one bad record should not stop a corpus.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from data_pipeline.formats import Document, QAExample, Span
from overstory.config import ConfigError

log = logging.getLogger(__name__)

CorpusKind = Literal["hotpotqa", "squad", "text", "jsonl"]


class CorpusError(ValueError):
    """A corpus file is missing or malformed; the message names the file and the problem."""


@dataclass(frozen=True)
class CorpusConfig:
    kind: CorpusKind
    path: str
    # keep only the first N documents (0 = all); questions about dropped documents are dropped too
    limit_docs: int = 0

    def __post_init__(self) -> None:
        if self.limit_docs < 0:
            raise ConfigError(f"corpus.limit_docs must be >= 0, got {self.limit_docs}")


def load_corpus(config: CorpusConfig) -> tuple[list[Document], list[QAExample]]:
    """Load the corpus a config names, applying ``limit_docs``."""
    loader = LOADERS[config.kind]
    documents, questions = loader(Path(config.path))
    if config.limit_docs:
        documents = documents[: config.limit_docs]
        kept = {d.id for d in documents}
        questions = [q for q in questions if {s.doc_id for s in q.evidence} <= kept and q.evidence]
    return documents, questions


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise CorpusError(f"corpus file not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{path} is not valid JSON: {exc}") from exc


def _require(record: dict, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(record, dict):
        raise CorpusError(f"{where}: expected an object, got {type(record).__name__}")
    missing = [k for k in keys if k not in record]
    if missing:
        raise CorpusError(f"{where}: missing field(s) {', '.join(missing)}")


def _keep(doc: Document, where: str) -> bool:
    if doc.text.strip():
        return True
    log.warning("%s: document %r has empty text; skipped", where, doc.id)
    return False


def load_hotpotqa(folder: Path) -> tuple[list[Document], list[QAExample]]:
    """HotpotQA (distractor setting): one Document per Wikipedia paragraph (title), ids
    ``hotpotqa:<title>``; a question's evidence is its gold paragraphs (``supporting_facts`` titles)."""
    questions_raw = _read_json(folder / "questions.json")
    corpus_path = folder / "corpus.json"
    corpus: dict[str, list[str]] = _read_json(corpus_path) if corpus_path.exists() else {}
    if not isinstance(questions_raw, list):
        raise CorpusError(f"{folder / 'questions.json'}: expected a list of questions")
    for i, q in enumerate(questions_raw):
        _require(q, ("_id", "question", "answer", "supporting_facts", "context"), f"questions.json[{i}]")
        for title, sentences in q["context"]:
            corpus.setdefault(title, sentences)

    documents: dict[str, Document] = {}
    for title, sentences in corpus.items():
        if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
            raise CorpusError(f"{corpus_path}: {title!r} must map to a list of sentence strings")
        spans, offset = [], 0
        for sentence in sentences:  # sentences carry their leading space: "".join is the paragraph
            spans.append([offset, offset + len(sentence)])
            offset += len(sentence)
        doc = Document(f"hotpotqa:{title}", title, "".join(sentences), {"sentence_spans": spans})
        if _keep(doc, str(corpus_path)):
            documents[doc.id] = doc

    questions = []
    for q in questions_raw:
        gold_titles = sorted({title for title, _ in q["supporting_facts"]})
        evidence = [Span(f"hotpotqa:{t}", 0, len(documents[f"hotpotqa:{t}"].text))
                    for t in gold_titles if f"hotpotqa:{t}" in documents]
        supporting = []
        for title, index in q["supporting_facts"]:
            doc = documents.get(f"hotpotqa:{title}")
            if doc is not None and index < len(doc.metadata["sentence_spans"]):
                supporting.append([doc.id, *doc.metadata["sentence_spans"][index]])
        questions.append(QAExample(
            id=q["_id"], question=q["question"], answers=[q["answer"]], evidence=evidence, dataset="hotpotqa",
            metadata={"type": q.get("type"), "level": q.get("level"), "supporting_sentences": supporting},
        ))
    return list(documents.values()), questions


def load_squad(path: Path) -> tuple[list[Document], list[QAExample]]:
    """SQuAD 1.1/2.0 json: one Document per article (paragraphs joined by blank lines), ids
    ``squad:<title>``; a question's evidence is its first answer's span, shifted to the article."""
    raw = _read_json(path)
    _require(raw, ("data",), str(path))
    documents, questions = [], []
    for a, article in enumerate(raw["data"]):
        _require(article, ("title", "paragraphs"), f"{path}: data[{a}]")
        doc_id = f"squad:{article['title']}"
        parts, spans, offset = [], [], 0
        for p, paragraph in enumerate(article["paragraphs"]):
            _require(paragraph, ("context", "qas"), f"{path}: data[{a}].paragraphs[{p}]")
            context = paragraph["context"]
            if p:
                offset += 2  # the "\n\n" between paragraphs
            spans.append([offset, offset + len(context)])
            parts.append(context)
            for qa in paragraph["qas"]:
                _require(qa, ("id", "question"), f"{path}: data[{a}].paragraphs[{p}].qas")
                answers = [] if qa.get("is_impossible") else qa.get("answers", [])
                for ans in answers:
                    if context[ans["answer_start"]: ans["answer_start"] + len(ans["text"])] != ans["text"]:
                        raise CorpusError(f"{path}: question {qa['id']}: answer_start does not point at "
                                          f"{ans['text']!r}")
                evidence = [Span(doc_id, offset + answers[0]["answer_start"],
                                 offset + answers[0]["answer_start"] + len(answers[0]["text"]))] if answers else []
                questions.append(QAExample(
                    id=qa["id"], question=qa["question"], answers=list(dict.fromkeys(x["text"] for x in answers)),
                    evidence=evidence, dataset="squad",
                    metadata={"is_impossible": bool(qa.get("is_impossible", False)), "paragraph": p},
                ))
            offset += len(context)
        doc = Document(doc_id, article["title"], "\n\n".join(parts), {"paragraph_spans": spans})
        if _keep(doc, str(path)):
            documents.append(doc)
    return documents, questions


_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


def markdown_headings(text: str) -> list[list]:
    """``[[depth, title, start, end], ...]`` of the ATX headings (``#`` .. ``######``) in ``text``.

    >>> markdown_headings("# A\\ntext\\n## B\\n")
    [[1, 'A', 0, 3], [2, 'B', 9, 13]]
    """
    return [[len(m.group(1)), m.group(2), m.start(), m.end()] for m in _HEADING.finditer(text)]


def load_text_folder(folder: Path) -> tuple[list[Document], list[QAExample]]:
    """Every .txt and .md file under ``folder`` (sorted); ids are relative paths. Markdown headings
    are recorded in ``metadata["headings"]``; the title is the first heading or the file name."""
    if not folder.is_dir():
        raise CorpusError(f"corpus folder not found: {folder}")
    documents = []
    for path in sorted(p for p in folder.rglob("*") if p.suffix in (".txt", ".md") and p.is_file()):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{path} is not UTF-8 text: {exc}") from exc
        headings = markdown_headings(text) if path.suffix == ".md" else []
        title = headings[0][1] if headings else path.stem
        doc = Document(str(path.relative_to(folder)), title, text, {"headings": headings} if headings else {})
        if _keep(doc, str(path)):
            documents.append(doc)
    if not documents:
        raise CorpusError(f"{folder} holds no .txt or .md files with text")
    return documents, []


def load_jsonl(path: Path) -> tuple[list[Document], list[QAExample]]:
    """One document per line: ``{"id", "text", "title"?, "metadata"?}``."""
    if not path.is_file():
        raise CorpusError(f"corpus file not found: {path}")
    documents = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{path}:{n}: malformed JSON: {exc}") from exc
        _require(record, ("id", "text"), f"{path}:{n}")
        doc = Document(str(record["id"]), record.get("title", ""), record["text"], record.get("metadata", {}))
        if _keep(doc, f"{path}:{n}"):
            documents.append(doc)
    return documents, []


LOADERS = {"hotpotqa": load_hotpotqa, "squad": load_squad, "text": load_text_folder, "jsonl": load_jsonl}
