"""The evaluation harness's files per strategy, which make a run resumable and let runs add up to one report.

``overstory eval pipeline`` appends each question's record as soon as it is answered, so a killed run (or one cut
off by a session's end) resumes where it stopped, and raising ``limit_questions`` answers only the new questions.
Strategies run by separate commands into the same ``out`` folder (two commands sharing the cores, say) share it;
the last run's ``metrics.json`` covers the strategies it names.

    <out>/predictions/<strategy>.jsonl          one record per answered question, appended as each finishes
    <out>/predictions/<strategy>.settings.json  what decides those answers: the dataset, the chunking, the answer
                                                settings, the strategy's own section and the served checkpoints
    <out>/predictions/<strategy>.runs.jsonl     one line per run that answered questions: how many, what building
                                                the strategy cost, and the check of its token sums against the
                                                servers' counters

Resuming with other settings is refused with the keys that differ, rather than a table that mixes two
configurations. Each record also names the models that served its calls (``served_by``: role -> model, as the
servers' ``/v1/models`` says), and a resumed run whose server serves a role with another model than the kept
answers' is refused too: behind a running server (``server_url``) the settings see only the roles' names, so this
is what keeps a stack with another scorer (a distilled cross-encoder in place of the LLM) from adding its answers
to the LLM's.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Collection
from pathlib import Path

from overstory.core.config import ConfigError, record_settings
from overstory.core.records import JsonlAppender, read_jsonl, write_jsonl


class StrategyRecords:
    """One strategy's records in ``<out>/predictions``: load what is done, append what is answered, log runs."""

    def __init__(self, folder: str | Path, strategy: str):
        self.folder = Path(folder)
        self.path = self.folder / f"{strategy}.jsonl"
        self.settings_path = self.folder / f"{strategy}.settings.json"
        self.runs_path = self.folder / f"{strategy}.runs.jsonl"
        self._lock = threading.Lock()
        self._writer: JsonlAppender | None = None

    def start(self, settings: dict, resume: bool) -> None:
        """Record the settings, or check them against those of the records already there; ``resume=False``
        deletes this strategy's earlier records first."""
        if not resume:
            for path in (self.path, self.settings_path, self.runs_path):
                path.unlink(missing_ok=True)
        record_settings(self.settings_path, settings, results=self.path,
                        remedy="choose another out= or set resume=false")

    def done(self, question_ids: Collection[str], retry: Collection[str] = ()) -> dict[str, dict]:
        """The records already answered for these questions, by id: each question's latest record, unless its
        failure is one of ``retry`` (the harness's own failures: a rerun asks those questions again). A record of a
        question outside the set, from a run over more questions, is kept on disk and left out here."""
        if not self.path.exists():
            return {}
        wanted = set(question_ids)
        latest = {r["id"]: r for r in read_jsonl(self.path) if r["id"] in wanted}
        return {question: r for question, r in latest.items() if r["failure"] not in retry}

    def check_served(self, kept: dict[str, dict], served: dict[str, str]) -> None:
        """Refuse to add to ``kept`` (the answers resumed) with a server that serves one of their roles with
        another model: the row would mix two models' answers under one name."""
        for record in kept.values():
            for role, model in record.get("served_by", {}).items():
                if served.get(role, model) != model:
                    raise ConfigError(f"the server serves role {role} with {served[role]}, but the answers kept in "
                                      f"{self.path} were served by {model} (e.g. question {record['id']}): choose "
                                      "another out= or set resume=false")

    def append(self, record: dict) -> None:
        """Add one answered question (thread-safe: the harness answers questions concurrently)."""
        with self._lock:
            if self._writer is None:
                self._writer = JsonlAppender(self.path)
            self._writer.write(record)

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def rewrite(self, records: list[dict]) -> None:
        """Replace the records of these questions (after the judge scored them), keeping any others on disk."""
        self.close()
        by_id = {r["id"]: r for r in records}
        kept = [r for r in read_jsonl(self.path) if r["id"] not in by_id] if self.path.exists() else []
        write_jsonl(self.path, [*kept, *records])

    def log_run(self, run: dict) -> None:
        with self._lock:
            with self.runs_path.open("a") as fh:
                fh.write(json.dumps(run) + "\n")

    def runs(self) -> list[dict]:
        return list(read_jsonl(self.runs_path)) if self.runs_path.exists() else []


def combined_cost_check(runs: list[dict], question_ids: Collection[str]) -> dict | None:
    """The cost checks of every run that answered these questions, as one verdict: ``match`` when no run's token
    sums differed from its servers' counters, and how many of the questions the checks covered (a killed run never
    wrote its check, so its questions stay unchecked). None when no run could check.

    >>> combined_cost_check([{"question_ids": ["a", "b"], "costs_add_up": {"match": True}},
    ...                      {"question_ids": ["c"], "costs_add_up": None}], ["a", "b", "c"])
    {'match': True, 'questions_checked': 2, 'questions': 3, 'runs': 2}
    """
    wanted = set(question_ids)
    checked = [run for run in runs if run.get("costs_add_up") is not None and wanted & set(run["question_ids"])]
    if not checked:
        return None
    return {"match": all(run["costs_add_up"]["match"] for run in checked),
            "questions_checked": len(wanted & {q for run in checked for q in run["question_ids"]}),
            "questions": len(wanted), "runs": len(runs)}


def served_summary(records: list[dict]) -> dict:
    """Which models served these answers, by role (sorted; two models under one role would show a mixed row), and how
    many answers were recorded before records named their models.

    >>> served_summary([{"served_by": {"scorer": "ce", "generator": "qwen"}}, {"served_by": {"generator": "qwen"}},
    ...                 {}])
    {'served_by': {'generator': ['qwen'], 'scorer': ['ce']}, 'served_unrecorded': 1}
    """
    models: dict[str, set[str]] = {}
    for record in records:
        for role, model in record.get("served_by", {}).items():
            models.setdefault(role, set()).add(model)
    return {"served_by": {role: sorted(models[role]) for role in sorted(models)},
            "served_unrecorded": sum(1 for record in records if "served_by" not in record)}
