"""`overstory eval rag` with the real built-in models on a few HotpotQA questions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.core.records import Chunk
from overstory.retrieval.answer import answer_messages, clean_answer

ROOT = Path(__file__).resolve().parents[2]


def test_answer_prompt_and_cleanup() -> None:
    chunk = Chunk("c", "d", "paragraph", "Paris is the capital of France.", None, [], 0, 31, 8, "Paris")
    messages = answer_messages("What is the capital of France?", [chunk], max_chunk_chars=10)
    assert messages[0]["role"] == "system"
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert "[1] Paris: Paris is t" in messages[-1]["content"] and "capital of France." not in messages[-1]["content"]
    assert clean_answer("Answer: Barnaby Joyce.\nBecause ...") == "Barnaby Joyce"
    assert clean_answer("   ") == ""


@pytest.mark.slow
def test_eval_rag_job(tmp_path: Path) -> None:
    code = main(["eval", "rag", "--config", str(ROOT / "configs/eval/rag.yaml"), f"out={tmp_path}",
                 f"corpus.path={ROOT / 'data/hotpotqa'}", "limit_questions=4", "tracking.backend=none",
                 "serve.port=0", "retrieval.index=bm25"])
    assert code == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["n_questions"] == 4 and metrics["index"] == "bm25" and metrics["n_chunks_indexed"] == 400
    assert 0.5 <= metrics["recall@5"] <= 1.0
    assert metrics["usage"]["generator"]["requests"] == 4
    records = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(len(r["retrieved"]) == 5 for r in records)
    assert all(r["raw"] for r in records)
