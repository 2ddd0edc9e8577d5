"""Orion-RAG's tag records and the files that hold them (masters.jsonl: ``DocumentTags``, chunks.jsonl:
``ChunkTags``), and what both the tagger and the strategy read of a tag: its limits, a chunk's semantic path,
replies read tolerantly and reply schemas.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overstory.core.config import ConfigError
from overstory.core.records import Chunk, read_jsonl
from overstory.models.json_reply import json_objects, loads_tolerant

MASTERS_FILE, CHUNKS_FILE, VECTORS_FILE = "masters.jsonl", "chunks.jsonl", "vectors.npz"
# the chunking and tagging settings the tagging job records beside CHUNKS_FILE (data_pipeline/fanout.settings_path)
TAGS_SETTINGS_FILE = "chunks.settings.json"
PARAGRAPH_TAGS = ("gist", "subjects", "domain")
TAG_MAX_WORDS = 4
TAG_MAX_WORD_CHARS = 20  # a tag word's cap in the reply schemas (longer is a run-on, not a word)
PATH_SEPARATOR = " > "


@dataclass(frozen=True)
class DocumentTags:
    """A document's master tags; ``source`` is "llm", "fallback" or "human" (set by orion-tags-edit)."""

    id: str  # the document's id
    title: str
    tags: list[str]
    source: str


@dataclass(frozen=True)
class ChunkTags:
    """A chunk with its paragraph tags (gist, subjects, domain): its text and document offsets are stored with it,
    so the strategy builds from the tag files alone and its chunks match gold evidence spans."""

    id: str
    doc_id: str
    title: str
    text: str
    start: int
    end: int
    tags: list[str]
    source: str  # "llm" or "fallback"

    def chunk(self) -> Chunk:
        return Chunk(id=self.id, doc_id=self.doc_id, level="paragraph", text=self.text, parent=None, children=[],
                     start=self.start, end=self.end, n_tokens=estimate_tokens(self.text), title=self.title)


def load_tags(folder: str | Path) -> tuple[dict[str, DocumentTags], list[ChunkTags]]:
    """The master tags (by document id) and the tagged chunks in ``folder``, as the tagging job wrote them."""
    folder = Path(folder)
    if not (folder / CHUNKS_FILE).is_file() or not (folder / MASTERS_FILE).is_file():
        raise ConfigError(f"orion.tags: {folder} holds no {MASTERS_FILE} and {CHUNKS_FILE}; write them with "
                          "`overstory data orion-tags`")
    masters = {record.id: record for record in read_jsonl(folder / MASTERS_FILE, DocumentTags)}
    return masters, list(read_jsonl(folder / CHUNKS_FILE, ChunkTags))


def estimate_tokens(text: str) -> int:
    """Tokens without a tokenizer (4/3 a word, typical of BPE on English), as LATTICE's prompt budget estimates."""
    return math.ceil(len(text.split()) * 4 / 3)


def semantic_path(master_tags: Sequence[str], paragraph_tags: Sequence[str]) -> str:
    """A chunk's semantic path: its document's master tags, then its gist, subjects and domain.

    >>> semantic_path(["Marie Curie", "Radioactivity"], ["Curie finds polonium", "Marie Curie", "Chemistry"])
    'Marie Curie, Radioactivity > Curie finds polonium > Marie Curie > Chemistry'
    """
    return PATH_SEPARATOR.join([", ".join(master_tags), *paragraph_tags])


def distinct(tags: Iterable[str]) -> list[str]:
    """Non-empty tags, the first of those equal but for case."""
    seen, kept = set(), []
    for tag in tags:
        if tag and tag.lower() not in seen:
            seen.add(tag.lower())
            kept.append(tag)
    return kept


def reply_object(text: str, key: str) -> dict | None:
    """The last JSON object in a reply that holds ``key`` (read tolerantly); None when there is none."""
    return next((obj for obj in map(loads_tolerant, reversed(json_objects(text))) if obj is not None and key in obj),
                None)


def json_format(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def prompts_digest(*prompts: str) -> str:
    """A short digest of ``prompts``, which a job's settings record so that replies asked with other prompts are not
    resumed (the tag folders' and eval pipeline's Orion-RAG records).

    >>> len(prompts_digest("a", "b")), prompts_digest("a", "b") == prompts_digest("a", "c")
    (16, False)
    """
    return hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:16]
