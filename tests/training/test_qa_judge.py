"""R_QA's judge with its answers kept on disk (training/qa_judge.py): a later run reads an answer back instead of
asking the generator again, and refuses answers kept under other settings or from several processes. The answer
itself (retrieval over the range and the real generator) runs in tests/training/test_planner_grpo.py's R_QA test;
here ``QAJudge.answer`` is a stand-in, so the store's behaviour is checked without a model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from overstory.core.config import ConfigError
from overstory.core.records import Chunk
from overstory.retrieval.judge import CorrectnessConfig
from overstory.training.qa_judge import QAJudge

ROWS = [{"example_id": "q1", "doc_id": "d1", "question": "Who?", "answers": ["Ann"]}]
CHUNKS = [Chunk("d1#0", "d1", "sentence", "Ann did.", None, [], 0, 8, 2)]
# what the store reads of a client: the served models its server lists (GET /v1/models), recorded with the answers
CLIENT = SimpleNamespace(backend=SimpleNamespace(get=lambda path: [{"data": [{"id": "generator", "root": "teacher"}]}]))


def judge(kept: Path, k: int = 5) -> QAJudge:
    return QAJudge(ROWS, CHUNKS, CLIENT, CorrectnessConfig(), k, kept=str(kept))  # type: ignore[arg-type]


def test_a_kept_answer_is_read_back_by_a_later_run_not_asked_again(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    asked = []
    monkeypatch.setattr(QAJudge, "answer", lambda self, row, low, high: asked.append((row["example_id"], low, high))
                        or {"correct": low == "sentence", "answer": "Ann"})
    first = judge(tmp_path)
    assert first("q1", "sentence", "paragraph") is True and first("q1", "section", "section") is False
    assert first.counts == {"kept_before": 0, "read_back": 0, "asked": 2}
    first.close()
    records = [json.loads(line) for line in (tmp_path / "qa_answers.jsonl").read_text().splitlines()]
    assert [r["outcome"] for r in records] == [{"correct": True, "answer": "Ann"}, {"correct": False, "answer": "Ann"}]
    settings = json.loads((tmp_path / "qa_answers.settings.json").read_text())
    assert settings["purpose"] == "R_QA" and settings["k"] == 5 and settings["served"] == {"generator": "teacher"}

    later = judge(tmp_path)  # a resumed run, or STITCH after GRPO on the same labels and stack
    assert later("q1", "sentence", "paragraph") is True and later("q1", "paragraph", "section") is False
    assert later.counts == {"kept_before": 2, "read_back": 1, "asked": 1}
    assert asked == [("q1", "sentence", "paragraph"), ("q1", "section", "section"), ("q1", "paragraph", "section")]
    later.close()


def test_answers_kept_under_other_settings_are_refused_naming_the_key(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(QAJudge, "answer", lambda self, row, low, high: {"correct": True, "answer": "Ann"})
    first = judge(tmp_path)
    first("q1", "sentence", "sentence")
    first.close()
    with pytest.raises(ConfigError, match=r"other settings \(k differ"):
        judge(tmp_path, k=3)


def test_kept_answers_are_refused_under_several_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="rewards.qa_answers .* one process; this launch runs 2"):
        judge(tmp_path)
    assert not (tmp_path / "qa_answers.jsonl").exists()
    assert QAJudge(ROWS, CHUNKS, CLIENT, CorrectnessConfig(), 5).counts == {}  # nothing kept: every rank asks
