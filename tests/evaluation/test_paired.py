"""Two eval pipeline runs compared question by question (evaluation/paired.py, scripts/compare_answers.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from overstory.evaluation.paired import compare_runs, paired_table
from overstory.evaluation.report_tables import RENDERERS

ROOT = Path(__file__).resolve().parents[2]


def _run(folder: Path, answers: dict[str, list[dict]], served: dict) -> Path:
    """An eval pipeline out folder with these strategies' prediction records and metrics.json's ``served``."""
    (folder / "predictions").mkdir(parents=True)
    for strategy, records in answers.items():
        (folder / "predictions" / f"{strategy}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (folder / "predictions" / f"{strategy}.runs.jsonl").write_text("{}\n")
    (folder / "metrics.json").write_text(json.dumps({"served": served}))
    return folder


def _record(qid: str, prediction: str, f1: float, judge: float | None = 1.0, failure: str = "") -> dict:
    return {"id": qid, "prediction": prediction, "evidence": [f"{qid}#p0"], "token_f1": f1,
            "exact_match": float(f1 == 1), "recall@5": 1.0, "judge": judge, "failure": failure}


def test_questions_are_paired_by_id_and_only_shared_strategies_and_questions_count(tmp_path: Path) -> None:
    first = _run(tmp_path / "a", {
        "naive": [_record("q1", "Paris", 1.0), _record("q2", "yes", 0.0), _record("q3", "1911", 1.0),
                  _record("q5", "x", 0.0)],
        "fable": [_record("q1", "x", 0.0)]}, {"generator": "builtin:qwen2.5-coder-1.5b-instruct"})
    second = _run(tmp_path / "b", {
        # q3 missing here, q4 missing there; q1 the same, q2 now right (the judge left out), q5 failed (no answer)
        "naive": [_record("q2", "no", 1.0, judge=None), _record("q1", "Paris", 1.0), _record("q4", "z", 0.0),
                  _record("q5", "", 0.0, failure="timeout")],
        "orion": [_record("q1", "x", 0.0)]}, {"generator": "builtin:qwen2.5-coder-1.5b-instruct (bfloat16)"})
    report = compare_runs(first, second)
    assert list(report["strategies"]) == ["naive"]  # the only strategy both answered
    assert report["served"]["second"]["generator"].endswith("(bfloat16)")
    naive = report["strategies"]["naive"]
    assert (naive["questions"], naive["same_prediction"], naive["same_evidence"], naive["failed"]) == (3, 1, 3, [0, 1])
    f1 = naive["metrics"]["token_f1"]
    assert (f1["n"], f1["higher"], f1["lower"]) == (3, 1, 0)
    assert (f1["first"], f1["second"], f1["delta"]) == pytest.approx((1 / 3, 2 / 3, 1 / 3))
    assert f1["delta_ci95"][0] <= 1 / 3 <= f1["delta_ci95"][1]
    assert naive["metrics"]["judge"]["n"] == 2  # a question without the judge's verdict in one run is left out
    table = RENDERERS["answers_paired"](report)
    assert table == paired_table(report)
    assert "| naive | token_f1 | 3 | 1 of 3 | 0 / 1 | 0.333 | 0.667 | +0.333 [" in table and "| 1 / 0 |" in table


def test_the_script_writes_the_report_and_refuses_runs_with_nothing_in_common(tmp_path: Path) -> None:
    first = _run(tmp_path / "a", {"naive": [_record("q1", "Paris", 1.0)]}, {})
    second = _run(tmp_path / "b", {"naive": [_record("q1", "Lyon", 0.0)]}, {})
    done = subprocess.run([sys.executable, str(ROOT / "scripts/compare_answers.py"), str(first), str(second)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads((second / "paired.json").read_text())
    assert report["strategies"]["naive"]["metrics"]["token_f1"]["delta"] == -1.0 and "-1.000" in done.stdout
    other = _run(tmp_path / "c", {"orion": [_record("q1", "x", 0.0)]}, {})
    with pytest.raises(ValueError, match="no strategy's predictions in common"):
        compare_runs(first, other)
