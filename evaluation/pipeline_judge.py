"""eval pipeline's LLM judge: its settings, its verdict on every answer (kept across a resumed run), the check that it
accepts the reference answer itself, and how its verdicts compare with contain-match, a rule that needs no model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from overstory.core.records import QAExample
from overstory.retrieval.judge import CorrectnessConfig, is_correct
from overstory.serving.client import Client


@dataclass(frozen=True)
class JudgeConfig:
    enabled: bool = False
    role: str = "scorer"  # the served role that judges (yes / no); its cost is reported apart from the strategies'


def judge_agreement(records: Sequence[dict]) -> dict | None:
    """How the LLM judge's verdicts compare with contain-match (the reference string inside the reply) over the
    questions both scored: the judge is checked against a rule that needs no model. ``judge_only`` are answers
    the judge accepts without the reference string (paraphrases, or a lenient judge), ``contains_only`` ones it
    rejects although they contain it. None when no question was judged.

    >>> judge_agreement([{"judge": 1.0, "contains_match": 1.0}, {"judge": 1.0, "contains_match": 0.0},
    ...                  {"judge": 0.0, "contains_match": 0.0}, {"contains_match": 1.0}])
    {'n': 3, 'both': 1, 'judge_only': 1, 'contains_only': 0, 'neither': 1, 'agreement': 0.667}
    """
    pairs = [(r["judge"] > 0, r["contains_match"] > 0) for r in records
             if r.get("judge") is not None and r.get("contains_match") is not None]
    if not pairs:
        return None
    counts = {"both": (True, True), "judge_only": (True, False), "contains_only": (False, True),
              "neither": (False, False)}
    out = {"n": len(pairs), **{name: pairs.count(pair) for name, pair in counts.items()}}
    out["agreement"] = round((out["both"] + out["neither"]) / len(pairs), 3)
    return out


def judge_answers(records: list[dict], questions: dict[str, QAExample], client: Client, config: JudgeConfig) -> dict:
    """Score every record this judge role has not scored yet (a resumed run keeps its verdicts); its usage."""
    judge = client.fork()
    rule = CorrectnessConfig("judge")
    for record in records:
        if record.get("judge_role") == config.role:
            continue
        record["judge_role"] = config.role
        if record["failure"] and not record["prediction"]:
            record["judge"] = 0.0  # no answer is a wrong answer: accuracy is over all questions
            continue
        question = questions[record["id"]]
        record["judge"] = float(is_correct(record["prediction"], question.answers, question.question, rule, judge,
                                           role=config.role))
    return judge.stats.summary()




def judge_sanity(questions: Sequence[QAExample], client: Client, config: JudgeConfig, n: int = 5) -> dict:
    """Whether the judge accepts the reference answer itself, on the first ``n`` questions: a judge that refuses an
    exact copy (SmolLM2-135M answers "No" every time) makes the judge column a measure of the judge, not of the
    answers, and the table says so."""
    judge = client.fork()
    rule = CorrectnessConfig("judge")
    asked = [q for q in questions if q.answers][:n]
    accepted = sum(is_correct(q.answers[0], q.answers, q.question, rule, judge, role=config.role) for q in asked)
    return {"reference_accepted": accepted, "asked": len(asked), "usage": judge.stats.summary()}
