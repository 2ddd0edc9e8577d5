"""`overstory data gold-labels`: the planner's granularity labels read off annotated evidence.

    overstory data gold-labels --config configs/data/gold_labels.yaml

Gold label of a question = ``(level_min, level_max)``: the level of its smallest evidence unit, and the
smallest level one of whose chunks holds all of its evidence. Both are computed against the hierarchy
built for the document (``hierarchy.py``, the chunks the planner will choose among), so that labels and
chunks agree. Rules per dataset:

- QASPER (the primary annotation, see ``qasper.py``): ``level_min`` is ``sentence`` when the annotator
  highlighted sentences (``metadata["sentence_evidence"]``), else ``paragraph``; ``level_max`` is the
  smallest level with one chunk holding every evidence paragraph and highlighted sentence. Excluded,
  and counted by reason: ``unanswerable``; ``figure_table_only`` (the evidence is only figures or
  tables, which are not in the text); ``evidence_not_found`` (some evidence text was not found, so the
  scope is unknown); ``no_text_evidence`` (answered without evidence, or only a section heading).
- SQuAD: ``level_min`` is ``sentence`` (the answer is a span inside one); ``level_max`` the smallest level
  with a chunk holding the answer span. Unanswerable questions are excluded.

``level_max`` is never below ``level_min`` (a one-sentence paragraph is held by its sentence chunk, yet its
smallest unit is the paragraph). Spans are compared without their surrounding whitespace, as chunks are.

The job writes, per corpus, ``<out>/<name>.jsonl`` (``PseudoLabel`` records with ``source: "gold"``,
``correct: true``, ``correctness: "gold"`` and the gold levels in both level fields) and beside it the
hierarchy the labels refer to (``<name>.hierarchy.jsonl``), then ``distribution.json`` (counts and
fractions of each ``(level_min, level_max)`` per corpus, exclusions by reason) and ``distribution.png``.
Labels are deterministic and cheap, so a rerun rewrites the files rather than appending.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from overstory.core.config import ConfigError
from overstory.core.plots import plt, save_figure
from overstory.core.records import (
    LEVEL_RANK,
    LEVELS,
    Chunk,
    Document,
    PseudoLabel,
    QAExample,
    Span,
    write_jsonl,
)
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import (
    HierarchyConfig,
    build_hierarchies,
    save_hierarchies,
    stored_hierarchy_path,
)

GOLD_KINDS = ("qasper", "squad")  # the corpora whose questions mark their evidence in the text


@dataclass(frozen=True)
class GoldLabelsConfig:
    """`overstory data gold-labels`: which corpora (name -> corpus), how to chunk them, where to write."""

    # name -> corpus; required (a default of {} only because `--help` cannot yet describe a required mapping)
    corpora: dict[str, CorpusConfig] = field(default_factory=dict)
    out: str = "runs/data/gold_labels"
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if not self.corpora:
            raise ConfigError("corpora must name at least one corpus, e.g. qasper_dev: {kind: qasper, path: ...}")
        for name, corpus in self.corpora.items():
            if corpus.kind not in GOLD_KINDS:
                raise ConfigError(f"corpora.{name}.kind: {corpus.kind!r} has no gold evidence in the text; "
                                  f"gold labels come from {', '.join(GOLD_KINDS)}")
        if not self.out:
            raise ConfigError("out must name the folder to write, e.g. runs/data/gold_labels")


def _strip(text: str, span: Span) -> Span:
    start, end = span.start, span.end
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return Span(span.doc_id, start, end)


def smallest_holding(spans: Sequence[Span], chunks: Iterable[Chunk]) -> str:
    """The smallest level with one chunk holding every span (``document`` if none smaller does).

    >>> chunks = [Chunk("s0", "d", "sentence", "", "p0", [], 0, 10, 1),
    ...           Chunk("p0", "d", "paragraph", "", None, [], 0, 40, 1)]
    >>> smallest_holding([Span("d", 2, 5)], chunks), smallest_holding([Span("d", 2, 5), Span("d", 20, 25)], chunks)
    ('sentence', 'paragraph')
    """
    best = "document"
    for chunk in chunks:
        if LEVEL_RANK[chunk.level] < LEVEL_RANK[best] and all(
                chunk.doc_id == s.doc_id and chunk.start <= s.start and s.end <= chunk.end for s in spans):
            best = chunk.level
    return best


def exclusion(question: QAExample) -> str | None:
    """Why a question gets no gold label (a reason named in the module docstring), or None."""
    meta = question.metadata
    if question.dataset == "squad":
        return "unanswerable" if not question.evidence else None
    if meta["unanswerable"]:
        return "unanswerable"
    if meta["figure_table_only"]:
        return "figure_table_only"
    if meta["annotations"][0]["not_found"]:
        return "evidence_not_found"
    if not question.evidence and not meta["sentence_evidence"]:
        return "no_text_evidence"
    return None


def gold_label(question: QAExample, doc: Document, chunks: Sequence[Chunk]) -> PseudoLabel:
    """The gold label of a question ``exclusion`` lets through, as a ``PseudoLabel`` with ``source="gold"``."""
    if question.dataset == "qasper":
        sentences = [Span(doc.id, s, e) for s, e in question.metadata["sentence_evidence"]]
        spans = sorted({*question.evidence, *sentences}, key=lambda s: (s.start, s.end))
        level_min = "sentence" if sentences else "paragraph"
    elif question.dataset == "squad":
        spans, level_min = list(question.evidence), "sentence"
    else:
        raise ValueError(f"question {question.id}: no gold label rule for {question.dataset!r}; "
                         f"gold labels come from {', '.join(GOLD_KINDS)}")
    holding = smallest_holding([_strip(doc.text, s) for s in spans], chunks)
    level_max = max(holding, level_min, key=LEVEL_RANK.__getitem__)
    return PseudoLabel(
        id=question.id, doc_id=doc.id, question=question.question, answers=question.answers,
        level_min=level_min, level_max=level_max, correct=True, attempts=0, retrieved_ids=[], retrieved_levels=[],
        answer="", backbone="", correctness="gold", gold_level_min=level_min, gold_level_max=level_max,
        evidence=spans, source="gold")


def label_corpus(documents: Sequence[Document], questions: Iterable[QAExample],
                 chunks: Sequence[Chunk]) -> tuple[list[PseudoLabel], Counter]:
    """Gold labels of every question that gets one, and the count of the others by reason."""
    docs = {d.id: d for d in documents}
    by_doc: dict[str, list[Chunk]] = {}
    for chunk in chunks:
        by_doc.setdefault(chunk.doc_id, []).append(chunk)
    labels, excluded = [], Counter()
    for question in questions:
        doc_id = question.metadata["doc_id"]
        reason = "document_skipped" if doc_id not in docs else exclusion(question)
        if reason:
            excluded[reason] += 1
        else:
            labels.append(gold_label(question, docs[doc_id], by_doc[doc_id]))
    return labels, excluded


def label_distribution(labels: Sequence[PseudoLabel], excluded: Counter | None = None) -> dict:
    """Counts and fractions (of the labelled questions) of each ``level_min..level_max`` range, of each
    level_min and level_max alone, and the exclusions by reason.

    >>> l = PseudoLabel("q", "d", "?", [], "sentence", "paragraph", True, 0, [], [], "", "", "gold")
    >>> label_distribution([l, l])["ranges"]
    {'sentence..paragraph': {'count': 2, 'fraction': 1.0}}
    """
    def table(counts: Counter, order: list[str]) -> dict:
        return {key: {"count": counts[key], "fraction": round(counts[key] / len(labels), 4)}
                for key in order if counts[key]}

    ranges = [f"{a}..{b}" for a in LEVELS for b in LEVELS if LEVEL_RANK[a] <= LEVEL_RANK[b]]
    return {
        "labelled": len(labels),
        "excluded": dict(sorted((excluded or Counter()).items())),
        "ranges": table(Counter(f"{x.level_min}..{x.level_max}" for x in labels), ranges),
        "level_min": table(Counter(x.level_min for x in labels), list(LEVELS)),
        "level_max": table(Counter(x.level_max for x in labels), list(LEVELS)),
    }


def plot_distribution(distribution: dict[str, dict], path: str | Path) -> Path:
    """Grouped bars: the fraction of labelled questions in each range, one colour per corpus."""
    ranges = [r for r in (f"{a}..{b}" for a in LEVELS for b in LEVELS if LEVEL_RANK[a] <= LEVEL_RANK[b])
              if any(r in d["ranges"] for d in distribution.values())]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(ranges) + 2), 4.5))
    width = 0.8 / max(len(distribution), 1)
    for i, (name, dist) in enumerate(distribution.items()):
        xs = [j + (i - (len(distribution) - 1) / 2) * width for j in range(len(ranges))]
        ax.bar(xs, [dist["ranges"].get(r, {}).get("fraction", 0.0) for r in ranges], width=width,
               label=f"{name} ({dist['labelled']} labelled)")
    ax.set_xticks(range(len(ranges)))
    ax.set_xticklabels([r.replace("..", "..\n") for r in ranges])
    ax.set_ylabel("fraction of labelled questions")
    ax.set_title("gold granularity labels (level_min..level_max)")
    ax.legend()
    return save_figure(fig, path)


def run(config: GoldLabelsConfig) -> dict[str, dict]:
    """Label every configured corpus; returns the distribution per corpus (also written as JSON and PNG)."""
    out = Path(config.out)
    distribution = {}
    with start_run(config.tracking, "data gold-labels", config) as tracker:
        for name, corpus in config.corpora.items():
            documents, questions = load_corpus(corpus)
            chunks = build_hierarchies(documents, config.hierarchy)
            labels, excluded = label_corpus(documents, questions, chunks)
            path = out / f"{name}.jsonl"
            write_jsonl(path, labels)
            save_hierarchies(stored_hierarchy_path(path), chunks)
            distribution[name] = label_distribution(labels, excluded)
            print(f"gold labels {name}: {len(labels)} labelled, excluded {dict(excluded)} -> {path}")
        (out / "distribution.json").write_text(json.dumps(distribution, indent=2) + "\n")
        plot_distribution(distribution, out / "distribution.png")
        tracker.summary({f"{name}/labelled": d["labelled"] for name, d in distribution.items()})
    for name, dist in distribution.items():
        print(name, ", ".join(f"{r} {v['count']} ({v['fraction']:.1%})" for r, v in dist["ranges"].items()))
    print(f"-> {out / 'distribution.json'}, {out / 'distribution.png'}")
    return distribution
