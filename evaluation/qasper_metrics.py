"""QASPER's official metrics: Answer F1 (overall and by answer type) and Evidence F1, as the paper defines them.

Written from the metric's published definition (Dasigi et al., *A Dataset of Information-Seeking Questions and
Answers Anchored in Research Papers*, NAACL 2021, section 4) and the documented behaviour of QASPER's evaluator;
no code of the QASPER repository is in it. What it does, as the evaluator does:

- every annotator's answer of a question is a reference: ``Unanswerable`` (type ``none``, no evidence), the
  extractive spans joined by ", " (``extractive``), the free-form answer (``abstractive``) or "Yes" / "No"
  (``boolean``), with that annotator's evidence strings (paragraphs, or "FLOAT SELECTED: ..." figures and
  tables, which ``text_evidence_only`` leaves out as the evaluator's flag of that name does; off by default, as
  there);
- Answer F1 of a question is the best token F1 of the prediction against any reference, after SQuAD's
  normalisation (lower case, no punctuation, no articles, single spaces); the question counts under the answer
  type of the reference that gave that best score (the first one among equals); a prediction of "Unanswerable"
  scores 1 against an unanswerable reference like any other string that matches;
- Evidence F1 of a question is the best F1, over references, of the predicted paragraph strings against the
  reference's: the strings both hold (compared exactly, each once) over the lengths of the two lists; an empty
  prediction against an empty reference (an unanswerable one) scores 1, an empty prediction against evidence 0;
- the figures are means over questions; a question without a prediction scores 0 on both and is counted as
  missing.

The harness (``overstory eval pipeline``) reads the references from the official JSON its corpus section names
(``official_papers``), scores each prediction file it writes, and adds 95% bootstrap intervals.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overstory.data_pipeline.corpora import CorpusConfig
from overstory.data_pipeline.corpus_files import SPLITS, CorpusError, read_json, read_json_lines
from overstory.data_pipeline.hub import hub_name, hub_rows
from overstory.data_pipeline.qasper import FLOAT_PREFIX, HUB_SPLITS, LOCAL_HINT, official_paper
from overstory.retrieval.metrics import bootstrap_interval, mean, normalize_answer

ANSWER_TYPES = ("extractive", "abstractive", "boolean", "none")


@dataclass(frozen=True)
class Reference:
    """One annotator's answer to a question, as the evaluator reads it."""

    answer: str
    evidence: tuple[str, ...]
    type: str


