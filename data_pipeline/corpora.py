"""Corpus loaders: HotpotQA, SQuAD, QASPER, NarrativeQA, folders of .txt/.md files, and JSONL -> Documents.

Each loader returns ``(documents, questions)``; plain corpora have no questions. Loaders record the
structure the source already knows, so the hierarchy builder does not have to guess it:
``metadata["sentence_spans"]`` (HotpotQA ships its sentences split), ``metadata["paragraph_spans"]``
(SQuAD paragraphs) and ``metadata["headings"]`` (markdown). All spans are ``[start, end]`` character
offsets into ``Document.text``. QASPER (``qasper.py``) and NarrativeQA (``narrativeqa.py``) have modules
of their own; they take a ``split`` (and NarrativeQA a paragraph budget) besides the path.

Document ids: ``hotpotqa/<slug of title>``, ``squad/<slug of title>``, the relative path for text
folders, the ``id`` field for JSONL. Malformed input raises ``CorpusError`` naming the file and the
problem. Documents with empty text are skipped with a logged warning: they have nothing to chunk,
and one blank record should not stop a corpus.
"""

from __future__ import annotations

import hashlib
import logging
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from overstory.core.config import ConfigError
from overstory.core.records import Document, QAExample, Span
from overstory.data_pipeline.corpus_files import SPLITS, CorpusError, Loaded, read_json, read_json_lines, require
from overstory.data_pipeline.narrativeqa import load_narrativeqa
from overstory.data_pipeline.qasper import load_qasper

log = logging.getLogger(__name__)

CorpusKind = Literal["hotpotqa", "squad", "text", "jsonl", "qasper", "narrativeqa"]
# Whether a kind's questions are each about one given document (``metadata["doc_id"]``: QASPER's paper, NarrativeQA's
# story, SQuAD's article), so retrieval searches that document, or are posed over the open corpus (HotpotQA: the
# question does not say where its facts are). Text and JSONL corpora have no questions.
DOCUMENT_SCOPED: dict[str, bool] = {"hotpotqa": False, "squad": True, "text": False, "jsonl": False, "qasper": True,
                                    "narrativeqa": True}


@dataclass(frozen=True)
class CorpusConfig:
    """Config section naming a corpus: ``kind`` picks the loader, ``path`` its file or folder."""

    kind: CorpusKind
    path: str
    # keep only the first N documents (0 = all); questions about dropped documents are dropped too
    limit_docs: int = 0
    # qasper (train, dev, test) and narrativeqa (train, valid, test) only; "" = every split found
    split: str = ""
    # narrativeqa only: words per paragraph when grouping a summary's sentences (0 = the loader's default)
    paragraph_words: int = 0

    def __post_init__(self) -> None:
        if self.limit_docs < 0:
            raise ConfigError(f"corpus.limit_docs must be >= 0, got {self.limit_docs}")
        if self.split and self.kind not in SPLITS:
            raise ConfigError(f"corpus.split applies to {', '.join(SPLITS)} only, not {self.kind!r}")
        if self.split and self.split not in SPLITS[self.kind]:
            raise ConfigError(f"corpus.split: {self.split!r} is not a {self.kind} split; splits are "
                              f"{', '.join(SPLITS[self.kind])}")
        if self.paragraph_words < 0 or (self.paragraph_words and self.kind != "narrativeqa"):
            raise ConfigError(f"corpus.paragraph_words must be >= 0 and applies to narrativeqa only, got "
                              f"{self.paragraph_words} for {self.kind!r}")

    @property
    def document_scoped(self) -> bool:
        """Whether this corpus's questions are each about one given document (``DOCUMENT_SCOPED``).

        >>> CorpusConfig("qasper", "x").document_scoped, CorpusConfig("hotpotqa", "x").document_scoped
        (True, False)
        """
        return DOCUMENT_SCOPED[self.kind]


def load_corpus(corpus: CorpusConfig | str, path: str | Path | None = None, limit_docs: int = 0,
                **options: Any) -> Loaded:
    """Load a corpus from a config, or from a kind and a path: ``load_corpus(cfg)`` is
    ``load_corpus(cfg.kind, cfg.path, cfg.limit_docs, split=cfg.split, ...)``. ``limit_docs`` keeps the
    first N documents and the questions about them; ``options`` go to the loader (``split``,
    ``paragraph_words``)."""
    if isinstance(corpus, CorpusConfig):
        kind, path, limit_docs = corpus.kind, corpus.path, corpus.limit_docs
        options = {k: v for k, v in (("split", corpus.split), ("paragraph_words", corpus.paragraph_words)) if v}
    else:
        kind = corpus
    if kind not in LOADERS:
        raise CorpusError(f"unknown corpus kind {kind!r}; kinds are {', '.join(LOADERS)}")
    if path is None:
        raise CorpusError(f"corpus kind {kind!r} needs a path")
    documents, questions = LOADERS[kind](Path(path), **options)
    if limit_docs:
        documents = documents[:limit_docs]
        kept = {d.id for d in documents}
        questions = [q for q in questions if _about(q) and _about(q) <= kept]
    return documents, questions


