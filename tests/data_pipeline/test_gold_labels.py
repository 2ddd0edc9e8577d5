"""Gold granularity labels: hand-checked QASPER questions of the shipped slice (one per label kind), SQuAD's answer
spans, exclusions by reason, agreement with the chunks, the distribution and the job's files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from overstory.core.config import ConfigError, load_config
from overstory.core.records import LEVEL_RANK, PseudoLabel, read_jsonl
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.gold_labels import (
    GoldLabelsConfig,
    label_corpus,
    label_distribution,
    run,
    smallest_holding,
)
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies, load_hierarchies

ROOT = Path(__file__).resolve().parents[2]
QASPER = ROOT / "data" / "qasper"
SQUAD = ROOT / "data" / "squad" / "dev-v2.0-articles.json"


@pytest.fixture(scope="module")
def qasper() -> dict:
    """Labels of the whole QASPER slice (dev and train papers) on the default hierarchy, by question id prefix."""
    documents, questions = load_corpus(CorpusConfig("qasper", str(QASPER)))
    chunks = build_hierarchies(documents, HierarchyConfig())
    labels, excluded = label_corpus(documents, questions, chunks)
    return {"labels": {x.id[:10]: x for x in labels}, "excluded": excluded, "chunks": chunks,
            "documents": {d.id: d for d in documents}, "questions": {q.id[:10]: q for q in questions}}


def test_sentence_to_paragraph(qasper) -> None:
    """1910.01108, "How much time takes the training of DistilBERT?": the evidence is one paragraph ("Data and
    compute power ...") and the annotator highlighted one sentence of it ("DistilBERT was trained on 8 16GB V100
    GPUs for approximately 90 hours."): smallest unit a sentence, all evidence in one paragraph."""
    label = qasper["labels"]["84ee6180d3"]
    assert (label.level_min, label.level_max) == ("sentence", "paragraph")
    assert label.source == "gold" and label.correct and label.gold_level_max == "paragraph"


def test_paragraph_to_paragraph(qasper) -> None:
    """2003.03728, "Which dataset do they evaluate on?": one evidence paragraph, and the highlight is that whole
    paragraph, so no sentence was singled out: paragraph..paragraph."""
    q = qasper["questions"]["fee4984577"]
    raw = json.loads((QASPER / "dev.json").read_text())["2003.03728"]
    answer = next(x for x in raw["qas"] if x["question_id"] == q.id)["answers"][0]["answer"]
    assert answer["highlighted_evidence"] == answer["evidence"] and len(answer["evidence"]) == 1
    label = qasper["labels"]["fee4984577"]
    assert (label.level_min, label.level_max) == ("paragraph", "paragraph")


def test_paragraphs_of_one_subsection(qasper) -> None:
    """1909.06708, "What metric is used to measure translation accuracy?": two whole paragraphs, both in the
    paper's subsection "Experiments ::: Experimental Settings" (which has three): paragraph..subsection, and the
    subsection chunk is that subsection, heading first."""
    label = qasper["labels"]["92fc94a499"]
    assert (label.level_min, label.level_max) == ("paragraph", "subsection")
    holder = next(c for c in qasper["chunks"] if c.level == "subsection" and c.doc_id == label.doc_id
                  and all(c.start <= s.start and s.end <= c.end for s in label.evidence))
    assert holder.text.startswith("Experimental Settings\n\nThe evaluation is on two widely used")


def test_paragraphs_of_one_section(qasper) -> None:
    """1604.05559, "Could you tell me more about the old method?": all five paragraphs of the section "The Popular
    Approximation", which has no subsections; its paragraphs run over more than one 256-token subsection, so only
    the section holds them all: paragraph..section."""
    label = qasper["labels"]["6014c2219d"]
    assert (label.level_min, label.level_max) == ("paragraph", "section")
    doc = qasper["documents"][label.doc_id]
    section = next(h for h in doc.metadata["headings"] if h[1] == "The Popular Approximation")
    assert all(s.start > section[2] for s in label.evidence) and len(label.evidence) == 5


def test_paragraphs_across_sections(qasper) -> None:
    """1607.00167, "What model was used for sentiment analysis?": one paragraph of the Introduction and one of
    "Sentiment Analysis" (highlighted whole, under its heading): only the document holds both."""
    label = qasper["labels"]["813a8156f9"]
    assert (label.level_min, label.level_max) == ("paragraph", "document")
    doc = qasper["documents"][label.doc_id]
    owners = {max(h[1] for h in doc.metadata["headings"] if h[0] == 1 and h[2] < s.start) for s in label.evidence}
    assert len(owners) == 2


def test_sentences_across_sections(qasper) -> None:
    """2003.11528, "What are the types of chinese poetry that are generated?": sentences highlighted in the
    Introduction and in "Model ::: Basic Model": sentence..document."""
    label = qasper["labels"]["1d26335669"]
    assert (label.level_min, label.level_max) == ("sentence", "document")


def test_exclusions_are_counted_by_reason(qasper) -> None:
    """2 unanswerable and 1 figure/table-only question per split of the slice; the rest are labelled."""
    assert dict(qasper["excluded"]) == {"unanswerable": 4, "figure_table_only": 2}
    assert "049415676f" not in qasper["labels"] and "c626637ed1" not in qasper["labels"]
    assert len(qasper["labels"]) + 6 == len(qasper["questions"])


def stripped(text: str, start: int, end: int) -> tuple[int, int]:
    piece = text[start:end]
    return start + len(piece) - len(piece.lstrip()), end - len(piece) + len(piece.rstrip())


def test_labels_agree_with_the_chunks(qasper) -> None:
    """level_max is the smallest level with one chunk holding every evidence span (without its surrounding
    whitespace, as chunks are cut), or level_min when that is larger (a one-sentence paragraph)."""
    for label in qasper["labels"].values():
        text = qasper["documents"][label.doc_id].text
        spans = [stripped(text, s.start, s.end) for s in label.evidence]
        held = [c.level for c in qasper["chunks"]
                if c.doc_id == label.doc_id and all(c.start <= a and b <= c.end for a, b in spans)]
        smallest = min(held, key=LEVEL_RANK.__getitem__)
        assert label.level_max == max(smallest, label.level_min, key=LEVEL_RANK.__getitem__)
        assert LEVEL_RANK[label.level_min] <= LEVEL_RANK[label.level_max]


def test_squad_answer_spans(squad_chunks) -> None:
    """Every SQuAD answer of the shipped articles lies inside one sentence chunk: sentence..sentence; the
    unanswerable ones are excluded."""
    documents, questions = load_corpus("squad", SQUAD)
    labels, excluded = label_corpus(documents, questions, squad_chunks)
    assert dict(excluded) == {"unanswerable": sum(1 for q in questions if not q.answers)}
    assert len(labels) == sum(1 for q in questions if q.answers) == 473
    assert {(x.level_min, x.level_max) for x in labels} == {("sentence", "sentence")}
    first = labels[0]
    assert smallest_holding(first.evidence, squad_chunks) == "sentence"


def test_distribution() -> None:
    make = lambda low, high: PseudoLabel("q", "d", "?", [], low, high, True, 0, [], [], "", "", "gold")  # noqa: E731
    labels = [make("sentence", "paragraph")] * 3 + [make("paragraph", "document")]
    dist = label_distribution(labels, Counter(unanswerable=2))
    assert dist["labelled"] == 4 and dist["excluded"] == {"unanswerable": 2}
    assert dist["ranges"] == {"sentence..paragraph": {"count": 3, "fraction": 0.75},
                              "paragraph..document": {"count": 1, "fraction": 0.25}}
    assert dist["level_max"] == {"paragraph": {"count": 3, "fraction": 0.75},
                                 "document": {"count": 1, "fraction": 0.25}}


def test_job_writes_labels_hierarchy_distribution_and_plot(tmp_path: Path) -> None:
    config = load_config(GoldLabelsConfig, ROOT / "configs" / "data" / "gold_labels.yaml",
                         [f"out={tmp_path}", "tracking.backend=none",
                          f"corpora.qasper_train.path={QASPER / 'train.json'}",
                          f"corpora.qasper_dev.path={QASPER / 'dev.json'}", f"corpora.squad.path={SQUAD}"])
    distribution = run(config)
    assert list(distribution) == ["qasper_train", "qasper_dev", "squad"]
    assert json.loads((tmp_path / "distribution.json").read_text()) == distribution
    assert (tmp_path / "distribution.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labels = list(read_jsonl(tmp_path / "qasper_dev.jsonl", PseudoLabel))
    assert len(labels) == distribution["qasper_dev"]["labelled"] == 13
    assert all(x.source == "gold" and x.correctness == "gold" for x in labels)
    chunk_ids = {c.doc_id for c in load_hierarchies(tmp_path / "qasper_dev.hierarchy.jsonl")}
    assert {x.doc_id for x in labels} <= chunk_ids
    assert distribution["qasper_train"]["excluded"] == {"figure_table_only": 1, "unanswerable": 2}
    assert sum(r["count"] for r in distribution["squad"]["ranges"].values()) == 473


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="corpora.hp.kind: 'hotpotqa' has no gold evidence in the text"):
        GoldLabelsConfig(corpora={"hp": CorpusConfig("hotpotqa", "data/hotpotqa")})
    with pytest.raises(ConfigError, match="corpora must name at least one corpus"):
        GoldLabelsConfig(corpora={})
