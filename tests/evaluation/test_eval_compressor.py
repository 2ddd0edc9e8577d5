"""`overstory eval compressor` on real SQuAD section summaries: four methods, two compressor designs, plot."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from overstory.cli import main
from overstory.core.config import ConfigError, build
from overstory.core.records import Chunk, SummaryRecord, read_jsonl
from overstory.data_pipeline.corpora import CorpusConfig
from overstory.evaluation.compressor import EvalCompressorConfig, HeldOut, held_out_records, summarize_with
from overstory.models.compressor import SetCompressor, SetCompressorConfig, save_checkpoint
from overstory.models.registry import MINILM, load_sentence_encoder
from overstory.models.text_compressor import save_text_compressor
from overstory.retrieval.index import chunk_text_for_index
from overstory.serving.client import Client

ROOT = Path(__file__).resolve().parents[2]


def _record(doc_id: str, index: int) -> SummaryRecord:
    return SummaryRecord(id=f"{doc_id}/s{index}", doc_id=doc_id, level="section", child_ids=[], child_embeddings=[],
                         summary="", target_embedding=[], generator="", encoder="", prompt_tokens=0,
                         completion_tokens=0, attempts=1)


def test_held_out_is_the_validation_documents_or_every_document() -> None:
    records = [_record(f"doc{d}", i) for d in range(20) for i in range(3)]

    def config(**extra: str) -> EvalCompressorConfig:
        raw = {"checkpoint": "c", "data": "d.jsonl", "corpus": {"kind": "squad", "path": "p"}, "out": "o", **extra}
        return build(EvalCompressorConfig, raw, prefix="")

    validation = held_out_records(records, config())
    validation_docs = {r.doc_id for r in validation}
    assert 0 < len(validation_docs) < 20  # whole documents: every record of a held-out document is kept
    assert validation == [r for r in records if r.doc_id in validation_docs]
    assert held_out_records(records, config(held_out="all")) == records
    with pytest.raises(ConfigError, match="held_out"):
        config(held_out="dev")
    with pytest.raises(ValueError, match="no held-out"):
        held_out_records([], config(held_out="all"))


class SummariesFailFor:
    """Stands in for a served generator whose summary of one chunk always comes back empty (a real model cannot be
    made to fail on demand), and for an embedder whose vector is the text's length: the ``Backend`` of client.py."""

    def __init__(self, marker: str):
        self.marker = marker

    def post(self, path, payload):
        usage = {"prompt_tokens": 5, "completion_tokens": 3}
        if path == "/v1/embeddings":
            data = [{"index": i, "embedding": [float(len(t)), 1.0]} for i, t in enumerate(payload["input"])]
            return {"data": data, "usage": usage}, 0
        reply = "" if self.marker in payload["messages"][0]["content"] else "A short summary."
        return {"choices": [{"message": {"content": reply}, "finish_reason": "stop"}], "usage": usage}, 0


def test_a_failed_summary_is_replaced_by_direct_encode_and_counted() -> None:
    chunks = {c.id: c for c in (Chunk("d/s0", "d", "section", "Normandy lies in France.", None, [], 0, 24, 6, ""),
                                Chunk("d/s1", "d", "section", "Unsummarisable text.", None, [], 25, 45, 4, ""))}
    records = [replace(_record("d", i), id=f"d/s{i}") for i in range(2)]
    data = HeldOut(records, chunks, list(chunks.values()), [], [], np.zeros((2, 2)), [], 1)
    config = EvalCompressorConfig(checkpoint="c", data="d.jsonl", corpus=CorpusConfig("squad", "p"), out="o")
    repairs: Counter[str] = Counter()
    vectors = summarize_with(config, data, Client(SummariesFailFor("Unsummarisable")), repairs)()
    assert repairs == {"summary_failed_direct_encode": 1}
    assert vectors[0].tolist() == [len("A short summary."), 1.0]  # the summary's embedding
    assert vectors[1].tolist() == [len(chunk_text_for_index(chunks["d/s1"])), 1.0]  # the chunk's own text


# each section's first 1,500 characters are summarised (the quickstart's setting; the job's default reads 12,000):
# prompt processing is most of a summary's cost on CPU, and every check below holds for any input length as long as
# the summaries job and the evaluation's regeneration read the same characters
SHORT_INPUTS = ("max_input_chars=1500",)


