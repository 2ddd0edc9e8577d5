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

A source named in ``hold_out`` is split by document (``held_out_by_threshold``: a document's side is fixed by a
hash of its id, so every mix of that file, or of a longer one from a resumed labelling job, draws the same line)
and the mix takes the ``side`` named: the training mix takes ``train``, an
evaluation set of the same sources takes ``held_out`` (e.g. one SQuAD article, a share of the NarrativeQA stories).
The sources named in ``grounded`` take the answer-grounded rule's ranges (``grounded_levels.py``: read off where the
backbone's reply lies, not off every level retrieval returned) in place of the method's; a label it cannot ground is
counted and joins the questions without a label. The sources named in ``unlabelled`` keep their questions without a
label too (after their labelled ones): ``eval planner``'s ``unlabelled`` plans them, and scores them on everything but
the label.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Literal

from overstory.core.config import ConfigError
from overstory.core.records import Chunk, PseudoLabel, read_jsonl, write_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.grounded_levels import ground_labels
from overstory.data_pipeline.hierarchy import load_hierarchies, save_hierarchies, stored_hierarchy_path
from overstory.data_pipeline.splits import held_out_by_threshold


@dataclass(frozen=True)
class LabelMixConfig:
    # name -> label JSONL (its hierarchy stored beside it); required (a default only for `--help`)
    sources: dict[str, str] = field(default_factory=dict)
    out: str = "runs/data/planner_mix/labels.jsonl"
    per_source_limit: int = 0  # at most this many questions per source (0: all)
    # source name -> share of its documents held out; the mix takes `side` of each such split (others whole)
    hold_out: dict[str, float] = field(default_factory=dict)
    side: Literal["train", "held_out"] = "train"
    # sources that also keep their questions without a label (for eval planner's `unlabelled`; e.g. NarrativeQA's
    # unanswered ones, not QASPER's unanswerable ones)
    unlabelled: list[str] = field(default_factory=list)
    # pseudo-label sources whose ranges the answer-grounded rule sets (data_pipeline/grounded_levels.py) instead of the
    # method's (the levels retrieval returned); a label it cannot ground is counted and has no label in the mix
    grounded: list[str] = field(default_factory=list)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if not self.sources:
            raise ConfigError("sources must name at least one label file, e.g. qasper: runs/data/gold_labels/"
                              "qasper_train.jsonl")
        if self.per_source_limit < 0:
            raise ConfigError(f"per_source_limit must be >= 0, got {self.per_source_limit}")
        for key in ("hold_out", "unlabelled", "grounded"):
            unknown = sorted(set(getattr(self, key)) - set(self.sources))
            if unknown:
                raise ConfigError(f"{key}: {', '.join(unknown)} not in sources ({', '.join(self.sources)})")
        bad = [name for name, share in self.hold_out.items() if not 0 < share < 1]
        if bad:
            raise ConfigError(f"hold_out.{bad[0]} must be a share of documents in (0, 1), got {self.hold_out[bad[0]]}")


def source_questions(config: LabelMixConfig, name: str) -> tuple[list[PseudoLabel], int]:
    """A source's questions that the mix takes: its side of the document split when it is held out from, the
    labelled ones (then the others, when ``unlabelled`` names it), at most ``per_source_limit``; and how many labels
    the answer-grounded rule could not range (when ``grounded`` names the source)."""
    path = config.sources[name]
    records = list(read_jsonl(path, PseudoLabel))
    if name in config.hold_out:
        train, held_out = held_out_by_threshold(records, config.hold_out[name])
        records = held_out if config.side == "held_out" else train
    ungrounded = 0
    if name in config.grounded:
        if any(x.source == "gold" for x in records):
            raise ValueError(f"grounded: sources.{name} ({path}) holds gold labels; the answer-grounded rule re-ranges "
                             f"pseudo-labels")
        records, counts = ground_labels(records, load_hierarchies(stored_hierarchy_path(path)))
        ungrounded = counts["ungrounded"]
        # a label the rule cannot ground has no range: here it is a question without a label (`unlabelled` keeps it)
        records = [x if not x.correct or x.level_min else replace(x, correct=False) for x in records]
    labelled = round_robin([x for x in records if x.correct], config.per_source_limit)
    if name not in config.unlabelled:
        return labelled, ungrounded
    room = config.per_source_limit - len(labelled) if config.per_source_limit else 0
    if config.per_source_limit and room <= 0:
        return labelled, ungrounded
    return labelled + round_robin([x for x in records if not x.correct], room), ungrounded


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
            labels, ungrounded = source_questions(config, name)
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
            n_labelled = sum(x.correct for x in labels)
            counts[name] = {"labels": n_labelled, "unlabelled": len(labels) - n_labelled, "documents": len(needed),
                            "duplicates_skipped": len(duplicates), "ungrounded": ungrounded}
            print(f"{name}: {n_labelled} labelled questions"
                  + (f" (answer-grounded ranges; {ungrounded} without one: no retrieved chunk holds the reply)"
                     if name in config.grounded else "")
                  + (f" and {len(labels) - n_labelled} without a label" if name in config.unlabelled else "")
                  + f" from {len(needed)} documents"
                  + (f" ({len(duplicates)} already taken from an earlier source)" if duplicates else ""))
        write_jsonl(config.out, mixed)
        save_hierarchies(stored_hierarchy_path(config.out), [c for doc in chunks.values() for c in doc])
        datasets = dict(Counter(x.doc_id.split("/", 1)[0] for x in mixed))
        tracker.summary({f"{name}/labels": c["labels"] for name, c in counts.items()})
    n_labelled = sum(x.correct for x in mixed)
    print(f"mix: {n_labelled} labelled questions"
          + (f" and {len(mixed) - n_labelled} without a label" if config.unlabelled else "")
          + f" ({', '.join(f'{k} {v}' for k, v in datasets.items())}) from "
          f"{len(chunks)} documents -> {config.out}")
    return {"sources": counts, "datasets": datasets}