def _about(question: QAExample) -> set[str]:
    """Ids of the documents a question is about: its evidence, or (unanswerable SQuAD) its article."""
    return set(question.gold_doc_ids) or ({question.metadata["doc_id"]} if "doc_id" in question.metadata else set())


def slugify(title: str) -> str:
    """A lowercase ASCII slug for ids; titles with no ASCII letters or digits get a hash.

    >>> slugify("Tornado outbreak of April 6–9, 1998"), slugify("Élan (film)")
    ('tornado-outbreak-of-april-6-9-1998', 'elan-film')
    """
    spaced = re.sub(r"[\W_]+", " ", title)  # punctuation (dashes too) separates words before ASCII folding
    ascii_title = unicodedata.normalize("NFKD", spaced).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_title.lower()).strip("-")
    return slug or hashlib.sha1(title.encode()).hexdigest()[:10]


def _id_maker(prefix: str) -> Callable[[str], str]:
    """Title -> ``<prefix>/<slug>``, the same title always giving the same id. Two titles with one
    slug (rare: they differ only in punctuation or accents) are told apart by a hash of the second."""
    by_title: dict[str, str] = {}
    taken: set[str] = set()

    def make(title: str) -> str:
        if title not in by_title:
            doc_id = f"{prefix}/{slugify(title)}"
            if doc_id in taken:
                doc_id += "-" + hashlib.sha1(title.encode()).hexdigest()[:8]
            by_title[title] = doc_id
            taken.add(doc_id)
        return by_title[title]

    return make


def _keep(doc: Document, where: str) -> bool:
    if doc.text.strip():
        return True
    log.warning("%s: document %r has empty text; skipped", where, doc.id)
    return False


def _is_sentences(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(s, str) for s in value)


def load_hotpotqa(folder: Path) -> Loaded:
    """HotpotQA (distractor setting): ``questions.json`` in the original format and ``corpus.json``
    (title -> sentences). One Document per Wikipedia paragraph (title), text = the sentences joined
    with "" (they carry their leading spaces). Context paragraphs missing from corpus.json are added
    from the questions. A question's evidence is its gold paragraphs (the ``supporting_facts`` titles),
    whole; ``metadata["supporting_sentences"]`` narrows it to ``[doc_id, start, end]`` sentences."""
    if not folder.is_dir():
        raise CorpusError(f"HotpotQA folder not found: {folder}")
    questions_path, corpus_path = folder / "questions.json", folder / "corpus.json"
    questions_raw = read_json(questions_path)
    corpus = read_json(corpus_path) if corpus_path.exists() else {}
    if not isinstance(questions_raw, list):
        raise CorpusError(f"{questions_path}: expected a list of questions, got {type(questions_raw).__name__}")
    if not isinstance(corpus, dict):
        raise CorpusError(f"{corpus_path}: expected a mapping title -> sentences, got {type(corpus).__name__}")
    for title, sentences in corpus.items():
        if not _is_sentences(sentences):
            raise CorpusError(f"{corpus_path}: {title!r} must map to a list of sentence strings")
    for i, q in enumerate(questions_raw):
        where = f"{questions_path}: question {i}"
        require(q, ("_id", "question", "answer", "supporting_facts", "context"), where)
        for item in q["context"]:
            if not (isinstance(item, list) and len(item) == 2 and _is_sentences(item[1])):
                raise CorpusError(f"{where}: context entries must be [title, [sentences]], got {item!r:.80}")
            corpus.setdefault(item[0], item[1])
        for fact in q["supporting_facts"]:
            if not (isinstance(fact, list) and len(fact) == 2 and isinstance(fact[1], int)):
                raise CorpusError(f"{where}: supporting_facts entries must be [title, sentence_index], "
                                  f"got {fact!r:.80}")

    doc_id = _id_maker("hotpotqa")
    documents: dict[str, Document] = {}
    for title, sentences in corpus.items():
        spans, offset = [], 0
        for sentence in sentences:
            spans.append([offset, offset + len(sentence)])
            offset += len(sentence)
        doc = Document(doc_id(title), title, "".join(sentences), {"sentence_spans": spans})
        if _keep(doc, str(corpus_path)):
            documents[doc.id] = doc

    questions = []
    for q in questions_raw:
        gold = [documents[i] for i in dict.fromkeys(doc_id(t) for t, _ in q["supporting_facts"]) if i in documents]
        supporting = []
        for title, index in q["supporting_facts"]:
            doc = documents.get(doc_id(title))
            if doc is not None and 0 <= index < len(doc.metadata["sentence_spans"]):
                supporting.append([doc.id, *doc.metadata["sentence_spans"][index]])
        questions.append(QAExample(
            id=str(q["_id"]), question=q["question"], answers=[q["answer"]], dataset="hotpotqa",
            evidence=[Span(d.id, 0, len(d.text)) for d in gold],
            metadata={"type": q.get("type"), "level": q.get("level"), "supporting_sentences": supporting},
        ))
    return list(documents.values()), questions


