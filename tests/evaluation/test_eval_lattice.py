"""`overstory eval lattice`: the IR measures against hand-computed values, the students' agreement with the teacher,
LATTICE++ fusion, and the whole table on the session's HotpotQA tree (tests/conftest.py) with the oracle, a distilled
cross-encoder (calibration on and off, and the same weights with an identity head), BM25, dense, hybrid and LATTICE++;
student rows that would mislead are refused by name; the LoRA LLM student's search has a
short run of its own (its cost comes from the server's usage)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from overstory.cli import main
from overstory.evaluation.lattice import markdown_table, retrieval_metrics
from overstory.evaluation.lattice_agreement import agreement, agreement_cell
from overstory.retrieval.lattice.fusion import lattice_pp, weighted_fusion
from overstory.retrieval.lattice.scorers import OracleSlateScorer, SlateScore
from overstory.retrieval.lattice.tree import Tree
from tests.conftest import HOTPOTQA_150, ROOT


def test_retrieval_metrics_match_trec_eval_by_hand() -> None:
    gold = {"q1": {"a", "b"}, "q2": {"z"}}
    metrics = retrieval_metrics({"q1": [("a", 0.9), ("c", 0.5), ("b", 0.1)]}, gold)  # q2: no ranking at all
    ndcg_q1 = (1 + 1 / math.log2(4)) / (1 + 1 / math.log2(3))
    assert metrics["ndcg@10"] == pytest.approx(ndcg_q1 / 2, abs=1e-4)
    assert metrics["recall@10"] == metrics["recall@100"] == 0.5
    low, high = metrics["ndcg@10_ci95"]
    assert low <= metrics["ndcg@10"] <= high
    # the system's own order counts, not the score values (equal scores keep the ranking given)
    tied = retrieval_metrics({"q1": [("c", 1.0), ("a", 1.0), ("b", 1.0)], "q2": [("z", 1.0)]}, gold)
    assert tied["ndcg@10"] == pytest.approx((1 / math.log2(3) + 1 / math.log2(4)) / (1 + 1 / math.log2(3)) / 2
                                            + 0.5, abs=1e-4)


def test_lattice_pp_fuses_min_max_normalised_scores() -> None:
    fused = lattice_pp([("a", 0.9), ("b", 0.5)], [("b", 20.0), ("c", 10.0)], [("c", 0.8), ("a", 0.2)])
    scores = dict(fused)
    assert scores["a"] == pytest.approx(0.6)  # lattice 1.0 * 0.6, BM25 absent (0), dense min (0)
    assert scores["b"] == pytest.approx(0.2)  # lattice min (0), BM25 max 0.2, dense absent
    assert scores["c"] == pytest.approx(0.2)
    assert [doc for doc, _ in fused] == ["a", "b", "c"]  # ties by id
    with pytest.raises(ValueError, match="same sources"):
        weighted_fusion({"lattice": {"a": 1.0}}, {"bm25": 1.0})


class _Reversed:
    """A scorer that ranks every slate backwards from the oracle (a student that learned the opposite)."""

    listwise = False

    def __init__(self, oracle: OracleSlateScorer):
        self.oracle = oracle

    def score(self, slates):
        return [SlateScore(scores={i: 100.0 - s for i, s in reply.scores.items()})
                for reply in self.oracle.score(slates)]


def test_agreement_with_the_teacher(lattice_tree: Path, lattice_oracle_traces: Path) -> None:
    slates = [json.loads(line) for line in lattice_oracle_traces.read_text().splitlines()]
    queries = lattice_oracle_traces.with_name("traces.queries.jsonl").read_text().splitlines()
    oracle = OracleSlateScorer(Tree.load(lattice_tree), {q["id"]: set(q["gold"]) for q in map(json.loads, queries)})
    same = agreement(oracle, slates)
    assert same["top1_agreement"] == 1.0 and same["n_tau"] > 0 and same["kendall_tau"] == pytest.approx(1.0)
    opposite = agreement(_Reversed(oracle), slates)
    assert opposite["top1_agreement"] == 0.0 and opposite["kendall_tau"] == pytest.approx(-1.0)
    assert same["n_slates"] == len(slates) and same["tau_undefined"] > 0  # all-0 slates have no order


class _Fixed:
    """A student whose scores per slate are given (a flat one scores every candidate alike)."""

    listwise = False

    def __init__(self, scores: list[list[float]]):
        self.scores = scores

    def score(self, slates):
        return [SlateScore(scores=dict(enumerate(row))) for row in self.scores[: len(slates)]]


def test_top1_breaks_a_students_ties_fairly_and_shows_its_references(tmp_path: Path) -> None:
    """A student that scores every candidate alike must not inherit the slate order's bias (``argmax`` took the first
    of a tie, and the teacher's best is often first): its top-1 is a random pick's, it has no tau, and it is counted
    flat; the references (chance, always the first candidate) sit beside the figure, and each slate's scores are
    kept."""
    def slate(qid: str, teacher: list[float | None]) -> dict:
        ids = [f"n{i}" for i in range(len(teacher))]
        return {"query_id": qid, "query": "q", "node_ids": ids, "texts": ids, "leaf": False, "raw_scores": teacher}

    slates = [slate("a", [90, 10, 10, 10]), slate("b", [10, 90, 90, 10]), slate("c", [50, 50, 50, 50])]
    flat = agreement(_Fixed([[5, 5, 5, 5]] * 3), slates, record=tmp_path / "flat.jsonl")
    assert flat["top1_agreement"] == pytest.approx((1 / 4 + 2 / 4) / 2)  # not 0.5, the first candidate's record
    assert flat["top1_chance"] == flat["top1_agreement"] and flat["top1_first_candidate"] == 0.5
    assert (flat["student_flat"], flat["teacher_ties"], flat["n_top1"], flat["n_tau"]) == (2, 1, 2, 0)
    assert flat["kendall_tau"] is None and flat["tau_undefined"] == 3
    kept = [json.loads(line) for line in (tmp_path / "flat.jsonl").read_text().splitlines()]
    assert [k["student"] for k in kept] == [[5.0] * 4] * 3 and kept[1]["teacher"] == [10, 90, 90, 10]

    tied = agreement(_Fixed([[9, 9, 1, 1], [1, 9, 9, 1], [1, 2, 3, 4]]), slates)  # half, then all of its best
    assert tied["top1_agreement"] == pytest.approx(0.75) and tied["student_flat"] == 0 and tied["n_tau"] == 2
    cell = agreement_cell(tied)
    assert cell.startswith(f"{tied['kendall_tau']} / 0.75 (3 slates; top-1 by chance 0.375, first candidate 0.5")
    assert cell.endswith("flat on 0 of 2)") and agreement_cell(None) == "-"


def _eval(out: Path, *overrides: str) -> dict:
    assert main(["eval", "lattice", "--config", str(ROOT / "configs/eval/lattice.yaml"), *HOTPOTQA_150,
                 f"out={out}", "tracking.backend=none", *overrides]) == 0
    return json.loads((out / "metrics.json").read_text())


def _resaved(student: Path, out: Path, activation) -> Path:
    """``student``'s model saved again with another activation (same weights), with its held-out questions."""
    from sentence_transformers import CrossEncoder

    CrossEncoder(str(student / "final"), device="cpu", activation_fn=activation).save(str(out / "final"))
    shutil.copy(student / "heldout_queries.json", out / "heldout_queries.json")
    return out / "final"


