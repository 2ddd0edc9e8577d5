"""The kept answers of eval planner and R_QA (data_pipeline/planner_answers.py): an answer kept by an older version that
lacks a figure the outcome now holds is completed by retrieval alone, once, without asking the generator again."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from overstory.data_pipeline.planner_answers import PlannerAnswers

ROW = {"example_id": "q1", "doc_id": "d1", "question": "Who?"}
# what the store reads of a client: the served models its server lists (GET /v1/models), recorded with the answers
CLIENT = SimpleNamespace(backend=SimpleNamespace(get=lambda path: [{"data": [{"id": "generator", "root": "teacher"}]}]))


def store(out: Path, **kwargs) -> PlannerAnswers:
    return PlannerAnswers(out, {"k": 5}, CLIENT, fingerprints={"d1": "fp"}, **kwargs)


def test_a_kept_answer_without_a_new_figure_is_completed_by_refresh_not_asked_again(tmp_path: Path) -> None:
    asked, refreshed = [], []
    old = store(tmp_path, answer=lambda row, low, high: asked.append(low) or {"qa_accuracy": 1.0, "tokens_read": 900})
    assert old(ROW, "section", "section") == {"qa_accuracy": 1.0, "tokens_read": 900}
    old.close()

    def refresh(row, low, high, kept):
        refreshed.append(low)
        return {**kept, "tokens_given": 400.0}

    def never(row, low, high):
        raise AssertionError("the generator was asked again")

    new = store(tmp_path, answer=never, required=("tokens_given",), refresh=refresh)
    new.answer_all([(ROW, "section", "section")], "fixed ranges")
    assert new(ROW, "section", "section") == {"qa_accuracy": 1.0, "tokens_read": 900, "tokens_given": 400.0}
    assert new.counts == {"resumed": 1, "asked": 0, "refreshed": 1} and asked == ["section"] == refreshed
    new.close()
    records = [json.loads(line) for line in (tmp_path / "qa_answers.jsonl").read_text().splitlines()]
    assert len(records) == 2 and records[0]["id"] == records[1]["id"]  # appended: the last record of a key wins

    again = store(tmp_path, answer=never, required=("tokens_given",), refresh=refresh)
    assert again(ROW, "section", "section")["tokens_given"] == 400.0 and refreshed == ["section"]
    again.close()


def test_an_incomplete_answer_with_nothing_to_complete_it_is_named(tmp_path: Path) -> None:
    old = store(tmp_path, answer=lambda row, low, high: {"qa_accuracy": 0.0})
    old(ROW, "sentence", "sentence")
    old.close()
    new = store(tmp_path, answer=lambda row, low, high: {}, required=("tokens_given",))
    with pytest.raises(ValueError, match=r"q1\|sentence..sentence\|fp lacks tokens_given"):
        new(ROW, "sentence", "sentence")
    new.close()
