"""`overstory data mix`: one planner label file from several, e.g. QASPER gold labels, NarrativeQA and SQuAD
pseudo-labels, so that the traces job, the planner recipes and ``eval planner`` train and judge on the mix.

    overstory data mix --config configs/data/planner_mix.yaml

Each source is a label JSONL written by ``data pseudo-labels`` or ``data gold-labels``, with the hierarchy that
job stored beside it. The mix holds, per source, its labelled questions (``correct``: the only ones with a
range), at most ``per_source_limit`` of them taken round-robin over documents so that one large dataset does not
drown the others and any limit still spans its documents; and beside it (``<out stem>.hierarchy.jsonl``) the
chunks of every document those labels name. Documents keep their ids (``qasper/...``, ``narrativeqa/...``): the
planner recipes split by document and ``eval planner`` reports per dataset by that prefix. Two sources that name
the same document (gold and pseudo-labels of one corpus) must have chunked it alike, and a question id met twice
keeps its first source's label; both are checked, not assumed. The mix is cheap and deterministic, so a rerun
rewrites it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from overstory.core.config import ConfigError
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.formats import Chunk, PseudoLabel, read_jsonl, write_jsonl
from overstory.data_pipeline.hierarchy import load_hierarchies, save_hierarchies, stored_hierarchy_path


@dataclass(frozen=True)
class LabelMixConfig:
    # name -> label JSONL (its hierarchy stored beside it); required (a default only for `--help`)
    sources: dict[str, str] = field(default_factory=dict)
    out: str = "runs/data/planner_mix/labels.jsonl"
    per_source_limit: int = 0  # at most this many labelled questions per source (0: all)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if not self.sources:
            raise ConfigError("sources must name at least one label file, e.g. qasper: runs/data/gold_labels/"
                              "qasper_train.jsonl")
        if self.per_source_limit < 0:
            raise ConfigError(f"per_source_limit must be >= 0, got {self.per_source_limit}")


def round_robin(labels: list[PseudoLabel], limit: int) -> list[PseudoLabel]:
    """The first ``limit`` labels taken one document at a time, in file order within a document (all when 0).

    >>> labels = [PseudoLabel(f"q{i}", d, "?", [], "sentence", "sentence", True, 1, [], [], "", "", "")
    ...           for i, d in enumerate("aab")]
    >>> [label.id for label in round_robin(labels, 2)]
    ['q0', 'q2']
    """
    queues: dict[str, list[PseudoLabel]] = {}
    for label in labels:
        queues.setdefault(label.doc_id, []).append(label)
    ordered = [q[i] for i in range(max((len(q) for q in queues.values()), default=0)) for q in queues.values()
               if i < len(q)]
    return ordered[: limit or None]


def run(config: LabelMixConfig) -> dict:
    """Write the mix and its hierarchy; returns the labelled questions per source and per dataset."""
    mixed: list[PseudoLabel] = []
    seen: set[str] = set()
    chunks: dict[str, list[Chunk]] = {}  # doc_id -> its chunks, from the first source that names it
    counts: dict[str, dict] = {}
    with start_run(config.tracking, "data mix", config) as tracker:
        for name, path in config.sources.items():
            labels = round_robin([x for x in read_jsonl(path, PseudoLabel) if x.correct], config.per_source_limit)
            duplicates = [x.id for x in labels if x.id in seen]
            labels = [x for x in labels if x.id not in seen]
            seen.update(x.id for x in labels)
            needed = {x.doc_id for x in labels}
            by_doc: dict[str, list[Chunk]] = {}
            for chunk in load_hierarchies(stored_hierarchy_path(path)):
                if chunk.doc_id in needed:
                    by_doc.setdefault(chunk.doc_id, []).append(chunk)
            missing = sorted(needed - set(by_doc))
            if missing:
                raise ValueError(f"sources.{name}: {len(missing)} labelled documents (e.g. {missing[0]}) are not in "
                                 f"{stored_hierarchy_path(path)}")
            for doc_id, doc_chunks in by_doc.items():
                if doc_id in chunks and [c.id for c in chunks[doc_id]] != [c.id for c in doc_chunks]:
                    raise ValueError(f"sources.{name}: document {doc_id} was chunked differently by an earlier "
                                     f"source; build both with the same hierarchy settings")
                chunks.setdefault(doc_id, doc_chunks)
            mixed.extend(labels)
            counts[name] = {"labels": len(labels), "documents": len(needed), "duplicates_skipped": len(duplicates)}
            print(f"{name}: {len(labels)} labelled questions from {len(needed)} documents"
                  + (f" ({len(duplicates)} already taken from an earlier source)" if duplicates else ""))
        write_jsonl(config.out, mixed)
        save_hierarchies(stored_hierarchy_path(config.out), [c for doc in chunks.values() for c in doc])
        datasets = dict(Counter(x.doc_id.split("/", 1)[0] for x in mixed))
        tracker.summary({f"{name}/labels": c["labels"] for name, c in counts.items()})
    print(f"mix: {len(mixed)} labelled questions ({', '.join(f'{k} {v}' for k, v in datasets.items())}) from "
          f"{len(chunks)} documents -> {config.out}")
    return {"sources": counts, "datasets": datasets}
