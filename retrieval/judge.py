"""Is a generated answer correct? The rule every job judges answers by.

Pseudo-labelling decides its labels with it, R_QA rewards the planner with it and the evaluations score
checkpoints with it, so one rule, configured once (``correctness:`` in each job's config), means the same
thing everywhere: exact match, token F1 above a threshold, the answer contained in the reply, or an LLM
judge (the ``scorer`` role answers yes or no).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from overstory.core.config import ConfigError
from overstory.retrieval.metrics import contains_match, exact_match, token_f1
from overstory.serving.client import Client

JUDGE_PROMPT = ("Question: {question}\nReference answer: {reference}\nProposed answer: {prediction}\n"
                "Does the proposed answer mean the same as the reference answer? Reply yes or no.")


@dataclass(frozen=True)
class CorrectnessConfig:
    rule: Literal["exact", "f1", "contains", "judge"] = "contains"
    f1_threshold: float = 0.5  # rule f1: correct when token F1 >= this

    def __post_init__(self) -> None:
        if not 0 < self.f1_threshold <= 1:
            raise ConfigError(f"correctness.f1_threshold must be in (0, 1], got {self.f1_threshold}")


def is_correct(prediction: str, answers: list[str], question: str, config: CorrectnessConfig,
               client: Client | None = None, role: str = "scorer") -> bool:
    """Judge a generated answer with the configured rule (``judge``: the served ``role`` answers yes or no).

    >>> is_correct("It was the Normans", ["Normans"], "Who?", CorrectnessConfig("contains"))
    True
    >>> is_correct("Normans of France", ["Normans"], "Who?", CorrectnessConfig("f1", f1_threshold=0.8))
    False
    """
    if config.rule == "exact":
        return exact_match(prediction, answers) == 1.0
    if config.rule == "f1":
        return token_f1(prediction, answers) >= config.f1_threshold
    if config.rule == "contains":
        return contains_match(prediction, answers) == 1.0
    if client is None:
        raise ValueError(f"the judge rule needs a client with a {role} role")
    reply = client.chat(role, [{"role": "user", "content": JUDGE_PROMPT.format(
        question=question, reference=" / ".join(answers), prediction=prediction)}], max_tokens=3, temperature=0)
    return reply.text.strip().lower().startswith("yes")