def answer_f1(prediction: str, reference: str) -> float:
    """Token F1 of two normalised strings; 0 when they share no token.

    >>> answer_f1("the BERT model", "BERT"), answer_f1("Unanswerable", "unanswerable."), answer_f1("", "Yes")
    (0.6666666666666666, 1.0, 0.0)
    """
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(reference).split()
    common = sum((Counter(predicted) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def evidence_f1(predicted: Sequence[str], reference: Sequence[str]) -> float:
    """F1 of predicted paragraph strings against a reference's (exact strings); both empty scores 1.

    >>> evidence_f1(["p1", "p2"], ["p2"]), evidence_f1([], []), evidence_f1([], ["p1"]), evidence_f1(["p1"], [])
    (0.6666666666666666, 1.0, 0.0, 0.0)
    """
    if not predicted and not reference:
        return 1.0
    same = len(set(predicted) & set(reference))
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(reference)  # over the lists, as the evaluator divides
    return 2 * precision * recall / (precision + recall)


def reference_of(answer: Mapping[str, Any], text_evidence_only: bool = False) -> Reference:
    """One annotation's ``answer`` record (official layout) as a Reference.

    >>> reference_of({"unanswerable": False, "extractive_spans": ["BERT", "ELMo"], "free_form_answer": "",
    ...               "yes_no": None, "evidence": ["p1", "FLOAT SELECTED: Table 1"]}, text_evidence_only=True)
    Reference(answer='BERT, ELMo', evidence=('p1',), type='extractive')
    """
    if answer["unanswerable"]:
        return Reference("Unanswerable", (), "none")
    if answer["extractive_spans"]:
        text, kind = ", ".join(answer["extractive_spans"]), "extractive"
    elif answer["free_form_answer"]:
        text, kind = answer["free_form_answer"], "abstractive"
    elif answer["yes_no"] is not None:
        text, kind = ("Yes" if answer["yes_no"] else "No"), "boolean"
    else:
        raise CorpusError(f"an annotation has no answer (not unanswerable, no spans, free form or yes/no): {answer}")
    evidence = [e for e in answer["evidence"] if not (text_evidence_only and FLOAT_PREFIX in e)]
    return Reference(text, tuple(evidence), kind)


def gold_references(papers: Iterable[Mapping[str, Any]], text_evidence_only: bool = False
                    ) -> dict[str, list[Reference]]:
    """Every question's references, by question id, from papers in the official layout."""
    return {str(qa["question_id"]): [reference_of(a["answer"], text_evidence_only) for a in qa["answers"]]
            for paper in papers for qa in paper["qas"]}


def score_question(answer: str, evidence: Sequence[str], references: Sequence[Reference]) -> dict[str, Any]:
    """A question's Answer F1 (best over references), the type it counts under, and its Evidence F1.

    >>> refs = [Reference("No", ("p1",), "boolean"), Reference("Unanswerable", (), "none")]
    >>> score_question("unanswerable", [], refs)
    {'answer_f1': 1.0, 'type': 'none', 'evidence_f1': 1.0}
    """
    scores = [answer_f1(answer, r.answer) for r in references]
    best = max(range(len(references)), key=lambda i: scores[i])  # the first of equal scores, as a stable sort
    return {"answer_f1": scores[best], "type": references[best].type,
            "evidence_f1": max(evidence_f1(evidence, r.evidence) for r in references)}


def qasper_scores(predictions: Sequence[Mapping[str, Any]], gold: Mapping[str, Sequence[Reference]],
                  question_ids: Sequence[str]) -> dict[str, Any]:
    """Answer F1 (overall, by type) and Evidence F1 over ``question_ids`` of predictions in the official format
    (``question_id``, ``predicted_answer``, ``predicted_evidence``), each with its 95% bootstrap interval and,
    by type, the number of questions; a question without a prediction scores 0 and is counted in ``missing``."""
    predicted = {p["question_id"]: p for p in predictions}
    unknown = [q for q in question_ids if q not in gold]
    if unknown:
        raise CorpusError(f"no QASPER reference for question {unknown[0]} (and {len(unknown) - 1} more) in the "
                          "official JSON read: score against the file the questions came from")
    per_question = []
    for qid in question_ids:
        if qid not in predicted:
            per_question.append({"answer_f1": 0.0, "type": None, "evidence_f1": 0.0})
            continue
        p = predicted[qid]
        per_question.append(score_question(p["predicted_answer"], p["predicted_evidence"], gold[qid]))
    answers, evidence = [s["answer_f1"] for s in per_question], [s["evidence_f1"] for s in per_question]
    by_type = {}
    for kind in ANSWER_TYPES:
        values = [s["answer_f1"] for s in per_question if s["type"] == kind]
        by_type[kind] = {"answer_f1": mean(values), "n": len(values),  # None for a type no question had
                         "ci95": bootstrap_interval(values)}
    return {"answer_f1": mean(answers), "answer_f1_ci95": bootstrap_interval(answers), "answer_f1_by_type": by_type,
            "evidence_f1": mean(evidence), "evidence_f1_ci95": bootstrap_interval(evidence),
            "missing": sum(1 for q in question_ids if q not in predicted), "n_questions": len(question_ids)}


def official_papers(corpus: CorpusConfig) -> Iterator[Mapping[str, Any]]:
    """The papers in the official layout at the corpus section's path: an official ``dev.json`` style file, a
    folder of them (``corpus.split``, or every split found), a hub-layout ``.jsonl`` file or ``hub:allenai/qasper``
    (rows converted with the loader's ``official_paper``)."""
    path = Path(corpus.path)
    name = hub_name(path)
    if name is not None:
        for split, row in hub_rows(name, HUB_SPLITS[corpus.split] if corpus.split else "", LOCAL_HINT):
            yield official_paper(row, f"{name}[{split}]")[1]
        return
    for file in _official_files(path, corpus.split):
        if file.suffix == ".jsonl":
            yield from (official_paper(row, f"{file}:{n}")[1] for n, row in read_json_lines(file))
            continue
        raw = read_json(file)
        if not isinstance(raw, dict):
            raise CorpusError(f"{file}: expected QASPER's object keyed by arXiv id, got {type(raw).__name__}")
        yield from raw.values()


def _official_files(path: Path, split: str) -> list[Path]:
    """The files a QASPER path names: itself, or a folder's split files under either of their names."""
    if not path.is_dir():
        return [path]
    names = [split] if split else list(SPLITS["qasper"])
    files = [f for s in names for f in (path / f"{s}.json", path / f"qasper-{s}-v0.3.json") if f.is_file()]
    if not files:
        raise CorpusError(f"{path}: no QASPER split file for {', '.join(names)} (dev.json or qasper-dev-v0.3.json)")
    return files
