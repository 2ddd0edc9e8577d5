"""The planner's examples as the data jobs wrote them: correct pseudo-labels joined with the hierarchy
they were labelled on.

The pseudo-labels job stores that hierarchy beside its labels (``<labels>.hierarchy.jsonl``), so the traces
job, the planner recipes (planner_grpo, stitch, the verl export) and ``eval planner`` read what it wrote
instead of loading the corpus and rebuilding hierarchies: every later step sees the same documents and chunk
ids, whatever the corpus loaders or the chunking code do meanwhile.

``planner_rows`` gives the rows GRPO trains on: the planner's chat prompt (question plus the document's
beginning) and the columns the rewards read (``example_id``, ``level_min``, ``level_max``,
``level_tokens``), split by document. ``unlabelled_rows`` gives the prompts of the questions the backbone never
answered (no range to learn or compare with), on which a planner's format can still be judged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from overstory.core.config import ConfigError
from overstory.core.records import LEVELS, Chunk, PseudoLabel, read_jsonl
from overstory.data_pipeline.hierarchy import cached_tokenizer, load_hierarchies, stored_hierarchy_path
from overstory.data_pipeline.splits import split_by_document
from overstory.models.planner import document_metadata, planner_messages


@dataclass(frozen=True)
class PlannerDataConfig:
    labels: str  # pseudo-label JSONL (`overstory data pseudo-labels`); only correct labels become prompts
    hierarchy: str = ""  # the chunks the labels refer to; empty: the one that job stored beside the labels
    metadata_tokens: int = 1000  # how much of the document the planner reads
    val_fraction: float = 0.2  # share of documents held out (split by document hash)

    def __post_init__(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.metadata_tokens < 1:
            raise ConfigError(f"data.metadata_tokens must be positive, got {self.metadata_tokens}")


def labelled_hierarchy(labels: str | Path, hierarchy: str | Path = "") -> list[Chunk]:
    """The chunks the pseudo-labels in ``labels`` were made on: ``hierarchy`` when given, else the file the
    pseudo-labels job stored beside them."""
    path = Path(hierarchy) if hierarchy else stored_hierarchy_path(labels)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: `overstory data pseudo-labels` stores the hierarchy it labelled "
                                f"on beside its output; rerun it with out={labels} (finished questions are skipped)")
    return load_hierarchies(path)


def correct_labels(labels: str | Path) -> list[PseudoLabel]:
    """The labels whose question was answered correctly (the only ones with a level range)."""
    kept = [label for label in read_jsonl(labels, PseudoLabel) if label.correct]
    if not kept:
        raise ValueError(f"{labels} holds no correct pseudo-labels; run `overstory data pseudo-labels`")
    return kept


def planner_metadata(chunks: list[Chunk], doc_ids: set[str], tokenizer_name: str, max_tokens: int) -> dict[str, str]:
    """The planner's view of each document (title and beginning), from the hierarchy's document chunks."""
    documents = {c.doc_id: c for c in chunks if c.level == "document"}
    missing = sorted(doc_ids - set(documents))
    if missing:
        raise ValueError(f"{len(missing)} labelled documents (e.g. {missing[0]}) are not in the stored hierarchy")
    tokenizer = cached_tokenizer(tokenizer_name)
    return {d: document_metadata(documents[d].title, documents[d].text, tokenizer, max_tokens) for d in doc_ids}


def level_token_means(chunks: list[Chunk]) -> dict[str, dict[str, float]]:
    """Per document, the mean chunk length (tokens) of each level; a level a document lacks gets the
    next larger level's mean (its chunks would be read instead).

    >>> doc = [Chunk("s0", "d", "sentence", "", None, [], 0, 1, 10),
    ...        Chunk("s1", "d", "sentence", "", None, [], 1, 2, 20),
    ...        Chunk("r", "d", "document", "", None, [], 0, 2, 40)]
    >>> level_token_means(doc)["d"]
    {'sentence': 15.0, 'paragraph': 40.0, 'subsection': 40.0, 'section': 40.0, 'document': 40.0}
    """
    sums: dict[str, dict[str, list[int]]] = {}
    for chunk in chunks:
        sums.setdefault(chunk.doc_id, {}).setdefault(chunk.level, []).append(chunk.n_tokens)
    means: dict[str, dict[str, float]] = {}
    for doc_id, by_level in sums.items():
        row: dict[str, float] = {}
        for level in reversed(LEVELS):
            values = by_level.get(level)
            row[level] = sum(values) / len(values) if values else row.get(LEVELS[min(LEVELS.index(level) + 1, 4)], 1.0)
        means[doc_id] = {level: row[level] for level in LEVELS}
    return means


def planner_rows(config: PlannerDataConfig, tokenizer_name: str) -> tuple[list[dict], list[dict], list[Chunk]]:
    """(train rows, validation rows, the hierarchy) from the correct pseudo-labels, split by document."""
    labels = correct_labels(config.labels)
    chunks = labelled_hierarchy(config.labels, config.hierarchy)
    needed = {label.doc_id for label in labels}
    metadata = planner_metadata(chunks, needed, tokenizer_name, config.metadata_tokens)
    chunks = [c for c in chunks if c.doc_id in needed]
    tokens = level_token_means(chunks)
    train, val = split_by_document(labels, config.val_fraction) if config.val_fraction else (labels, [])

    def row(label: PseudoLabel) -> dict:
        return {"prompt": planner_messages(label.question, metadata[label.doc_id]), "example_id": label.id,
                "doc_id": label.doc_id, "question": label.question, "answers": label.answers,
                "level_min": label.level_min, "level_max": label.level_max, "level_tokens": tokens[label.doc_id],
                "gold_level_min": label.gold_level_min or "", "gold_level_max": label.gold_level_max or ""}

    return [row(label) for label in train], [row(label) for label in val], chunks


def unlabelled_rows(config: PlannerDataConfig, tokenizer_name: str, doc_ids: set[str] | None = None) -> list[dict]:
    """Prompt rows (``prompt``, ``example_id``, ``doc_id``, ``question``, ``answers``) for the questions of ``doc_ids``
    without a correct pseudo-label, in file order: no label to score a plan against, but the same prompt a runtime
    sends and the reference answers to score what it reads. ``doc_ids`` None: every document's."""
    labels = [label for label in read_jsonl(config.labels, PseudoLabel)
              if not label.correct and (doc_ids is None or label.doc_id in doc_ids)]
    if not labels:
        return []
    chunks = labelled_hierarchy(config.labels, config.hierarchy)
    metadata = planner_metadata(chunks, {label.doc_id for label in labels}, tokenizer_name, config.metadata_tokens)
    return [{"prompt": planner_messages(label.question, metadata[label.doc_id]), "example_id": label.id,
             "doc_id": label.doc_id, "question": label.question, "answers": label.answers} for label in labels]
