"""The harness's per-strategy files: settings checked on resume, records appended and read back in question order,
runs' cost checks combined over the questions they covered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.core.config import ConfigError, load_config
from overstory.evaluation.pipeline import PipelineEvalConfig, strategy_settings
from overstory.evaluation.pipeline_records import StrategyRecords, combined_cost_check
from overstory.retrieval.orion.query import QUERY_PROMPTS_DIGEST
from tests.conftest import ROOT

SETTINGS = {"dataset": {"kind": "squad"}, "answer": {"max_tokens": 24}, "naive": {"k": 5}}


def _record(question_id: str) -> dict:
    return {"id": question_id, "prediction": f"answer {question_id}", "failure": ""}


def test_records_resume_only_under_the_same_settings(tmp_path: Path) -> None:
    records = StrategyRecords(tmp_path, "naive")
    records.start(SETTINGS, resume=True)
    records.append(_record("q1"))
    records.append(_record("q2"))
    records.close()
    again = StrategyRecords(tmp_path, "naive")
    again.start(SETTINGS, resume=True)
    assert list(again.done(["q2", "q3"])) == ["q2"]  # q1 is kept on disk but is not asked for
    changed = {**SETTINGS, "answer": {"max_tokens": 64}, "naive": {"k": 5, "index": "bm25"}}
    with pytest.raises(ConfigError, match=r"answer\.max_tokens, naive\.index differ"):
        StrategyRecords(tmp_path, "naive").start(changed, resume=True)
    assert again.done(["q1"])  # the refused run deleted nothing
    StrategyRecords(tmp_path, "naive").start(changed, resume=False)  # starting over drops the old answers
    assert StrategyRecords(tmp_path, "naive").done(["q1", "q2"]) == {}
    fresh = StrategyRecords(tmp_path, "naive")
    fresh.append(_record("q1"))
    fresh.close()
    assert json.loads((tmp_path / "naive.settings.json").read_text())["answer"]["max_tokens"] == 64
    (tmp_path / "naive.settings.json").unlink()  # answers of an earlier harness, which kept no settings
    with pytest.raises(ConfigError, match="without a record of their settings"):
        StrategyRecords(tmp_path, "naive").start(SETTINGS, resume=True)


def test_orions_settings_name_its_query_prompts_so_answers_under_other_prompts_are_not_resumed() -> None:
    config = load_config(PipelineEvalConfig, ROOT / "configs/eval/pipeline.yaml", [])
    orion = strategy_settings("orion", config, {})
    assert orion["orion_prompts"] == QUERY_PROMPTS_DIGEST and len(QUERY_PROMPTS_DIGEST) == 16
    assert "orion_prompts" not in strategy_settings("naive", config, {})  # the shared answer prompt is not Orion's


def test_a_question_the_harness_failed_is_asked_again_and_its_latest_record_counts(tmp_path: Path) -> None:
    records = StrategyRecords(tmp_path, "naive")
    records.start(SETTINGS, resume=True)
    for record in (_record("q1"), {**_record("q2"), "failure": "request_failed"},
                   {**_record("q3"), "failure": "no_answer"}):
        records.append(record)
    records.close()
    retry = ("request_failed", "strategy_error")
    assert sorted(records.done(["q1", "q2", "q3"], retry)) == ["q1", "q3"]  # a reply it could not use is a result
    records.append({**_record("q2"), "prediction": "answered on the rerun"})
    records.close()
    assert records.done(["q2"], retry)["q2"]["prediction"] == "answered on the rerun"


def test_rewrite_puts_the_questions_in_order_and_keeps_other_records(tmp_path: Path) -> None:
    records = StrategyRecords(tmp_path, "arag")
    records.start(SETTINGS, resume=True)
    for question_id in ("q0", "q3", "q1"):
        records.append(_record(question_id))
    records.rewrite([{**_record("q1"), "judge": 1.0}, _record("q3")])
    lines = [json.loads(line) for line in (tmp_path / "arag.jsonl").read_text().splitlines()]
    assert [r["id"] for r in lines] == ["q0", "q1", "q3"] and lines[1]["judge"] == 1.0


def test_a_killed_run_leaves_its_questions_unchecked() -> None:
    runs = [{"question_ids": ["a", "b"], "costs_add_up": {"match": True}}]
    assert combined_cost_check(runs, ["a", "b", "c"]) == {"match": True, "questions_checked": 2, "questions": 3,
                                                          "runs": 1}
    runs.append({"question_ids": ["c"], "costs_add_up": {"match": False}})
    assert combined_cost_check(runs, ["a", "b", "c"])["match"] is False
    assert combined_cost_check(runs, ["z"]) is None  # no run covered these questions
