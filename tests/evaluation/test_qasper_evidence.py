"""QASPER's predicted evidence on a real shipped paper: the top chunks' paragraphs up to a number, in rank order,
verbatim as the official references hold them; the cited passages' paragraphs, with a reply whose citation could not
be read falling back to the top chunks and counted; and the cited path through the harness with the built-in
SmolLM2 on two questions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.core.records import Chunk
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.evaluation.pipeline_qasper import citation_counts, qasper_predictions
from overstory.evaluation.qasper_metrics import gold_references, official_papers, qasper_scores
from tests.conftest import ROOT

CONFIG = str(ROOT / "configs/eval/pipeline.yaml")
QASPER_DEV = CorpusConfig("qasper", str(ROOT / "data/qasper"), split="dev")


def _spans(*chunks: Chunk) -> list[list]:
    return [[c.doc_id, c.start, c.end] for c in chunks]


def test_top_chunks_and_cited_evidence_on_a_real_paper() -> None:
    """A question whose first annotator gave one paragraph as evidence: a sentence of that paragraph ranked first,
    then a section of the paper holding no annotator's evidence. One paragraph predicted scores Evidence F1 1; every
    paragraph the two chunks touch (k of them, one right) scores 2 / (k + 1) against the first annotator (P 1/k,
    R 1) and less against any other (2 / (k + e) for e paragraphs holding it, 0 without it). Citing the section gives
    its first paragraph instead."""
    documents, questions = load_corpus(QASPER_DEV)
    gold = gold_references(official_papers(QASPER_DEV))
    by_doc = {d.id: d for d in documents}
    question, paragraph = next((q, refs[0].evidence[0]) for q in questions for refs in [gold[q.id]]
                               if len(refs[0].evidence) == 1
                               and refs[0].evidence[0] in by_doc[q.metadata["doc_id"]].text)
    evidence = {e for r in gold[question.id] for e in r.evidence}
    paper = by_doc[question.metadata["doc_id"]]
    chunks = build_hierarchies([paper], HierarchyConfig())
    start = paper.text.index(paragraph)
    sentence = next(c for c in chunks if c.level == "sentence" and start <= c.start < start + len(paragraph))

    def inside(section: Chunk) -> list[str]:
        return [paper.text[a:b] for a, b in paper.metadata["paragraph_spans"]
                if section.start <= a and b <= section.end]

    section = next(c for c in chunks
                   if c.level == "section" and len(inside(c)) >= 2 and not evidence & set(inside(c)))
    section_paragraphs = inside(section)
    record = {"id": question.id, "prediction": "x", "evidence_spans": _spans(sentence, section), "details": {}}

    one = qasper_predictions([record], documents, paragraphs=1)
    assert one[0]["predicted_evidence"] == [paragraph]  # verbatim: the official reference's own string
    every = qasper_predictions([record], documents)[0]["predicted_evidence"]
    assert every == [paragraph, *section_paragraphs]
    assert qasper_scores(one, gold, [question.id])["evidence_f1"] == 1.0
    k = len(every)
    assert qasper_scores([{**one[0], "predicted_evidence": every}], gold, [question.id])["evidence_f1"] == \
        pytest.approx(2 / (k + 1))

    cited = {**record, "details": {"citation": {"status": "cited", "passages": [2], "spans": _spans(section)}}}
    unread = {**record, "id": "q2", "details": {"citation": {"status": "fallback", "passages": [], "spans": []}}}
    lines = qasper_predictions([cited, unread], documents, paragraphs=1, cited=True)
    assert [line["predicted_evidence"] for line in lines] == [section_paragraphs[:1], [paragraph]]
    assert citation_counts([cited, unread, {"details": {}}]) == {"cited": 1, "fallback": 2}


def test_cited_evidence_through_the_harness_with_smollm2(tmp_path: Path) -> None:
    """Two questions of the first paper (the only one loaded, to keep the index small), naive asked to cite and the
    floor beside it: both evidence files of naive are written and scored, every answer is either cited or counted
    as a fallback, and the floor, asked nothing, has one file."""
    assert main(["eval", "pipeline", "--config", CONFIG, f"out={tmp_path}", "tracking.backend=none",
                 "--strategies", "naive,bm25_floor", "--data", "qasper", "corpus.limit_docs=1", "limit_questions=2",
                 "qasper.evidence=cited"]) == 0
    report = json.loads((tmp_path / "metrics.json").read_text())
    naive, floor = report["strategies"]["naive"]["qasper"], report["strategies"]["bm25_floor"]["qasper"]
    counts = naive["cited"]["citations"]
    assert counts["cited"] + counts["fallback"] == 2 == naive["cited"]["n_questions"]
    records = [json.loads(line) for line in (tmp_path / "predictions" / "naive.jsonl").open()]
    assert [r["details"]["citation"]["status"] for r in records].count("cited") == counts["cited"]
    assert json.loads((tmp_path / "predictions" / "naive.settings.json").read_text())["answer"]["cite"] is True
    top = [json.loads(line) for line in (tmp_path / "qasper" / "naive.jsonl").open()]
    cited = [json.loads(line) for line in (tmp_path / "qasper" / "naive.cited.jsonl").open()]
    for record, plain, with_citation in zip(records, top, cited, strict=True):
        assert len(plain["predicted_evidence"]) == 1  # qasper.evidence_paragraphs: 1
        if record["details"]["citation"]["status"] == "fallback":
            assert with_citation["predicted_evidence"] == plain["predicted_evidence"]
    assert "cited" not in floor and not (tmp_path / "qasper" / "bm25_floor.cited.jsonl").exists()
    assert 0.0 <= floor["top_chunks"]["evidence_f1"] <= 1.0 and floor["top_chunks"]["n_questions"] == 2
    table = (tmp_path / "table.md").read_text()
    assert f"(fallback {counts['fallback']}/2)" in table and "| bm25_floor |" in table
