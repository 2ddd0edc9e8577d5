"""`overstory eval compressor` without summaries (``groups``) on the shipped QASPER dev papers: the papers' own sections
and subsections, children embedded by the served MiniLM; the compressor checkpoint, mean_pool and direct_encode are
ranked, summarize is left out and named, and the questions left out (figure/table only, no text evidence) are
counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.core.config import ConfigError, load_config
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.evaluation.compressor import EvalCompressorConfig
from overstory.models.compressor import SetCompressor, SetCompressorConfig, save_checkpoint
from overstory.models.registry import MINILM

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/eval/compressor-qasper-all.yaml"
QASPER = ROOT / "data/qasper"


def test_the_config_takes_summaries_or_groups() -> None:
    loaded = load_config(EvalCompressorConfig, CONFIG)
    assert loaded.data == "" and loaded.groups is not None and loaded.corpus.limit_docs == 0  # all 48 dev papers
    with pytest.raises(ConfigError, match="give data .* or groups .* exactly one"):
        load_config(EvalCompressorConfig, CONFIG, ["data=runs/data/summaries/qasper_dev.jsonl"])
    with pytest.raises(ConfigError, match="give data .* or groups .* exactly one"):
        load_config(EvalCompressorConfig, ROOT / "configs/eval/compressor-qasper.yaml", ["data="])


@pytest.mark.slow
def test_eval_without_summaries_ranks_three_methods_and_counts_questions(tmp_path: Path, capsys) -> None:
    # an untrained set compressor is the mean of the children: it must rank exactly like mean_pool
    checkpoint = save_checkpoint(SetCompressor(SetCompressorConfig(encoder=MINILM)), tmp_path / "ckpt", {})
    out = tmp_path / "eval"
    assert main(["eval", "compressor", "--config", str(CONFIG), "--checkpoint", str(checkpoint), "--out", str(out),
                 f"corpus.path={QASPER}", "corpus.split=dev", "tracking.backend=none"]) == 0
    report = json.loads((out / "metrics.json").read_text())
    methods = report["methods"]
    assert set(methods) == {"compressor", "mean_pool", "direct_encode"} and report["records"] == "groups"
    assert set(report["methods_left_out"]) == {"summarize"}
    assert report["levels"] == ["section", "subsection"] and report["n_documents"] == 6
    _, questions = load_corpus(CorpusConfig("qasper", str(QASPER), split="dev"))
    figure_only = sum(q.metadata["figure_table_only"] for q in questions)
    assert report["n_questions"] == sum(bool(q.evidence) for q in questions) >= 10
    assert report["questions_left_out"] == {"figure_table_only": figure_only,
                                            "no_text_evidence": len(questions) - report["n_questions"] - figure_only}
    assert figure_only >= 1 and report["questions_uncovered"] == 0
    assert methods["compressor"]["recall@5"] == pytest.approx(methods["mean_pool"]["recall@5"])
    for row in methods.values():
        low, high = row["recall@5_ci95"]
        assert 0.0 <= low <= row["recall@5"] <= high <= 1.0 and row["cosine_to_target"] is None
        assert row["llm_completion_tokens"] == 0 and row["speedup_vs_summarize"] is None
    printed = capsys.readouterr().out
    assert f"left out {figure_only} whose evidence is only a figure or table" in printed
    assert "summarize left out: no summaries" in printed.replace("\n", " ")
    assert (out / "recall_vs_cost.png").exists()
