"""`eval planner`'s answers through the SmartChunk runtime, kept so that a run of hours resumes and asks in parallel.

Every planned range and every fixed reference range costs one generator call per question: with the CPU teacher as the
generator, QASPER dev, a SQuAD article and NarrativeQA stories under fifteen fixed ranges and four planners are hours
of calls. So each answer (one per question and range: greedy decoding makes it the same for every planner that plans
that range) is appended to ``<out>/qa_answers.jsonl`` as soon as it is scored, and a rerun into the same ``out`` reads
them back instead of asking again. An answer is keyed by its question, its range and a fingerprint of its document's
chunks (a document chunked otherwise is asked again); what else decides it (``k``, the correctness rule, and the
generator, embedder and scorer the server reports) is recorded in ``qa_answers.settings.json``, and a rerun with other
settings is refused with the keys that differ (``resume=false`` starts over). The answers still to be given are asked
``concurrency`` at a time (a batching server such as vLLM answers several at once), with a progress bar. R_QA keeps
the RL recipes' answers in the same store (training/qa_judge.py).

An answer kept by an older version that lacks a figure the outcome now holds (``required``) is completed by
``refresh``, which recomputes what retrieval alone gives (no generator call; the correctness kept stands) and appends
the completed outcome: the last record of a key wins on reading. ``counts["refreshed"]`` says how many.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from overstory.core.progress import track
from overstory.core.records import Chunk, JsonlAppender, read_jsonl
from overstory.data_pipeline.fanout import SettingsRecord, settings_path
from overstory.serving.client import Client
from overstory.serving.job_client import served_models

Row = Mapping[str, Any]
Answerer = Callable[[Row, str, str], dict]
Refresher = Callable[[Row, str, str, dict], dict]  # (row, low, high, kept outcome) -> the completed outcome


def chunk_fingerprints(chunks: Iterable[Chunk]) -> dict[str, str]:
    """Per document, a short digest of its chunks (ids and spans, in order): what an answer read from.

    >>> a = Chunk("d#0", "d", "sentence", "Hi.", None, [], 0, 3, 1)
    >>> chunk_fingerprints([a]) == chunk_fingerprints([a]), chunk_fingerprints([a]) == chunk_fingerprints(
    ...     [Chunk("d#0", "d", "sentence", "Hi", None, [], 0, 2, 1)])
    (True, False)
    """
    spans: dict[str, list] = {}
    for chunk in chunks:
        spans.setdefault(chunk.doc_id, []).append([chunk.id, chunk.start, chunk.end])
    return {doc: hashlib.sha256(json.dumps(items).encode()).hexdigest()[:12] for doc, items in spans.items()}


def answer_id(row: Row, low: str, high: str, fingerprint: str) -> str:
    """The key of one answer: the question, the range it was answered from and its document's chunks' fingerprint.

    >>> answer_id({"example_id": "q1"}, "sentence", "paragraph", "ab12")
    'q1|sentence..paragraph|ab12'
    """
    return f"{row['example_id']}|{low}..{high}|{fingerprint}"


class PlannerAnswers:
    """The answers of one eval planner run (see the module docstring): call it for one answer, ``answer_all`` to ask
    many in parallel first; ``counts`` says how many were read back, asked and refreshed in this run."""

    def __init__(self, out: str | Path, settings: dict[str, Any], client: Client, answer: Answerer,
                 fingerprints: Mapping[str, str], concurrency: int = 1, resume: bool = True,
                 required: tuple[str, ...] = (), refresh: Refresher | None = None):
        self.path = Path(out) / "qa_answers.jsonl"
        if not resume:
            self.path.unlink(missing_ok=True)
            settings_path(self.path).unlink(missing_ok=True)
        self.record = SettingsRecord(self.path, settings, settings_path(self.path))
        self.served = served_models(client, ["generator", "embedder", "scorer"])
        self.record.add_served(self.served)
        self._answers: dict[str, dict] = ({r["id"]: r["outcome"] for r in read_jsonl(self.path)}
                                          if self.path.exists() else {})
        self._writer = JsonlAppender(self.path)
        self._answer, self.fingerprints, self.concurrency = answer, fingerprints, concurrency
        self.required, self._refresh = required, refresh
        self._lock = threading.Lock()
        self.counts = {"resumed": len(self._answers), "asked": 0, "refreshed": 0}

    def key(self, row: Row, low: str, high: str) -> str:
        """The answer's key (``answer_id``), with the fingerprint of the row's document."""
        return answer_id(row, low, high, self.fingerprints[row["doc_id"]])

    def has(self, row: Row, low: str, high: str) -> bool:
        """Whether a complete answer of ``row`` from ``low..high`` is kept (read back, not asked, by a call)."""
        with self._lock:
            return self.complete(self._answers.get(self.key(row, low, high)))

    def complete(self, outcome: dict | None) -> bool:
        """Whether a kept outcome holds every ``required`` figure (None: nothing kept)."""
        return outcome is not None and all(name in outcome for name in self.required)

    def __call__(self, row: Row, low: str, high: str) -> dict:
        """The outcome of answering ``row`` from ``low..high``: the one kept, a kept one completed by ``refresh``, or
        a new answer; a new or completed outcome is kept at once."""
        key = self.key(row, low, high)
        with self._lock:
            kept = self._answers.get(key)
        if self.complete(kept):
            return kept
        if kept is not None and self._refresh is None:
            raise ValueError(f"{self.path}: the answer kept for {key} lacks "
                             f"{', '.join(n for n in self.required if n not in kept)} and nothing can complete it")
        outcome = self._answer(row, low, high) if kept is None else self._refresh(row, low, high, kept)
        with self._lock:
            if not self.complete(self._answers.get(key)):  # another thread may have answered the same key meanwhile
                self._answers[key] = outcome
                self._writer.write({"id": key, "outcome": outcome})
                self.counts["asked" if kept is None else "refreshed"] += 1
            return self._answers[key]

    def answer_all(self, wanted: Iterable[tuple[Row, str, str]], description: str) -> None:
        """Answer every (row, low, high) of ``wanted`` not yet kept (or kept incomplete), ``concurrency`` at a time."""
        todo = {self.key(*item): item for item in wanted}
        todo = {key: item for key, item in todo.items() if not self.complete(self._answers.get(key))}
        if not todo:
            return
        with ThreadPoolExecutor(self.concurrency) as pool:
            for _ in track(pool.map(lambda item: self(*item), todo.values()), total=len(todo),
                           description=f"{description} ({len(todo)} answers)"):
                pass

    def close(self) -> None:
        self._writer.close()
