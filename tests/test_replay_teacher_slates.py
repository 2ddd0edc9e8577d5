"""scripts/replay_teacher_slates.py without a model: which recorded slates it picks (parsed, unfailed; with --gold,
those holding a gold-leading and another candidate) and its comparison of recorded and replayed scores, by hand."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from overstory.retrieval.lattice.scorers import SlateScore

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("replay_teacher_slates", ROOT / "scripts/replay_teacher_slates.py")
replay_teacher_slates = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(replay_teacher_slates)


def trace(i: int, scores: list[float], leads: list[bool], parsed: bool = True, failure: str = "") -> dict:
    return {"query_id": f"q{i}", "query": "who?", "node_ids": [f"n{j}" for j in range(len(scores))],
            "texts": [f"t{j}" for j in range(len(scores))], "leaf": False, "raw_scores": scores, "parsed": parsed,
            "failure": failure, "leads_to_gold": leads}


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    rows = [trace(0, [90, 10, 10], [True, False, False]), trace(1, [50, 50], [True, True]),
            trace(2, [20, 80], [False, False]), trace(3, [1, 2], [True, False], parsed=False),
            trace(4, [1, 2], [True, False], failure="timed out"), trace(5, [30, 30, 60], [False, True, False])]
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "traces.settings.json").write_text(json.dumps({"role": "scorer", "served": {"scorer": "teacher"}}))
    return path


def test_the_slates_it_picks(traces: Path) -> None:
    every = [row["query_id"] for row, _ in replay_teacher_slates.load_slates([traces], gold=False)]
    gold = [row["query_id"] for row, settings in replay_teacher_slates.load_slates([traces], gold=True)]
    assert every == ["q0", "q1", "q2", "q5"]  # unparsed and failed slates are not asked again
    assert gold == ["q0", "q5"]  # all-gold (q1) and no-gold (q2) slates cannot show a preference


def test_the_comparison_by_hand(traces: Path) -> None:
    picked = replay_teacher_slates.load_slates([traces], gold=False)
    replies = [SlateScore(scores={0: 90.0, 1: 10.0, 2: 10.0}),  # q0: identical
               SlateScore(scores={0: 40.0, 1: 60.0}),  # q1: recorded flat, so no Spearman; top moved
               SlateScore(scores={0: 80.0}),  # q2: one candidate unscored, left out
               SlateScore(scores={0: 60.0, 1: 30.0, 2: 30.0})]  # q5: the top moved off gold's sibling
    summary = replay_teacher_slates.compare(picked, replies)
    assert summary["slates"] == 4 and summary["parsed_both_times"] == 3 and summary["identical_scores"] == 1
    assert summary["same_top_candidate"] == 1  # q0 only (q1's recorded tie breaks to candidate 0, its new top is 1)
    assert summary["spearman_slates"] == 2  # q0 (1.0) and q5: recorded [30, 30, 60] against [60, 30, 30]
    assert summary["spearman_mean"] == pytest.approx((1.0 + (-0.5)) / 2, abs=1e-4)
    assert summary["mean_abs_score_difference"] == pytest.approx((0 + 10 + 20) / 3, abs=1e-4)
    # gold first, tie-aware: q0 1 -> 1; q1 1 -> 1 (both candidates lead to gold); q5 0 -> 0
    assert summary["slates_with_gold"] == 3
    assert summary["gold_first_recorded"] == pytest.approx(2 / 3, abs=1e-4)
    assert summary["gold_first_replayed"] == pytest.approx(2 / 3, abs=1e-4)
    assert summary["gold_first_by_chance"] == pytest.approx((1 / 3 + 1 + 1 / 3) / 3, abs=1e-4)
