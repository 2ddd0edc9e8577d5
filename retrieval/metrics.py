"""QA and retrieval metrics: pure functions, SQuAD-style answer normalisation.

They live below every job that judges answers: pseudo-labelling, R_QA in training, and the evaluations.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from functools import cache

import numpy as np
from scipy.stats import bootstrap

from overstory.core.records import Chunk, Span

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


@cache
def _rouge_scorer():
    """Google's ROUGE-L scorer, made on first use: ``rouge_score`` imports nltk (about 4 s on 2 cores), which every
    process importing these metrics paid, a Ray worker or a training rank that never scores NarrativeQA too."""
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"])


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and articles, squeeze spaces (the official SQuAD script).

    >>> normalize_answer("The  Eiffel Tower!")
    'eiffel tower'
    """
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised gold answer.

    An unanswerable question (no answers) is matched by an empty prediction.

    >>> exact_match("the Normans", ["Normans"]), exact_match("Paris", ["London"])
    (1.0, 0.0)
    """
    if not answers:
        return float(normalize_answer(prediction) == "")
    return float(any(normalize_answer(prediction) == normalize_answer(a) for a in answers))


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    """Best token-overlap F1 against the gold answers.

    >>> round(token_f1("in northern France", ["France"]), 3)
    0.5
    """
    if not answers:
        return exact_match(prediction, answers)
    pred = normalize_answer(prediction).split()
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if common == 0:
            continue
        precision, recall = common / len(pred), common / len(gold)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def contains_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when a normalised gold answer occurs inside the normalised prediction (lenient EM).

    >>> contains_match("It was Barnaby Joyce.", ["Barnaby Joyce"])
    1.0
    """
    pred = f" {normalize_answer(prediction)} "
    return float(any(f" {normalize_answer(a)} " in pred for a in answers if normalize_answer(a)))


def rouge_l(prediction: str, answers: Sequence[str]) -> float | None:
    """Best ROUGE-L F-measure against the gold answers (Google's ``rouge-score``, the implementation NarrativeQA
    results are reported with); None for an unanswerable question (no gold text to compare).

    >>> round(rouge_l("the cat sat on the mat", ["a cat sat on a mat", "dogs"]), 3)
    0.667
    """
    if not answers:
        return None
    return max(_rouge_scorer().score(answer, prediction)["rougeL"].fmeasure for answer in answers)


def covers(chunk: Chunk, span: Span) -> bool:
    """True when the chunk overlaps the evidence span (same document, shared characters).

    >>> c = Chunk("c", "d", "sentence", "x" * 10, None, [], 10, 20, 3)
    >>> covers(c, Span("d", 15, 30)), covers(c, Span("d", 20, 25)), covers(c, Span("e", 12, 14))
    (True, False, False)
    """
    return chunk.doc_id == span.doc_id and chunk.start < span.end and span.start < chunk.end


def recall_at_k(retrieved: Sequence[Chunk], evidence: Sequence[Span], k: int) -> float | None:
    """Fraction of evidence spans reached by the top-k chunks; None when there is no evidence
    (unanswerable questions are left out of the mean rather than counted as 0 or 1).

    >>> ev = [Span("a", 0, 5), Span("b", 0, 5)]
    >>> recall_at_k([Chunk("x", "a", "paragraph", "", None, [], 0, 9, 1)], ev, 5)
    0.5
    """
    if not evidence:
        return None
    top = retrieved[:k]
    return sum(any(covers(c, span) for c in top) for span in evidence) / len(evidence)


def mean(values: Sequence[float | None]) -> float | None:
    """Mean of the non-None values; None when there are none."""
    kept = [v for v in values if v is not None]
    return float(np.mean(kept)) if kept else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), None for an empty list."""
    return float(np.percentile(values, q)) if len(values) else None


def bootstrap_interval(values: Sequence[float | None], confidence: float = 0.95, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean of the non-None ``values`` (scipy's ``bootstrap``, seeded so a
    report reproduces); None when there are none. The differences between planners and baselines here are a few
    points on a few hundred questions, so every accuracy is reported with one.

    >>> bootstrap_interval([1.0, 1.0, 1.0])
    (1.0, 1.0)
    """
    kept = np.array([v for v in values if v is not None], dtype=float)
    if not len(kept):
        return None
    if np.all(kept == kept[0]):  # scipy warns on a degenerate sample; its interval is the value itself
        return float(kept[0]), float(kept[0])
    result = bootstrap((kept,), np.mean, confidence_level=confidence, n_resamples=resamples, method="percentile",
                       rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)
