"""`overstory train distill-scorer`: traces as distillation data (targets, the split by query, rows), the
cross-encoder students (pointwise with a sigmoid; ListNet and LambdaLoss with an identity head) learning the teacher's
preferences and saved with the activation configured, the LoRA LLM student served as
the scorer role, and bad configs. The teacher here is the oracle (tests/conftest.py: ``lattice_oracle_traces``):
its 0/100 scores are a clear signal for a few CPU steps; the LLM teacher's traces have their own test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from overstory.cli import main
from overstory.models.registry import MINILM, init_cross_encoder
from overstory.models.scorer import SLATE_SCHEMA, parse_slate_reply
from overstory.retrieval.lattice.scorers import LLMSlateScorer, Slate
from overstory.serving.client import Client
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.cross_encoder import saved_activation
from overstory.serving.launch import serve_in_background
from overstory.training.distill_data import (
    TracedSlate,
    heldout_queries,
    listwise_rows,
    llm_rows,
    pointwise_rows,
    read_slates,
    split_slates,
)
from tests.conftest import ROOT, distill


def _slate(query_id: str, scores: list, gold: list[bool]) -> TracedSlate:
    return TracedSlate(f"{query_id}/0/0", query_id, f"question {query_id}", [f"text {i}" for i in range(len(scores))],
                       True, scores, "because", gold)


def test_targets_rows_and_split() -> None:
    slate = _slate("q1", [80.0, None, 20.0], [True, True, False])
    assert slate.targets("teacher") == [0.8, None, 0.2]
    assert slate.targets("gold") == [1.0, None, 0.0]
    assert slate.targets("mix") == [0.9, None, 0.1]
    assert llm_rows([slate], 100, 50) == []  # a partly scored slate is no whole reply to learn
    full = _slate("q2", [10.0, 90.0], [False, True])
    (row,) = llm_rows([full], 100, 50)
    assert parse_slate_reply(row["completion"][0]["content"], 2).scores == {0: 10.0, 1: 90.0}
    assert "question q2" in row["prompt"][0]["content"]
    points = pointwise_rows([slate, full], "teacher", 100)
    assert points["label"] == [0.8, 0.2, 0.1, 0.9] and len(points["query"]) == 4
    lists = listwise_rows([slate, _slate("q3", [50.0, None], [True, False])], "gold", 100, label_scale=10.0)
    assert lists["labels"] == [[10.0, 0.0]]  # the one-candidate slate has no order to learn
    # the split is by query, fixed per query whatever else is present, and never empty or total
    queries = {f"q{i}" for i in range(30)}
    held = heldout_queries(queries, 0.2)
    assert 0 < len(held) < 30 and held == heldout_queries(queries, 0.2)
    assert heldout_queries(queries | {"another"}, 0.2) - {"another"} == held
    slates = [_slate(q, [1.0], [True]) for q in sorted(queries) for _ in range(2)]
    train, heldout = split_slates(slates, 0.2)
    assert {s.query_id for s in train}.isdisjoint({s.query_id for s in heldout}) and len(heldout) == 2 * len(held)


def test_read_slates_skips_unusable_and_names_a_broken_line(tmp_path: Path) -> None:
    good = {"id": "q/0/0", "query_id": "q", "query": "?", "texts": ["a", "b"], "leaf": True,
            "raw_scores": [10.0, None], "leads_to_gold": [True, False], "parsed": True}
    unparsed = {**good, "id": "q/0/1", "parsed": False}
    unscored = {**good, "id": "q/0/2", "raw_scores": [None, None]}
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (good, unparsed, unscored)) + "\n")
    assert [s.id for s in read_slates(path)] == ["q/0/0"]
    path.write_text(json.dumps(good) + "\n{broken\n")
    with pytest.raises(ValueError, match=r"t.jsonl:2"):
        read_slates(path)


def _squared_error(folder: str, slates: list[TracedSlate]) -> float:
    """Mean squared error of a cross-encoder's scores against the teacher's targets (score / 100)."""
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(folder, device="cpu")
    rows = pointwise_rows(slates, "teacher", 300)
    scores = model.predict(list(zip(rows["query"], rows["text"], strict=True)), batch_size=64)
    return float(np.mean((np.asarray(scores) - np.asarray(rows["label"])) ** 2))


def test_cross_encoder_student_moves_towards_the_teacher(ce_student: Path, lattice_oracle_traces: Path,
                                                         tmp_path: Path) -> None:
    metrics = json.loads((ce_student / "metrics.json").read_text())
    manifest = json.loads((ce_student / "final" / "overstory.json").read_text())
    assert metrics["steps"] == 40 and metrics["n_heldout_rows"] > 0 and np.isfinite(metrics["eval_loss"])
    assert manifest["distilled"] and manifest["teachers"] == ["oracle"] and manifest["student"] == "cross_encoder"
    assert [trace["slate_schema"] for trace in manifest["trace_files"]] == [SLATE_SCHEMA]
    assert saved_activation(ce_student / "final") == metrics["activation"] == "sigmoid"  # the config's default
    held = set(json.loads((ce_student / "heldout_queries.json").read_text()))
    train = [s for s in read_slates(lattice_oracle_traces) if s.query_id not in held]
    start = tmp_path / "untrained"
    init_cross_encoder(MINILM, max_length=128).save(str(start))
    # The untrained head scores everything near 0.5. Forty CPU steps learn the teacher's score distribution (most
    # candidates score 0), which this checks; how well the student ranks is what `eval lattice` measures.
    assert _squared_error(str(ce_student / "final"), train) < _squared_error(str(start), train) - 0.05


@pytest.mark.parametrize("loss", ["listwise", "lambdaloss"])
def test_listwise_students_with_an_identity_head_and_gold_targets(loss: str, lattice_oracle_traces: Path,
                                                                  tmp_path: Path) -> None:
    """ListNet and LambdaLoss students saved with the identity activation they were configured with, so the server
    serves their raw logits (tests/retrieval/test_lattice_listwise_cross_encoder.py serves one and ranks with it)."""
    out = distill(lattice_oracle_traces, tmp_path / loss, "distill_scorer_cross_encoder.yaml", f"loss={loss}",
                  "activation=identity", "targets=gold", "train.max_steps=4", "train.batch_size=4",
                  "train.max_length=96", "max_candidate_chars=200")
    metrics = json.loads((out / "metrics.json").read_text())
    manifest = json.loads((out / "final" / "overstory.json").read_text())
    assert metrics["loss"] == loss and metrics["steps"] == 4 and np.isfinite(metrics["train_loss"])
    assert metrics["activation"] == manifest["config"]["activation"] == saved_activation(out / "final") == "identity"
    assert manifest["targets"] == "gold" and not manifest["distilled"]  # gold-trained: never called distillation


def test_a_listwise_loss_trains_through_the_activation_it_serves(lattice_oracle_traces: Path, ce_student: Path,
                                                                  tmp_path: Path) -> None:
    """ListNet under a served sigmoid sees the sigmoid's outputs (sentence-transformers' activation_fn), so the same
    start, seed, rows and steps give another loss than under identity: the two activations are two models to compare.
    Both start from the pointwise student. How far apart the two losses land depends on how widely that student's
    logits spread (2.5e-3 here, 8e-4 in one CI run, 4e-5 from a new head's near-zero logits), so the bound is what an
    activation that never reached the loss would give: the same computation from the same seed, whose two runs
    matched bit for bit here (1.9141947 twice)."""
    train_loss = {}
    for activation in ("identity", "sigmoid"):
        out = distill(lattice_oracle_traces, tmp_path / activation, "distill_scorer_cross_encoder.yaml",
                      f"model={ce_student / 'final'}", "loss=listwise", f"activation={activation}", "targets=gold",
                      "train.max_steps=2", "train.batch_size=4", "train.max_length=96", "max_candidate_chars=200")
        train_loss[activation] = json.loads((out / "metrics.json").read_text())["train_loss"]
        assert saved_activation(out / "final") == activation
    assert abs(train_loss["sigmoid"] - train_loss["identity"]) > 1e-5, train_loss


def test_llm_student_is_an_adapter_the_server_serves_as_the_scorer(llm_student: Path) -> None:
    final = llm_student / "final"
    manifest = json.loads((final / "overstory.json").read_text())
    assert (final / "adapter_config.json").exists() and manifest["adapter"] and manifest["student"] == "llm"
    assert json.loads((llm_student / "metrics.json").read_text())["steps"] == 2
    role = RoleConfig(model=manifest["base_model"], adapter=str(final), max_new_tokens=200)
    with serve_in_background(ServeConfig(port=0, roles={"scorer": role})) as url:
        scorer = LLMSlateScorer(Client.from_url(url), max_tokens=200, max_reasoning_chars=60, max_attempts=1)
        (reply,) = scorer.score([Slate("q", "Which city hosted the 1936 Olympics?", ["a", "b"],
                                       ["Berlin hosted the 1936 Summer Olympics.", "Paris is in France."], True)])
    assert reply.calls == 1 and reply.input_tokens > 0 and reply.output_tokens > 0
    assert reply.parsed and set(reply.scores) <= {0, 1}  # the grammar keeps the student's reply in the schema


@pytest.mark.parametrize(("overrides", "message"), [
    (["student=llm", "targets=gold"], "targets='gold' needs student=cross_encoder"),
    (["student=llm", "loss=listwise"], "loss applies to student=cross_encoder only"),
    (["student=llm", "activation=identity"], "activation applies to student=cross_encoder only"),
    (["student=cross_encoder", "activation=tanh"], "activation: 'tanh' is not one of ['sigmoid', 'identity']"),
    (["student=ranker"], "student: 'ranker' is not one of ['llm', 'cross_encoder']"),
])
def test_bad_configs_name_the_key(overrides: list[str], message: str, tmp_path: Path, capsys) -> None:
    code = main(["train", "distill-scorer", "--config", str(ROOT / "configs/train/distill_scorer_llm.yaml"),
                 f"out={tmp_path}", "tracking.backend=none", *overrides])
    assert code == 2 and message in capsys.readouterr().err


def test_traces_without_scored_slates_are_refused(tmp_path: Path) -> None:
    traces = tmp_path / "empty.jsonl"
    traces.write_text("")
    with pytest.raises(ValueError, match="holds no scored slates"):
        main(["train", "distill-scorer", "--config", str(ROOT / "configs/train/distill_scorer_llm.yaml"),
              f"traces={traces}", f"out={tmp_path / 'out'}", "tracking.backend=none"])


def _rerun(traces: Path, out: Path, *overrides: str) -> int:
    return main(["train", "distill-scorer", "--config", str(ROOT / "configs/train/distill_scorer_cross_encoder.yaml"),
                 f"traces={traces}", f"out={out}", "train.val_fraction=0.2", "tracking.backend=none",
                 "train.batch_size=4", "train.max_length=64", "max_candidate_chars=100", "train.save_steps=1",
                 *overrides])


def test_a_rerun_that_changes_what_is_trained_is_refused(lattice_oracle_traces: Path, tmp_path: Path,
                                                         capsys) -> None:
    """Two steps with a checkpoint after each, then reruns from those checkpoints: another activation, loss or set
    of traces is refused naming the keys before anything in out changes; a longer run (max_steps), evaluated at
    another cadence (eval_at), resumes; and checkpoints without a record of their settings are refused too."""
    out = tmp_path / "ce"
    assert _rerun(lattice_oracle_traces, out, "train.max_steps=2") == 0
    assert (out / "checkpoints" / "checkpoint-2").is_dir()
    recorded = (out / "resume_settings.json").read_text()
    held = (out / "heldout_queries.json").read_text()
    capsys.readouterr()
    other_traces = tmp_path / "traces.jsonl"
    other_traces.write_text("".join(lattice_oracle_traces.read_text().splitlines(keepends=True)[:-3]))
    for traces, overrides, keys in [
            (lattice_oracle_traces, ["activation=identity"], "activation differ"),
            (lattice_oracle_traces, ["loss=listwise", "train.lr=1e-4"], "loss, train.lr differ"),
            (other_traces, ["train.val_fraction=0.5"], "traces_sha256, train.val_fraction differ")]:
        assert _rerun(traces, out, "train.max_steps=3", *overrides) == 2
        assert f"{out / 'checkpoints'} was trained with other settings ({keys})" in capsys.readouterr().err
        assert (out / "resume_settings.json").read_text() == recorded
        assert (out / "heldout_queries.json").read_text() == held
    assert _rerun(lattice_oracle_traces, out, "train.max_steps=3", "train.eval_at=epoch") == 0
    assert "resuming from" in capsys.readouterr().out
    assert json.loads((out / "metrics.json").read_text())["steps"] == 3
    (out / "resume_settings.json").unlink()
    assert _rerun(lattice_oracle_traces, out, "train.max_steps=4") == 2
    assert "without a record of its settings" in capsys.readouterr().err
