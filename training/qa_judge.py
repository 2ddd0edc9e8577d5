"""R_QA's backend: whether answering a question from a level range through the SmartChunk runtime is correct.

``QAJudge(example_id, level_min, level_max)`` searches the range in the question's document (``DocumentRetrievers``),
asks the generator for a short answer and judges it by the same correctness rule as the pseudo-labels. ``QAReward``
(training/rewards.py) calls it once per distinct (question, range) of a run.

With the CPU teacher as the generator each answer takes seconds, and an RL run is hours over several invocations, so
the answers can be kept on disk (``kept``, a folder): each is appended to ``<kept>/qa_answers.jsonl`` as it comes,
with eval planner's kept-answer store (``data_pipeline/planner_answers.py``: keyed by question, range and the document's
chunking; its settings and the models that served it recorded beside it, other settings refused naming the keys).
A resumed run reads back the answers of the steps after its last checkpoint instead of asking again, and so does a
later run on the same labels and stack: GRPO and STITCH start from the same SFT planner, so they plan many of the
same ranges. The greedy answer of a (question, range) is the same whichever run asks it. One process writes the
file: under several (a distributed launch) ``kept`` is refused, each rank then asks for its own completions.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from overstory.core.config import ConfigError, to_dict
from overstory.core.records import Chunk
from overstory.data_pipeline.planner_answers import PlannerAnswers, chunk_fingerprints
from overstory.retrieval.answer import clean_answer
from overstory.retrieval.judge import CorrectnessConfig, is_correct
from overstory.retrieval.smartchunk import DocumentRetrievers
from overstory.serving.client import Client

MAX_ANSWER_TOKENS = 24  # a short answer: token F1 against short gold answers, and a cheap call


def judge_settings(k: int, correctness: CorrectnessConfig, max_answer_tokens: int = MAX_ANSWER_TOKENS
                   ) -> dict[str, Any]:
    """The settings R_QA's kept answers are recorded under (and a store with others is refused by)."""
    return {"purpose": "R_QA", "k": k, "max_answer_tokens": max_answer_tokens, "correctness": to_dict(correctness)}


class QAJudge:
    """``judge(example_id, level_min, level_max) -> bool`` over ``rows`` (the planner rows: example_id, doc_id,
    question, answers) and their documents' ``chunks``; ``counts`` says how many answers were read back from
    ``kept`` and how many asked this run (empty without ``kept``)."""

    def __init__(self, rows: list[dict], chunks: list[Chunk], client: Client, correctness: CorrectnessConfig, k: int,
                 kept: str = "", max_answer_tokens: int = MAX_ANSWER_TOKENS):
        self.by_id = {row["example_id"]: row for row in rows}
        self.retrievers = DocumentRetrievers(chunks, client)
        self.client, self.correctness, self.k, self.max_answer_tokens = client, correctness, k, max_answer_tokens
        self.kept: PlannerAnswers | None = None
        self.read_back, self._lock = 0, threading.Lock()
        if kept:
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise ConfigError(f"rewards.qa_answers ({kept}) keeps R_QA's answers from one process; this launch "
                                  f"runs {os.environ['WORLD_SIZE']}: leave it empty")
            self.kept = PlannerAnswers(kept, self.settings(), client, self.answer, chunk_fingerprints(chunks),
                                       required=("correct",))

    def settings(self) -> dict[str, Any]:
        """What decides an answer beside the served models (which the store records itself)."""
        return judge_settings(self.k, self.correctness, self.max_answer_tokens)

    def answer(self, row: dict, level_min: str, level_max: str) -> dict:
        """Ask the generator from the range's retrieved chunks; the cleaned answer and whether it is correct."""
        reply, _ = self.retrievers[row["doc_id"]].answer(row["question"], level_min, level_max, k=self.k,
                                                         max_tokens=self.max_answer_tokens)
        text = clean_answer(reply.text)
        return {"correct": is_correct(text, row["answers"], row["question"], self.correctness, self.client),
                "answer": text}

    def __call__(self, example_id: str, level_min: str, level_max: str) -> bool:
        row = self.by_id[example_id]
        if self.kept is None:
            return bool(self.answer(row, level_min, level_max)["correct"])
        if self.kept.has(row, level_min, level_max):
            with self._lock:
                self.read_back += 1
        return bool(self.kept(row, level_min, level_max)["correct"])

    @property
    def counts(self) -> dict[str, int]:
        """With ``kept``: the answers on disk when the run started, those of them this run read back, and the
        answers it asked (each distinct (question, range) once: ``QAReward`` caches what it was told)."""
        if self.kept is None:
            return {}
        return {"kept_before": self.kept.counts["resumed"], "read_back": self.read_back,
                "asked": self.kept.counts["asked"]}

    def close(self) -> None:
        if self.kept:
            self.kept.close()
