"""`overstory eval rag`: the evaluation harness with the naive strategy, with the real built-in models on a few
HotpotQA questions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.core.config import ConfigError, load_config
from overstory.core.records import Chunk
from overstory.evaluation.rag import RagEvalConfig
from overstory.retrieval.answer import answer_messages, clean_answer
from overstory.serving.launch import serve_in_background
from tests.stand_ins import failing_server

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/eval/rag.yaml"


def test_answer_prompt_and_cleanup() -> None:
    chunk = Chunk("c", "d", "paragraph", "Paris is the capital of France.", None, [], 0, 31, 8, "Paris")
    messages = answer_messages("What is the capital of France?", [chunk], max_chunk_chars=10)
    assert messages[0]["role"] == "system"
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert "[1] Paris: Paris is t" in messages[-1]["content"] and "capital of France." not in messages[-1]["content"]
    assert clean_answer("Answer: Barnaby Joyce.\nBecause ...") == "Barnaby Joyce"
    assert clean_answer("   ") == ""


def test_eval_rag_is_the_pipeline_with_the_naive_strategy() -> None:
    """Its settings become the harness's, with the naive strategy only; the harness's checks name their keys."""
    config = load_config(RagEvalConfig, CONFIG, ["naive.index=bm25", "answer.context_chunks=2", "limit_questions=4"])
    pipeline = config.pipeline()
    assert pipeline.names == ["naive"] and pipeline.naive.index == "bm25" and pipeline.answer.context_chunks == 2
    assert pipeline.limit_questions == 4 and pipeline.out == config.out and pipeline.dataset.kind == "hotpotqa"
    with pytest.raises(ConfigError, match="data: 'msmarco' is not a shipped sample"):
        load_config(RagEvalConfig, CONFIG, ["data=msmarco"])
    assert pipeline.scope == "auto" and load_config(RagEvalConfig, CONFIG, ["data=squad", "scope=corpus"]).pipeline(
        ).scope == "corpus"  # open-corpus SQuAD, the harder variant, by name
    with pytest.raises(ConfigError, match="scope"):  # HotpotQA has no question document to insist on
        load_config(RagEvalConfig, CONFIG, ["scope=document"])


@pytest.mark.slow
def test_eval_rag_job(tmp_path: Path) -> None:
    code = main(["eval", "rag", "--config", str(CONFIG), f"out={tmp_path}",
                 f"corpus.path={ROOT / 'data/hotpotqa'}", "limit_questions=4", "tracking.backend=none",
                 "naive.index=bm25"])
    assert code == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["n_questions"] == 4 and list(metrics["strategies"]) == ["naive"]
    assert metrics["config"]["naive"]["index"] == "bm25"
    row = metrics["strategies"]["naive"]
    assert 0.5 <= row["recall@5"] <= 1.0  # BM25 over paragraphs reaches most gold paragraphs
    assert row["usage_total"]["generator"]["calls"] == 4 and row["costs_add_up"]["match"]
    records = [json.loads(line) for line in (tmp_path / "predictions" / "naive.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(len(r["evidence"]) == 5 for r in records)
    assert all(r["failure"] == "" and r["raw"] for r in records)  # the stack is up: the generator answered each
    assert "| naive |" in (tmp_path / "table.md").read_text()


def test_a_run_whose_questions_all_fail_writes_its_table_and_exits_1(tmp_path: Path, capsys) -> None:
    with serve_in_background(failing_server(503, "overloaded")) as url:
        code = main(["eval", "rag", "--config", str(CONFIG), f"out={tmp_path}", "limit_questions=2",
                     "naive.index=bm25", f"server_url={url}", "tracking.backend=none"])
    assert code == 1
    assert "job failed: eval pipeline: 2 of 2 items failed" in capsys.readouterr().err
    row = json.loads((tmp_path / "metrics.json").read_text())["strategies"]["naive"]
    assert row["answered"] == 0 and row["failures"] == {"request_failed": 2}  # the figures are still written
