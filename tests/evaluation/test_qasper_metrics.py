"""QASPER's official metrics on hand-made cases whose values are worked out by hand in each comment, and the
references read from the shipped official JSON agreeing with the loader's reading of the same annotations."""

from __future__ import annotations

import pytest

from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.corpus_files import CorpusError
from overstory.evaluation.qasper_metrics import (
    Reference,
    answer_f1,
    evidence_f1,
    gold_references,
    official_papers,
    qasper_scores,
    reference_of,
    score_question,
)
from tests.conftest import ROOT

QASPER_DEV = CorpusConfig("qasper", str(ROOT / "data/qasper"), split="dev")


def _annotation(**answer) -> dict:
    blank = {"unanswerable": False, "extractive_spans": [], "free_form_answer": "", "yes_no": None, "evidence": []}
    return {**blank, **answer}


def test_each_answer_type_is_read_and_scored_after_squad_normalisation() -> None:
    extractive = reference_of(_annotation(extractive_spans=["BERT", "ELMo"], evidence=["p1"]))
    abstractive = reference_of(_annotation(free_form_answer="model trained"))
    boolean = reference_of(_annotation(yes_no=False))
    none = reference_of(_annotation(unanswerable=True, evidence=["ignored"]))
    assert extractive == Reference("BERT, ELMo", ("p1",), "extractive")
    assert (abstractive.type, boolean, none) == ("abstractive", Reference("No", (), "boolean"),
                                                 Reference("Unanswerable", (), "none"))
    # "BERT" against "bert elmo": precision 1/1, recall 1/2 -> F1 2/3
    assert score_question("BERT", [], [extractive])["answer_f1"] == pytest.approx(2 / 3)
    # "model is trained" (article and full stop dropped) against "model trained": P 2/3, R 2/2 -> F1 0.8
    assert answer_f1("The model is trained.", abstractive.answer) == pytest.approx(0.8)
    assert answer_f1("no", boolean.answer) == 1.0 and answer_f1("Yes", boolean.answer) == 0.0
    # unanswerable: the string matches, and empty evidence against the empty reference scores 1, any evidence 0
    assert score_question("Unanswerable", [], [none]) == {"answer_f1": 1.0, "type": "none", "evidence_f1": 1.0}
    assert score_question("unanswerable", ["p1"], [none])["evidence_f1"] == 0.0
    assert answer_f1("", "Yes") == 0.0 and evidence_f1([], ["p1"]) == 0.0


def test_the_best_reference_decides_the_score_and_the_type() -> None:
    refs = [Reference("BERT", ("p1", "p2"), "extractive"), Reference("they use BERT and ELMo", ("p3",), "abstractive")]
    # "bert and elmo": against "bert" P 1/3, R 1 -> 0.5; against "they use bert and elmo" P 3/3, R 3/5 -> 0.75
    scored = score_question("BERT and ELMo", ["p1"], refs)
    assert scored["answer_f1"] == pytest.approx(0.75) and scored["type"] == "abstractive"
    # evidence ["p1"]: against (p1, p2) P 1, R 1/2 -> 2/3; against (p3) 0 -> best 2/3
    assert scored["evidence_f1"] == pytest.approx(2 / 3)
    # equal answer scores: the first reference's type counts
    tie = score_question("Yes", [], [Reference("Yes", (), "boolean"), Reference("yes", (), "abstractive")])
    assert tie["type"] == "boolean"
    assert evidence_f1(["p1", "p2", "p3"], ["p2", "p4"]) == pytest.approx(0.4)  # P 1/3, R 1/2 -> 2/5


def test_figure_and_table_evidence_is_left_out_only_when_asked() -> None:
    annotation = _annotation(yes_no=True, evidence=["FLOAT SELECTED: Table 2: Results", "p7"])
    assert reference_of(annotation).evidence == ("FLOAT SELECTED: Table 2: Results", "p7")
    assert reference_of(annotation, text_evidence_only=True).evidence == ("p7",)
    with pytest.raises(CorpusError, match="has no answer"):
        reference_of(_annotation())


def test_the_means_by_type_and_a_missing_prediction() -> None:
    gold = {"q1": [Reference("BERT", ("p1",), "extractive")], "q2": [Reference("Yes", ("p2",), "boolean")],
            "q3": [Reference("Unanswerable", (), "none")]}
    predictions = [{"question_id": "q1", "predicted_answer": "BERT", "predicted_evidence": ["p1", "p9"]},
                   {"question_id": "q2", "predicted_answer": "No", "predicted_evidence": ["p2"]}]
    scores = qasper_scores(predictions, gold, ["q1", "q2", "q3"])
    # answers 1, 0 and 0 (q3 missing); evidence 2/3 (P 1/2, R 1), 1 and 0 (missing)
    assert scores["answer_f1"] == pytest.approx(1 / 3) and scores["evidence_f1"] == pytest.approx(5 / 9)
    assert scores["missing"] == 1 and scores["n_questions"] == 3
    by_type = scores["answer_f1_by_type"]
    assert by_type["extractive"] == {"answer_f1": 1.0, "n": 1, "ci95": (1.0, 1.0)}
    assert by_type["boolean"]["answer_f1"] == 0.0 and by_type["none"] == {"answer_f1": None, "n": 0, "ci95": None}
    low, high = scores["answer_f1_ci95"]
    assert 0.0 <= low < 1 / 3 < high <= 1.0
    with pytest.raises(CorpusError, match="no QASPER reference for question q4"):
        qasper_scores(predictions, gold, ["q4"])


def test_references_from_the_official_json_agree_with_the_loader() -> None:
    """Every shipped dev question: one reference per annotator, with the loader's answer form and reference string,
    and the evidence strings of the official file itself."""
    gold = gold_references(official_papers(QASPER_DEV))
    _, questions = load_corpus(QASPER_DEV)
    assert len(questions) == 16 and set(gold) == {q.id for q in questions}
    for question in questions:
        annotations = question.metadata["annotations"]
        assert [(r.type, r.answer) for r in gold[question.id]] == [(a["form"], a["reference"]) for a in annotations]
    assert sum(1 for refs in gold.values() for r in refs if r.type == "none" and not r.evidence) >= 2
    assert any(e.startswith("FLOAT SELECTED") for refs in gold.values() for r in refs for e in r.evidence)
