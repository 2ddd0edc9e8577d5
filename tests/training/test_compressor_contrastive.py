"""The contrastive objective (training/compressor_contrastive.py), and the set compressor trained with it on real QASPER
questions without summaries (``groups``: the papers' own sections and subsections, children embedded with MiniLM):
questions left out or covered by no chunk are counted, not dropped from the batches without a word."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from overstory.cli import main
from overstory.core.config import ConfigError, load_config
from overstory.core.records import read_jsonl
from overstory.data_pipeline.compressor_groups import ChildGroup, question_counts, uncovered_questions
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.data_pipeline.splits import split_by_document
from overstory.models.compressor import load_compressor
from overstory.training.compressor import CompressorJobConfig
from overstory.training.compressor_contrastive import DocumentBatches, QuestionPositives

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/train/compressor-qasper-contrastive.yaml"
QASPER = ROOT / "data/qasper"  # the shipped slice: 8 papers (6 dev, 2 train), 25 questions of every evidence kind


def test_questions_no_chunk_covers_are_counted() -> None:
    # three questions; the first chunk covers question 0, the second questions 0 and 2, the third none
    positives = QuestionPositives(torch.zeros(3, 4), by_record=[[0], [0, 2], []])
    assert positives.covered_records == 2 and positives.uncovered_questions == 1  # question 1
    assert positives.coverage("train") == {"train_chunks_covering": 2, "train_questions": 3,
                                           "train_questions_uncovered": 1}
    assert QuestionPositives(torch.zeros(0, 4), by_record=[[], []]).uncovered_questions == 0


def test_document_batches_hold_one_document_each_and_every_record_once_an_epoch() -> None:
    doc_ids = [f"doc{i % 3}" for i in range(20)] + ["doc3"] * 9  # 7, 7, 6 and 9 records
    batches = DocumentBatches(doc_ids, batch_size=4, seed=1)
    first, second = list(batches), list(batches)
    for epoch in (first, second):
        assert len(epoch) == len(batches) == 2 + 2 + 2 + 3 and all(len(b) <= 4 for b in epoch)
        assert sorted(i for b in epoch for i in b) == list(range(len(doc_ids)))
        assert all(len({doc_ids[i] for i in b}) == 1 for b in epoch)
    assert first != second  # another order every epoch
    assert list(DocumentBatches(doc_ids, batch_size=4, shuffle=False)) == \
        list(DocumentBatches(doc_ids, batch_size=4, shuffle=False))


def test_without_summaries_only_the_contrastive_objective_runs() -> None:
    """``groups`` builds the inputs without summaries: an objective with the MSE term is refused, naming the key."""
    for objective in ("mse", "mse+contrastive"):
        with pytest.raises(ConfigError, match=rf"train.objective '{objective.replace('+', '.')}' needs summaries .*"
                                              r"set data to"):
            load_config(CompressorJobConfig, CONFIG, [f"train.objective={objective}"])
    with pytest.raises(ConfigError, match="give data .* or groups .* exactly one"):
        load_config(CompressorJobConfig, CONFIG, ["data=runs/data/summaries/qasper_train.jsonl"])
    with pytest.raises(ConfigError, match="give data .* or groups .* exactly one"):
        load_config(CompressorJobConfig, ROOT / "configs/train/compressor.yaml", ["data="])
    with pytest.raises(ConfigError, match="encoder .* applies to groups only"):
        load_config(CompressorJobConfig, ROOT / "configs/train/compressor.yaml", ["encoder=builtin:other"])
    loaded = load_config(CompressorJobConfig, CONFIG)
    assert loaded.data == "" and loaded.groups.levels == ["subsection", "section"]
    assert loaded.questions.limit_docs == 0  # every train paper's questions


def test_left_out_and_uncovered_questions_are_counted_on_real_papers() -> None:
    documents, questions = load_corpus(CorpusConfig("qasper", str(QASPER)))
    docs = {d.id for d in documents}
    kept, counts = question_counts(questions, docs)
    figure_only = [q for q in questions if q.metadata["figure_table_only"]]
    assert figure_only and all(not q.evidence for q in figure_only)  # the slice has figure/table-only questions
    assert counts == {"questions": sum(bool(q.evidence) for q in questions), "figure_table_only": len(figure_only),
                      "no_text_evidence": sum(not q.evidence and not q.metadata["figure_table_only"]
                                              for q in questions)}
    assert sum(counts.values()) == len(questions) and kept == [q for q in questions if q.evidence]
    sections = [c for c in build_hierarchies(documents, HierarchyConfig()) if c.level == "section"]
    assert uncovered_questions(kept, sections) == 0  # every paragraph lies in a section
    first = [next(c for c in sections if c.doc_id == d) for d in sorted(docs)]  # each paper's first section only
    expected = sum(not any(c.doc_id == s.doc_id and c.start < s.end and s.start < c.end for s in q.evidence
                           for c in first) for q in kept)
    assert 0 < uncovered_questions(kept, first) == expected


def _train(out: Path, *extra: str) -> int:
    """The config's run on the shipped slice, with shuffled batches unless ``extra`` says otherwise."""
    return main(["train", "compressor", "--config", str(CONFIG), f"out={out}", f"questions.path={QASPER}",
                 "train.batching=shuffled", "tracking.backend=none", *extra])