def test_eval_lattice_table(lattice_tree: Path, lattice_oracle_traces: Path, ce_student: Path, tmp_path: Path) -> None:
    """The table with two cross-encoder rows of one model: served with its sigmoid (probabilities) and saved again
    with an identity head (raw logits). The scorer maps logits through the same sigmoid, so both rank alike."""
    model = ce_student / "final"
    identity = _resaved(ce_student, tmp_path / "identity", torch.nn.Identity())
    report = _eval(tmp_path / "eval", f"tree={lattice_tree}", f"agreement_traces={lattice_oracle_traces}",
                   f"heldout_from={ce_student}", "--compare", "oracle,ce_pointwise,ce_pointwise_nocal,"
                   "ce_pointwise_identity,bm25,dense,hybrid,lattice++", f"systems.ce_pointwise.model={model}",
                   f"systems.ce_pointwise_nocal.model={model}", f"systems.ce_pointwise_identity.model={identity}",
                   "systems.lattice++.of=oracle", "search.iterations=8")
    tmp_path = tmp_path / "eval"
    held = json.loads((ce_student / "heldout_queries.json").read_text())
    systems = report["systems"]
    assert report["n_questions"] == len(held) > 0
    assert list(systems) == ["oracle", "ce_pointwise", "ce_pointwise_nocal", "ce_pointwise_identity", "bm25", "dense",
                             "hybrid", "lattice++"]
    logits, probabilities = systems["ce_pointwise_identity"], systems["ce_pointwise"]
    assert logits["ndcg@10"] == pytest.approx(probabilities["ndcg@10"], abs=1e-6)
    assert logits["agreement"]["top1_agreement"] == probabilities["agreement"]["top1_agreement"]
    top10 = {name: [[doc for doc, _ in json.loads(line)["ranking"][:10]] for line in
                    (tmp_path / "rankings" / f"{name}.jsonl").read_text().splitlines()]
             for name in ("ce_pointwise", "ce_pointwise_identity")}
    assert top10["ce_pointwise"] == top10["ce_pointwise_identity"]
    for name, row in systems.items():
        for key in ("ndcg@10", "recall@10", "recall@100"):
            low, high = row[f"{key}_ci95"]
            assert 0.0 <= low <= row[key] <= high <= 1.0, (name, key)
    assert systems["oracle"]["recall@100"] == 1.0 and systems["oracle"]["ndcg@10"] == 1.0  # the gold is reachable
    assert systems["oracle"]["llm_calls"] == 0 and systems["bm25"]["llm_calls"] == 0
    assert systems["ce_pointwise"]["llm_calls"] > 0 and systems["ce_pointwise"]["slates"] > 0  # one call per slate
    assert systems["ce_pointwise"]["calibration"] and not systems["ce_pointwise_nocal"]["calibration"]
    assert systems["lattice++"]["seconds"] == systems["oracle"]["seconds"]  # the fusion costs its search
    agree = systems["ce_pointwise"]["agreement"]
    assert agree["n_slates"] > 0 and agree["n_tau"] + agree["tau_undefined"] <= agree["n_slates"]
    assert agree["top1_agreement"] is None or 0.0 <= agree["top1_agreement"] <= 1.0
    assert "agreement" not in systems["oracle"]  # only students are compared with their teacher
    rankings = [json.loads(line) for line in (tmp_path / "rankings" / "lattice++.jsonl").read_text().splitlines()]
    assert {r["id"] for r in rankings} == set(held) and all(r["ranking"] for r in rankings)
    table = (tmp_path / "table.md").read_text()
    assert "ce_pointwise_nocal (calibration off)" in table and "| lattice++ |" in table
    pointwise = systems["ce_pointwise"]  # a cross-encoder scores every candidate: no slate fails
    assert pointwise["failed_slates"] == 0 and pointwise["slates_total"] >= pointwise["slates"] > 0
    assert f"| 0/{pointwise['slates_total']} |" in table.split("| ce_pointwise |")[1].splitlines()[0]
    assert (tmp_path / "quality_vs_cost.png").stat().st_size > 0
    # where each search loses the gold: the oracle scores a gold-leading child first in every slate that holds one;
    # every slate a search scored is counted at its expanded node's depth, flat retrieval has none
    oracle_routing = systems["oracle"]["routing"]
    assert oracle_routing["0"]["with_gold"] == oracle_routing["0"]["slates"] > 0
    assert all(r["gold_first"] == r["with_gold"] for r in oracle_routing.values())
    assert sum(r["slates"] for r in pointwise["routing"].values()) == pointwise["slates_total"]
    assert "routing" not in systems["bm25"] and "| ce_pointwise | " in table.split("Where each search loses")[1]
    assert (tmp_path / "routing.png").stat().st_size > 0