@pytest.mark.slow
def test_eval_compressor_four_methods(tmp_path: Path) -> None:
    summaries = tmp_path / "summaries.jsonl"
    assert main(["data", "summaries", "--config", str(ROOT / "configs/data/summaries.yaml"), "--out", str(summaries),
                 f"corpus.path={ROOT / 'data/squad/dev-v2.0-articles.json'}", "levels=[section]",
                 "max_summary_tokens=8", *SHORT_INPUTS, "tracking.backend=none"]) == 0
    # an untrained compressor is the mean of the children: it must score exactly like mean_pool
    checkpoint = save_checkpoint(SetCompressor(SetCompressorConfig(encoder=MINILM)), tmp_path / "ckpt", {})
    text_checkpoint = save_text_compressor(load_sentence_encoder(MINILM), tmp_path / "text", MINILM, {})
    out = tmp_path / "eval"
    assert main(["eval", "compressor", "--config", str(ROOT / "configs/eval/compressor.yaml"),
                 "--checkpoint", str(checkpoint), "--data", str(summaries), "--out", str(out),
                 f"corpus.path={ROOT / 'data/squad/dev-v2.0-articles.json'}", "max_summary_tokens=8", *SHORT_INPUTS,
                 f"extra_checkpoints={{compressor_text: {text_checkpoint}}}", "tracking.backend=none"]) == 0
    report = json.loads((out / "metrics.json").read_text())
    methods = report["methods"]
    assert set(methods) == {"compressor", "compressor_text", "mean_pool", "direct_encode", "summarize"}
    assert report["kinds"] == {"compressor": "set-compressor", "compressor_text": "text-compressor"}
    assert report["levels"] == ["section"] and report["n_documents"] == 1 and report["n_questions"] > 50
    assert methods["compressor"]["cosine_to_target"] == pytest.approx(methods["mean_pool"]["cosine_to_target"],
                                                                      abs=1e-4)
    # greedy summaries regenerated with the same settings reproduce e_gt
    assert methods["summarize"]["cosine_to_target"] > 0.99
    assert methods["summarize"]["llm_completion_tokens"] > 0 and methods["compressor"]["llm_completion_tokens"] == 0
    assert methods["summarize"]["repairs"] == {}  # every summary regenerated: none replaced by direct encode
    for row in methods.values():
        low, high = row["recall@5_ci95"]
        assert 0.0 <= low <= row["recall@5"] <= high <= 1.0 and row["seconds"] >= 0
    assert (out / "recall_vs_cost.png").stat().st_size > 5_000
    # every method kept its recall per question, in the report's question order, so the checkpoints are paired with
    # every baseline on the same questions: the paired means are the methods' own
    assert len(report["question_ids"]) == report["n_questions"]
    for row in methods.values():
        assert len(row["recall@5_per_question"]) == report["n_questions"]
        assert sum(row["recall@5_per_question"]) / report["n_questions"] == pytest.approx(row["recall@5"])
    pairs = {(row["method"], row["against"]): row for row in report["paired"]}
    assert set(pairs) == {(m, b) for m in ("compressor", "compressor_text")
                          for b in ("mean_pool", "direct_encode", "summarize")}
    for (method, baseline), row in pairs.items():
        assert row["n"] == report["n_questions"] and row["higher"] + row["lower"] <= row["n"]
        assert row["delta"] == pytest.approx(methods[method]["recall@5"] - methods[baseline]["recall@5"])

    # summarize: recorded reads the same summaries back (no generator call) with the cost their job recorded: its
    # tokens for the chunks evaluated, and the runbook record's wall time in proportion to them
    record = tmp_path / "summaries-job.json"
    record.write_text(json.dumps({"job": "summaries-squad", "wall_s": 120.0}))
    recorded_out = tmp_path / "eval-recorded"
    assert main(["eval", "compressor", "--config", str(ROOT / "configs/eval/compressor.yaml"),
                 "--checkpoint", str(checkpoint), "--data", str(summaries), "--out", str(recorded_out),
                 f"corpus.path={ROOT / 'data/squad/dev-v2.0-articles.json'}", *SHORT_INPUTS, "summarize=recorded",
                 f"summaries_record={record}", "extra_checkpoints={}", "tracking.backend=none"]) == 0
    recorded_report = json.loads((recorded_out / "metrics.json").read_text())
    recorded = recorded_report["methods"]["summarize"]
    kept = {r.id: r for r in read_jsonl(summaries, SummaryRecord)}
    evaluated = recorded_report["n_upper_chunks"]
    assert recorded["cosine_to_target"] == pytest.approx(1.0, abs=1e-4)
    assert recorded["seconds"] == round(120.0 * evaluated / len(kept), 3) and 0 < evaluated < len(kept)
    assert 0 < recorded["llm_completion_tokens"] < sum(r.completion_tokens for r in kept.values())
    assert recorded["recall@5"] == pytest.approx(methods["summarize"]["recall@5"], abs=0.05)
    assert recorded["source"].startswith(f"recorded: {evaluated} of the {len(kept)} summaries")
    assert recorded_report["methods"]["mean_pool"]["speedup_vs_summarize"] > 1