def load_squad(path: Path) -> Loaded:
    """SQuAD 1.1/2.0 json: one Document per article, text = its paragraphs joined by "\\n\\n", with
    ``metadata["paragraph_spans"]``. A question's answers are its distinct answer texts (none when
    ``is_impossible``) and its evidence the first answer's span, shifted to the article;
    ``metadata`` holds ``is_impossible``, ``paragraph`` (index in the article) and ``doc_id``."""
    raw = read_json(path)
    require(raw, ("data",), str(path))
    if not isinstance(raw["data"], list):
        raise CorpusError(f"{path}: 'data' must be a list of articles")
    doc_id = _id_maker("squad")
    documents, questions = [], []
    for a, article in enumerate(raw["data"]):
        require(article, ("title", "paragraphs"), f"{path}: data[{a}]")
        article_id = doc_id(article["title"])
        parts, spans, offset = [], [], 0
        for p, paragraph in enumerate(article["paragraphs"]):
            where = f"{path}: data[{a}].paragraphs[{p}]"
            require(paragraph, ("context", "qas"), where)
            context = paragraph["context"]
            if p:
                offset += 2  # the "\n\n" between paragraphs
            spans.append([offset, offset + len(context)])
            parts.append(context)
            for qa in paragraph["qas"]:
                require(qa, ("id", "question"), f"{where}.qas")
                impossible = bool(qa.get("is_impossible", False))
                answers = [] if impossible else qa.get("answers", [])
                for ans in answers:
                    require(ans, ("text", "answer_start"), f"{where}: question {qa['id']}: answer")
                    start = ans["answer_start"]
                    if context[start: start + len(ans["text"])] != ans["text"]:
                        raise CorpusError(f"{where}: question {qa['id']}: answer_start {start} does not point "
                                          f"at {ans['text']!r}")
                evidence = [Span(article_id, offset + answers[0]["answer_start"],
                                 offset + answers[0]["answer_start"] + len(answers[0]["text"]))] if answers else []
                questions.append(QAExample(
                    id=str(qa["id"]), question=qa["question"], answers=list(dict.fromkeys(x["text"] for x in answers)),
                    evidence=evidence, dataset="squad",
                    metadata={"is_impossible": impossible, "paragraph": p, "doc_id": article_id},
                ))
            offset += len(context)
        doc = Document(article_id, article["title"], "\n\n".join(parts), {"paragraph_spans": spans})
        if _keep(doc, str(path)):
            documents.append(doc)
    return documents, questions


_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$")
_FENCE = re.compile(r"^ {0,3}(```|~~~)")


def markdown_headings(text: str) -> list[list]:
    """``[[depth, title, start, end], ...]`` of the ATX headings (``#`` .. ``######``) in ``text``;
    lines inside fenced code blocks are not headings (a ``# comment`` in a shell snippet).

    >>> markdown_headings("# A\\ntext\\n```\\n# not a heading\\n```\\n## B\\n")
    [[1, 'A', 0, 3], [2, 'B', 33, 37]]
    """
    headings, offset, fence = [], 0, None
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        if (opener := _FENCE.match(body)) and (fence is None or opener.group(1) == fence):
            fence = opener.group(1) if fence is None else None
        elif fence is None and (m := _HEADING.match(body)):
            headings.append([len(m.group(1)), m.group(2), offset, offset + len(body)])
        offset += len(line)
    return headings


def load_text_folder(folder: Path) -> Loaded:
    """Every .txt and .md file under ``folder``, recursively, in sorted order; ids are the relative
    paths. Markdown headings go to ``metadata["headings"]``; the title is the first heading or the
    file name."""
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
        doc = Document(path.relative_to(folder).as_posix(), title, text, {"headings": headings} if headings else {})
        if _keep(doc, str(path)):
            documents.append(doc)
    if not documents:
        raise CorpusError(f"{folder} holds no .txt or .md files with text")
    return documents, []


def load_jsonl(path: Path) -> Loaded:
    """One document per line: ``{"id", "text", "title"?, "metadata"?}``."""
    documents, seen = [], set()
    for n, record in read_json_lines(path):
        require(record, ("id", "text"), f"{path}:{n}")
        if not isinstance(record["text"], str) or not isinstance(record.get("metadata", {}), dict):
            raise CorpusError(f"{path}:{n}: 'text' must be a string and 'metadata' an object")
        doc = Document(str(record["id"]), str(record.get("title", "")), record["text"], record.get("metadata", {}))
        if doc.id in seen:
            raise CorpusError(f"{path}:{n}: duplicate document id {doc.id!r}")
        seen.add(doc.id)
        if _keep(doc, f"{path}:{n}"):
            documents.append(doc)
    return documents, []


LOADERS: dict[str, Callable[..., Loaded]] = {
    "hotpotqa": load_hotpotqa, "squad": load_squad, "text": load_text_folder, "jsonl": load_jsonl,
    "qasper": load_qasper, "narrativeqa": load_narrativeqa,
}