def test_eval_lattice_llm_student_counts_served_tokens(lattice_tree: Path, lattice_oracle_traces: Path,
                                                       llm_student: Path, tmp_path: Path) -> None:
    report = _eval(tmp_path, f"tree={lattice_tree}", "agreement_traces=", f"heldout_from={llm_student}", "limit=1",
                   "--compare", "llm_student", f"systems.llm_student.model={llm_student / 'final'}",
                   "search.iterations=2", "max_tokens=160", "max_reasoning_chars=40", "max_candidate_chars=120",
                   "max_attempts=1")
    row = report["systems"]["llm_student"]
    assert report["n_questions"] == 1 and row["llm_calls"] >= 1
    assert 0 <= row["failed_slates"] <= row["slates_total"] == row["slates"]  # one question
    assert row["repairs"] == {kind: n for kind, n in row["problems"].items() if n}  # each slate problem, counted
    assert row["input_tokens"] > 0 and row["output_tokens"] > 0 and row["seconds"] > 0


def test_the_table_shows_failed_slates_and_repairs_beside_the_figures() -> None:
    """A search row counts its failed slates among those scored and its repairs by kind; a flat index has no
    slates; a row from an older report, without the counts, shows that it has none."""
    cost = {"ndcg@10": 0.5, "llm_calls": 2, "input_tokens": 10, "output_tokens": 5, "seconds": 1.0}
    table = markdown_table({"n_questions": 2, "systems": {
        "llm": {**cost, "slates_total": 8, "failed_slates": 3, "repairs": {"missing": 4, "unscored_candidates": 2}},
        "bm25": {**cost, "repairs": {}}, "older": cost}})
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert "| failed slates | repairs |" in rows["system"]
    assert "| 3/8 | missing 4, unscored_candidates 2 |" in rows["llm"]
    assert "| - | 0 |" in rows["bm25"] and "| - | - |" in rows["older"]


