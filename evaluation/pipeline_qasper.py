"""QASPER's side of `overstory eval pipeline`: what a run predicts as evidence (``QasperConfig``), the official
prediction format (the answer and the papers' paragraphs, from the top chunks or the passages the generator cited),
and the files and QASPER metrics the harness writes for each strategy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from overstory.core.config import ConfigError
from overstory.core.records import Document, write_jsonl
from overstory.data_pipeline.qasper import paragraphs_at
from overstory.evaluation.qasper_metrics import Reference, qasper_scores

# QASPER's predicted evidence: the paragraphs of the strategy's top chunks, or those of the passages the generator cites
EVIDENCE_MODES = ("top_chunks", "cited")


@dataclass(frozen=True)
class QasperConfig:
    """What a QASPER run predicts as evidence (configs/eval/pipeline.yaml says why the defaults)."""

    evidence: str = "top_chunks"  # cited: the generator also cites its passages; both evidence files are scored
    evidence_paragraphs: int = 1  # at most this many paragraphs per answer, in rank (or citation) order
    # the official evaluator's --text_evidence_only: references' figure and table evidence left out
    text_evidence_only: bool = False

    def __post_init__(self) -> None:
        if self.evidence not in EVIDENCE_MODES:
            raise ConfigError(f"qasper.evidence: {self.evidence!r}; choose from {', '.join(EVIDENCE_MODES)}")
        if self.evidence_paragraphs < 1:
            raise ConfigError(f"qasper.evidence_paragraphs must be >= 1, got {self.evidence_paragraphs}")



def qasper_predictions(records: Sequence[dict], documents: Sequence[Document], paragraphs: int = 0,
                       cited: bool = False) -> list[dict]:
    """QASPER's official prediction format: one line per question with the answer and, as evidence, the papers'
    paragraphs (verbatim: the evaluator matches paragraph strings exactly) that the top ``recall_k`` evidence chunks
    touch, in rank order, the first ``paragraphs`` of them (0: all). ``cited``: the paragraphs of the passages the
    generator cited instead (``details["citation"]``); an answer whose citation could not be read keeps the top
    chunks' paragraphs (``citation_counts`` counts those)."""
    by_id = {d.id: d for d in documents}
    lines = []
    for record in records:
        if "evidence_spans" not in record:
            raise ConfigError(f"the answer to {record['id']} was saved by an earlier harness, without evidence "
                              "spans; rerun with resume=false to write QASPER's prediction format")
        citation = record["details"].get("citation", {}) if cited else {}
        spans = citation["spans"] if citation.get("status") == "cited" else record["evidence_spans"]
        found: list[str] = []
        for doc_id, start, end in spans:
            found += [p for p in paragraphs_at(by_id[doc_id], [(start, end)]) if p not in found]
        lines.append({"question_id": record["id"], "predicted_answer": record["prediction"],
                      "predicted_evidence": found[:paragraphs] if paragraphs else found})
    return lines


def citation_counts(records: Sequence[dict]) -> dict[str, int] | None:
    """How many answers cited passages that could be read (``cited``, an "unanswerable" answer citing none
    included) and how many fell back to the top chunks (``fallback``: no citation read, a failed request, a strategy
    error); None for a strategy that was never asked to cite (none of its answers carries a citation).

    >>> citation_counts([{"details": {"citation": {"status": "cited"}}}, {"details": {}},
    ...                  {"details": {"citation": {"status": "fallback"}}}])
    {'cited': 1, 'fallback': 2}
    >>> citation_counts([{"details": {"turns": 2}}]) is None
    True
    """
    statuses = [r["details"].get("citation", {}).get("status") for r in records]
    if all(status is None for status in statuses):
        return None
    cited = statuses.count("cited")
    return {"cited": cited, "fallback": len(records) - cited}


def qasper_outputs(name: str, records: Sequence[dict], documents: Sequence[Document],
                   gold: dict[str, list[Reference]], out: Path, settings: QasperConfig) -> dict:
    """Write ``<out>/qasper/<name>.jsonl`` (the top chunks' paragraphs) and, for a strategy that cited its passages,
    ``<out>/qasper/<name>.cited.jsonl``; QASPER's metrics of each, the cited one with its citation counts."""
    folder, limit = out / "qasper", settings.evidence_paragraphs
    ids = [r["id"] for r in records]
    top = qasper_predictions(records, documents, limit)
    write_jsonl(folder / f"{name}.jsonl", top)
    scores = {"top_chunks": qasper_scores(top, gold, ids)}
    counts = citation_counts(records)
    if counts is not None:
        cited = qasper_predictions(records, documents, limit, cited=True)
        write_jsonl(folder / f"{name}.cited.jsonl", cited)
        scores["cited"] = {**qasper_scores(cited, gold, ids), "citations": counts}
    return scores