@pytest.mark.slow
def test_contrastive_without_summaries_lowers_validation_loss_and_counts_questions(tmp_path: Path, capsys) -> None:
    """Real QASPER questions, no summaries: the groups come from the papers' hierarchy (MiniLM children); training
    lowers the contrastive loss on the validation papers' questions, and every question is accounted for."""
    out = tmp_path / "contrastive"
    assert _train(out, "train.epochs=4", "train.lr=1e-4") == 0
    printed = capsys.readouterr().out
    assert "groups without summaries: embedding the" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    # measured: 2.883 at the mean-pool start, 2.781 after four epochs (validation: 5 questions of 2 papers)
    assert metrics["best_val_objective"] < metrics["initial_val_objective"]
    history = metrics["history"]
    assert history[0]["val_contrastive"] == pytest.approx(history[0]["mean_pool_contrastive"], rel=1e-4)
    assert metrics["best_val_mse"] is None and "val_mse" not in history[-1]  # no summary: no MSE figures

    groups = list(read_jsonl(out / "groups.jsonl", ChildGroup))
    assert {g.level for g in groups} == {"subsection", "section"} and len(groups) == metrics["n_train"] + \
        metrics["n_val"]
    assert all(len(g.child_embeddings) == len(g.child_ids) and len(g.child_embeddings[0]) == 384 for g in groups)
    documents, questions = load_corpus(CorpusConfig("qasper", str(QASPER)))
    train, val = split_by_document(groups, 0.2)
    for name, split in (("train", train), ("val", val)):
        _, expected = question_counts(questions, {g.doc_id for g in split})
        assert {k: metrics[f"{name}_questions" + (f"_{k}" if k != "questions" else "")] for k in expected} == \
            expected, name
        assert metrics[f"{name}_questions_uncovered"] == 0  # sections and subsections cover all the text
    assert sum(metrics[f"{s}_questions{k}"] for s in ("train", "val")
               for k in ("", "_figure_table_only", "_no_text_evidence")) == len(questions)
    assert sum(metrics[f"{s}_questions_figure_table_only"] for s in ("train", "val")) == 2
    best = json.loads((out / "best" / "overstory.json").read_text())
    assert best["data"] == str(out / "groups.jsonl") and best["encoder"] == "builtin:all-minilm-l6-v2"
    load_compressor(out / "best", embedding_dim=384)

    assert _train(out, "train.epochs=5", "train.lr=1e-4") == 0  # resumes: reads the groups it built
    assert "groups without summaries" not in capsys.readouterr().out
    assert json.loads((out / "last" / "trainer_state.json").read_text())["epoch"] == 5
    with pytest.raises(ValueError, match="groups.jsonl was built under other settings"):
        _train(out, "train.epochs=5", "train.lr=1e-4", "groups.levels=[section]")

    by_document = tmp_path / "by_document"  # each batch one paper's chunks; the groups are read, not built again
    by_document.mkdir()
    for name in ("groups.jsonl", "groups.hierarchy.jsonl", "groups.settings.json"):
        (by_document / name).write_bytes((out / name).read_bytes())
    assert _train(by_document, "train.epochs=2", "train.batching=document") == 0
    assert "groups without summaries" not in capsys.readouterr().out
    rows = json.loads((by_document / "metrics.json").read_text())["history"]
    assert len(rows) == 3 and rows[-1]["val_contrastive"] != rows[0]["val_contrastive"]