def test_students_that_would_mislead_are_refused_by_name(lattice_tree: Path, ce_student: Path, tmp_path: Path,
                                                        capsys) -> None:
    """Before any stack starts: a student row searched on questions it trained on (no heldout_from: every question),
    a held-out split from a folder that has none, and a cross-encoder folder whose saved activation the server does
    not serve."""
    args = ["eval", "lattice", "--config", str(ROOT / "configs/eval/lattice.yaml"), *HOTPOTQA_150, f"out={tmp_path}",
            "tracking.backend=none", f"tree={lattice_tree}", "agreement_traces=", "--compare", "ce_pointwise"]
    assert main([*args, "heldout_from=", f"systems.ce_pointwise.model={ce_student / 'final'}"]) == 2
    assert re.search(r"systems.ce_pointwise.model: .* was trained on \d+ of the \d+ questions searched",
                     capsys.readouterr().err)
    assert main([*args, f"heldout_from={tmp_path}", f"systems.ce_pointwise.model={ce_student / 'final'}"]) == 2
    assert f"heldout_from: {tmp_path} has no heldout_queries.json" in capsys.readouterr().err
    tanh = _resaved(ce_student, tmp_path / "tanh", torch.nn.Tanh())
    assert main([*args, f"heldout_from={ce_student}", f"systems.ce_pointwise.model={tanh}"]) == 2
    assert "systems.ce_pointwise.model: " in (err := capsys.readouterr().err) and "activation Tanh is not served" in err


def test_unknown_system_and_bad_fusion_name_the_key(tmp_path: Path, capsys) -> None:
    args = ["eval", "lattice", "--config", str(ROOT / "configs/eval/lattice.yaml"), f"out={tmp_path}",
            "tracking.backend=none"]
    assert main([*args, "--compare", "oracle,bm26"]) == 2
    assert "bm26 not in systems" in capsys.readouterr().err
    assert main([*args, "--compare", "lattice++", "systems.lattice++.of=bm25"]) == 2
    assert "systems.lattice++.of must name a search system" in capsys.readouterr().err
