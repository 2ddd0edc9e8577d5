"""Record kinds on disk (JSONL, one dataclass per kind) and the append/resume helpers every generator uses.

Every file written here is readable by ``datasets.load_dataset("json", data_files=...)``.
Writers append and skip ids already present, so a killed job resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

# The planner's vocabulary, smallest to largest (SmartChunk paper).
LEVELS: tuple[str, ...] = ("sentence", "paragraph", "subsection", "section", "document")
LEVEL_RANK: dict[str, int] = {name: i for i, name in enumerate(LEVELS)}


def check_level(name: str) -> str:
    """Return ``name`` if it is a known level, else raise a ValueError listing the valid ones."""
    if name not in LEVEL_RANK:
        raise ValueError(f"unknown level {name!r}; levels are {', '.join(LEVELS)}")
    return name


def check_upper_levels(names: Iterable[str]) -> list[str]:
    """``names`` as a list if each is a level whose chunks have children to compress or summarise (paragraph and
    above), else a ValueError naming the first that is not.

    >>> check_upper_levels(["subsection", "section"])
    ['subsection', 'section']
    """
    checked = [check_level(name) for name in names]
    if "sentence" in checked:
        raise ValueError("sentences have no children to compress; start at paragraph")
    return checked


def level_range(level_min: str, level_max: str) -> list[str]:
    """Levels from ``level_min`` to ``level_max`` inclusive (the planner's output format).

    >>> level_range("paragraph", "section")
    ['paragraph', 'subsection', 'section']
    """
    lo, hi = LEVEL_RANK[check_level(level_min)], LEVEL_RANK[check_level(level_max)]
    if lo > hi:
        raise ValueError(f"level_min {level_min!r} is larger than level_max {level_max!r}")
    return list(LEVELS[lo: hi + 1])


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Chunk:
    """One node of a document's hierarchy; ``text == document.text[start:end]``."""

    id: str
    doc_id: str
    level: str
    text: str
    parent: str | None
    children: list[str]
    start: int
    end: int
    n_tokens: int
    title: str = ""


@dataclass(frozen=True)
class Span:
    """A character span of a document that answers (part of) a question."""

    doc_id: str
    start: int
    end: int


@dataclass(frozen=True)
class QAExample:
    """A question over a corpus. ``evidence`` holds the spans retrieval must reach: the gold
    paragraphs for HotpotQA, the answer span for SQuAD. Unanswerable questions have no answers."""

    id: str
    question: str
    answers: list[str]
    evidence: list[Span]
    dataset: str
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def gold_doc_ids(self) -> list[str]:
        return sorted({span.doc_id for span in self.evidence})


@dataclass(frozen=True)
class SummaryRecord:
    """An upper-level chunk's LLM summary and the embeddings the compressor learns from:
    ``child_embeddings`` (its children, the compressor's input) and ``target_embedding`` (e_gt, the
    encoder's embedding of the summary, the compressor's target)."""

    id: str  # the summarised chunk's id
    doc_id: str
    level: str
    child_ids: list[str]
    child_embeddings: list[list[float]]
    summary: str
    target_embedding: list[float]
    generator: str
    encoder: str
    prompt_tokens: int
    completion_tokens: int
    attempts: int


@dataclass(frozen=True)
class PseudoLabel:
    """The planner's training label for one question: the smallest and largest level among the chunks
    from which the backbone answered correctly (None when no attempt was correct). Where the dataset marks
    evidence (QASPER, SQuAD), ``gold_level_min``/``gold_level_max`` are its gold levels by the rules of
    ``data_pipeline/gold_labels.py``, to measure label quality itself. Gold labels (``data_pipeline/gold_labels.py``)
    use the same record with ``source="gold"``."""

    id: str  # the question's id
    doc_id: str
    question: str
    answers: list[str]
    level_min: str | None
    level_max: str | None
    correct: bool
    attempts: int
    retrieved_ids: list[str]  # what the backbone read on the deciding (or last) attempt
    retrieved_levels: list[str]
    answer: str  # the backbone's answer on that attempt
    backbone: str
    correctness: str  # the rule that judged it: exact, f1, contains or judge
    gold_level_min: str | None = None
    gold_level_max: str | None = None
    evidence: list[Span] = field(default_factory=list)  # the question's evidence spans (recall@k in evaluations)
    # "pseudo": found by retrieving and answering; "gold": read off annotated evidence; "grounded": a pseudo-label
    # re-ranged by where its answer lies (data_pipeline/grounded_levels.py)
    source: str = "pseudo"
    # backbone replies cut by max_tokens over the attempts, each asked once more with twice the room; those still
    # cut then, and the raw text of the last of them (the answer judged is the cut one: nothing is repaired)
    truncated_replies: int = 0
    truncated_after_retry: int = 0
    truncated_raw: str = ""


@dataclass(frozen=True)
class PlannerTrace:
    """A teacher's planner reply that justifies a pseudo-label: ``prompt`` is the planner's own chat
    prompt (what the student sees), ``completion`` the reasoning ending in the JSON plan."""

    id: str  # "<question id>/<teacher>"
    question_id: str
    doc_id: str
    teacher: str
    prompt: list[dict[str, str]]
    completion: str
    label: dict[str, str]  # {"level_min": ..., "level_max": ...}
    n_tokens: int  # completion length in planner-tokenizer tokens
    rewritten: bool = False
    # the model behind the teacher, as its server reports it ("" for the template teacher, a server that does not
    # say, and files written before the field existed)
    served_model: str = ""


@dataclass(frozen=True)
class FailureRecord:
    """A generation that failed every attempt, kept with the model's raw output for inspection."""

    id: str
    job: str
    error: str
    raw: str
    attempts: int


R = TypeVar("R")


def to_record(obj: Any) -> dict[str, Any]:
    """Dataclass -> plain dict (nested dataclasses included)."""
    return dataclasses.asdict(obj)


def from_record(cls: type[R], record: dict[str, Any]) -> R:
    """Plain dict -> dataclass; knows the nested ``evidence`` Span lists (QAExample, PseudoLabel)."""
    if "evidence" in record and any(f.name == "evidence" for f in dataclasses.fields(cls)):
        record = {**record, "evidence": [Span(**s) for s in record["evidence"]]}
    return cls(**record)


def write_jsonl(path: str | Path, records: Iterable[Any]) -> int:
    """Write records (dataclasses or dicts) to ``path`` atomically: a temp file renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with tmp.open("w") as fh:
        for rec in records:
            fh.write(json.dumps(rec if isinstance(rec, dict) else to_record(rec), ensure_ascii=False) + "\n")
            n += 1
    tmp.replace(path)
    return n


def drop_records(path: str | Path, ids: set[str], id_key: str = "id") -> int:
    """Rewrite ``path`` (atomically) without the records whose id is in ``ids``; returns how many were dropped.

    A job that retries its failures on restart calls this on its failures file with the ids it has since
    written, so the file lists what is still missing rather than every failure it ever had."""
    path = Path(path)
    if not path.exists():
        return 0
    records = list(read_jsonl(path))
    kept = [r for r in records if str(r.get(id_key)) not in ids]
    if len(kept) < len(records):
        write_jsonl(path, kept)
    return len(records) - len(kept)


def read_jsonl(path: str | Path, cls: type[R] | None = None) -> Iterator[Any]:
    """Yield records from ``path``; a truncated last line (a killed writer) is skipped, any other
    malformed line raises with its line number."""
    path = Path(path)
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines):
                continue  # the last line of a killed run; the resume rewrites it
            raise ValueError(f"{path}:{i}: malformed JSON line: {exc}") from exc
        yield from_record(cls, rec) if cls is not None else rec


class JsonlAppender:
    """Append-only JSONL writer that knows which ids are already on disk (resume support).

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "x.jsonl")
    >>> with JsonlAppender(p) as out:
    ...     out.write({"id": "a"})
    >>> with JsonlAppender(p) as out:
    ...     ("a" in out, "b" in out)
    (True, False)
    """

    def __init__(self, path: str | Path, id_key: str = "id"):
        self.path = Path(path)
        self.id_key = id_key
        self.done: set[str] = set()
        if self.path.exists():
            self.done = {str(r[id_key]) for r in read_jsonl(self.path) if id_key in r}
            self._drop_partial_last_line()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a")

    def _drop_partial_last_line(self) -> None:
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            self.path.write_bytes(data[: data.rfind(b"\n") + 1])

    def __contains__(self, record_id: object) -> bool:
        return str(record_id) in self.done

    def write(self, record: Any) -> None:
        rec = record if isinstance(record, dict) else to_record(record)
        self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._fh.flush()
        self.done.add(str(rec[self.id_key]))

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
