"""The CPU teacher's outputs shipped in data/teacher/ (data/teacher/README.md): the HotpotQA tree holds every
paragraph of the corpus it names, the QASPER trees each paper whole under one branch, the traces are the current
slate schema's and complete, all were served by the teacher, and the jobs that read them (distill-scorer, eval
lattice's recorded row, eval planner's answers, the planner traces) find what they need. No model runs: a stale or
cut copy fails here instead of in an hour-long job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.core.config import load_config
from overstory.data_pipeline.lattice_tree import LatticeTreeConfig, corpus_leaves
from overstory.evaluation.lattice_recorded import job_wall_seconds, queries_file
from overstory.models.registry import QWEN_CODER, SMOLLM2
from overstory.models.scorer import SLATE_SCHEMA
from overstory.retrieval.lattice.tree import Tree
from overstory.training.distill_data import read_slates

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "data/teacher"
HOTPOTQA = SHIPPED / "lattice/hotpotqa"
QASPER = SHIPPED / "lattice/qasper_train"


def _named_by_the_teacher(folder: Path, tree: Tree) -> dict:
    """Check that the teacher served the tree's summaries, one call at least per new node and none by the fallback;
    return the build record."""
    assert set(json.loads((folder / "summaries.settings.json").read_text())["served"].values()) >= {QWEN_CODER}
    build = json.loads((folder / "build.json").read_text())
    summaries = build["summaries"]
    assert summaries["placements"].get("summaries_fallback", 0) == 0
    assert summaries["llm_calls"] >= tree.stats()["internal"] - 1
    return build


def test_the_shipped_tree_holds_every_hotpotqa_paragraph_and_was_named_by_the_teacher() -> None:
    config = load_config(LatticeTreeConfig, ROOT / "configs/data/lattice_tree-hotpotqa-teacher.yaml", ["out=unused"])
    tree = Tree.load(HOTPOTQA / "tree.json")
    tree.validate(max_branching=config.clustering.m_max, expected_leaves={leaf.id for leaf in corpus_leaves(config)})
    _named_by_the_teacher(HOTPOTQA, tree)


def _check_traces(folder: Path, job: str, n_questions: int) -> None:
    """Check that ``folder``'s traces are the current slate schema's, scored by the teacher on the tree at the path it
    is restored to, complete (every question traced, every candidate scored, no failure) and recorded by their job."""
    traces = folder / "traces.jsonl"
    settings = json.loads((folder / "traces.settings.json").read_text())
    assert settings["slate_schema"] == SLATE_SCHEMA and settings["served"] == {"scorer": QWEN_CODER}
    assert settings["tree"] == f"runs/teacher/lattice/{folder.name}/tree.json"  # the path it is restored to
    slates = read_slates(traces)
    questions = {json.loads(line)["id"] for line in queries_file(traces).read_text().splitlines()}
    assert len(questions) == n_questions and {s.query_id for s in slates} == questions
    assert all(score is not None for slate in slates for score in slate.teacher_scores)  # one score per candidate
    assert not (folder / "traces.failures.jsonl").read_text().strip()
    assert job_wall_seconds("teacher", str(SHIPPED / f"jobs/{job}.json")) > 0


def test_the_shipped_traces_are_the_current_schema_complete_and_the_teachers() -> None:
    _check_traces(HOTPOTQA, "traces-hotpotqa", 40)


def test_the_shipped_qasper_traces_cover_the_questions_with_paragraph_evidence_on_the_shipped_tree() -> None:
    """32 of the 34 questions of the 10 papers have a paragraph of the tree as evidence (the other two only a figure
    or table); every slate's candidates are nodes of the shipped tree."""
    _check_traces(QASPER, "traces-qasper_train", 32)
    tree = Tree.load(QASPER / "tree.json")
    records = [json.loads(line) for line in (QASPER / "traces.jsonl").read_text().splitlines()]
    assert all({record["expanded"], *record["node_ids"]} <= set(tree.nodes) for record in records)


@pytest.mark.parametrize("split", ["train", "dev"])
def test_the_shipped_qasper_tree_keeps_its_papers_and_was_named_by_the_teacher(split: str) -> None:
    """The corpus (QASPER, the team's copy) is not in the repository, so each tree (the train papers the traces
    search, the dev papers eval pipeline searches) is checked against its own build record: every leaf a paragraph
    of one of the configured papers under the root, every internal node named by the teacher, none by the fallback."""
    config = load_config(LatticeTreeConfig, ROOT / f"configs/data/lattice_tree-qasper_{split}-teacher.yaml",
                         ["out=unused"])
    folder = SHIPPED / f"lattice/qasper_{split}"
    tree = Tree.load(folder / "tree.json")
    tree.validate(max_branching=config.clustering.m_max)
    build = _named_by_the_teacher(folder, tree)
    assert build["method"] == config.method == "hybrid" and tree.stats()["leaves"] == build["stats"]["leaves"]
    # every paper whole under one branch of the root: a branch a paper, or (more papers than a node's m_max
    # children: the 12 dev papers) a branch a cluster of whole papers
    branches = [{leaf.doc_id for leaf in tree.leaves(child)} for child in tree.nodes[tree.root].children]
    papers = [paper for branch in branches for paper in branch]
    assert len(papers) == len(set(papers)) == config.corpus.limit_docs and len(branches) <= config.clustering.m_max
    assert json.loads((SHIPPED / f"jobs/tree-qasper_{split}.json").read_text())["finished"] is True


@pytest.mark.parametrize(("dataset", "n", "served"), [("narrativeqa", 200, QWEN_CODER),
                                                      ("qasper_train", 300, f"{QWEN_CODER} (bfloat16)")])
def test_the_shipped_labels_are_the_teachers_and_resume_under_the_current_config(dataset: str, n: int,
                                                                                 served: str) -> None:
    """Every label by the teacher (as the server named it: QASPER's were made in bfloat16), summarised as shipped, and
    recorded under the settings the current config gives, so that the labels job resumes instead of refusing (run
    again for NarrativeQA, to rebuild the hierarchy beside them; QASPER's ships its job record and is skipped)."""
    from overstory.core.records import PseudoLabel, read_jsonl
    from overstory.data_pipeline.fanout import job_settings
    from overstory.data_pipeline.pseudo_labels import PseudoLabelsConfig

    labels = list(read_jsonl(SHIPPED / f"labels/{dataset}.jsonl", PseudoLabel))
    assert len(labels) == len({x.id for x in labels}) == n and {x.backbone for x in labels} == {served}
    summary = json.loads((SHIPPED / f"labels/{dataset}.summary.json").read_text())
    assert summary["labelled"] == sum(x.correct for x in labels) and summary["labels"] == n
    recorded = json.loads((SHIPPED / f"labels/{dataset}.settings.json").read_text())
    config = load_config(PseudoLabelsConfig, ROOT / f"configs/data/pseudo_labels-{dataset}-teacher.yaml")
    assert recorded.pop("served") == {"generator": served, "scorer": served}
    assert recorded == json.loads(json.dumps(job_settings(config)))


def test_the_shipped_planner_answers_are_the_teachers_complete_and_resume_under_the_current_config() -> None:
    """Every fixed range answered by the teacher for 121 questions (90 held out, the 30 the best range is chosen on,
    and the one NarrativeQA question an earlier mix chose instead of one of them), each answer's latest record
    completed with the tokens given, under the settings the current config records, so that eval planner reads them
    back instead of refusing or asking again; the base, SFT, GRPO, STITCH and gold-levels planners' comparison
    is their metrics, with their question-by-question pairs."""
    from overstory.core.records import read_jsonl
    from overstory.evaluation.planner import EvalPlannerConfig, answer_settings

    folder = SHIPPED / "planner/eval"
    recorded = json.loads((folder / "qa_answers.settings.json").read_text())
    assert recorded.pop("served")["generator"] == QWEN_CODER
    config = load_config(EvalPlannerConfig, ROOT / "configs/eval/planner-teacher.yaml")
    assert recorded == json.loads(json.dumps(answer_settings(config)))
    latest = {record["id"]: record["outcome"] for record in read_jsonl(folder / "qa_answers.jsonl")}
    questions = {answer_id.split("|")[0] for answer_id in latest}
    ranges = {answer_id.split("|")[1] for answer_id in latest}
    assert len(questions) == 121 and len(ranges) == 15 and len(latest) == 121 * 15
    assert all(o["qa_accuracy"] in (0.0, 1.0) and 0 < o["tokens_given"] <= o["tokens_read"] for o in latest.values())
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["served"]["generator"] == QWEN_CODER
    assert set(metrics["variants"]) == {"base", "sft", "grpo", "stitch", "gold"}
    compared = {(row["planner"], row["against"]) for row in metrics["paired"]["comparisons"]}
    assert {("sft", "base"), ("stitch", "sft"), ("gold", "sft")} <= compared and not metrics["paired"]["skipped"]


@pytest.mark.parametrize(("name", "datasets", "steps"), [("sft", [], 235), ("sft-gold", ["qasper", "squad"], 196)])
def test_the_shipped_sft_planners_finished_on_the_shipped_traces(name: str, datasets: list, steps: int) -> None:
    """The SFT planners (two hours of CPU each): a LoRA of every projection of SmolLM2's 30 layers, trained to the end
    of its epoch on the shipped traces, its job finished so a restored checkout skips it. ``sft`` (the warm start of
    GRPO and STITCH) reads every dataset's traces; ``sft-gold`` only those of the datasets with gold levels."""
    from safetensors import safe_open

    folder = SHIPPED / f"planner/{name}"
    record = json.loads((folder / "final" / "overstory.json").read_text())
    assert (record["recipe"], record["base_model"], record["adapter"]) == ("planner_sft", SMOLLM2, True)
    assert record["config"]["traces"] == "runs/teacher/planner/traces.jsonl"
    assert record["config"]["datasets"] == datasets
    adapter = json.loads((folder / "final" / "adapter_config.json").read_text())
    modules = adapter["target_modules"]
    assert adapter["r"] == 16 and len(modules) == 7
    with safe_open(folder / "final" / "adapter_model.safetensors", "pt") as weights:
        shapes = {name: weights.get_slice(name).get_shape() for name in weights.keys()}
    assert len(shapes) == 30 * len(modules) * 2 and all(16 in shape for shape in shapes.values())
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["steps"] == steps and metrics["eval_loss"] < metrics["history"][0]["loss"]
    assert set(metrics["n_traces_by_dataset"]) == set(datasets or ["qasper", "squad", "narrativeqa"])
    assert json.loads((SHIPPED / f"jobs/planner-{name}.json").read_text())["finished"] is True


def _rl_planner_from_the_sft_planner(name: str, recipe: str) -> dict:
    """Check what GRPO and STITCH share: ``planner/<name>`` is a LoRA on SmolLM2 trained by ``recipe`` from the
    shipped SFT adapter with R_QA on, no R_QA reward missing in the invocation that finished it, and its job
    finished (so a restored checkout skips it); return its metrics."""
    folder = SHIPPED / f"planner/{name}"
    record = json.loads((folder / "final" / "overstory.json").read_text())
    assert (record["recipe"], record["base_model"], record["adapter"]) == (recipe, SMOLLM2, True)
    assert record["init"] == "runs/teacher/planner/sft/final" and record["config"]["rewards"]["qa"] == 1.0
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["qa_rewards"]["missing"] == 0 and metrics["qa_rewards"]["given"] > 0
    assert json.loads((SHIPPED / f"jobs/planner-{name}.json").read_text())["finished"] is True
    return metrics


def test_the_shipped_grpo_planner_trained_on_every_r_qa_reward_from_the_sft_planner() -> None:
    """The GRPO planner (R_QA from the teacher on the runbook's stack): 30 steps from the shipped SFT adapter, no R_QA
    reward missing in the invocation that finished it, its job finished; and R_QA's kept answers, each judged, under
    the settings the current config's judge records, so STITCH reads them back instead of refusing or asking again."""
    from overstory.core.records import read_jsonl
    from overstory.training.planner_grpo import PlannerGrpoConfig
    from overstory.training.qa_judge import judge_settings

    metrics = _rl_planner_from_the_sft_planner("grpo", "planner_grpo")
    assert metrics["steps"] == 30
    assert all(row["qa_none_share"] == 0 for row in metrics["history"] if "qa_none_share" in row)

    kept = SHIPPED / "planner/rqa"
    recorded = json.loads((kept / "qa_answers.settings.json").read_text())
    assert recorded.pop("served")["generator"] == QWEN_CODER
    config = load_config(PlannerGrpoConfig, ROOT / "configs/train/planner_grpo-teacher.yaml")
    assert recorded == json.loads(json.dumps(judge_settings(config.rewards.k, config.correctness)))
    answers = list(read_jsonl(kept / "qa_answers.jsonl"))
    assert len(answers) >= 100 and all(isinstance(a["outcome"]["correct"], bool) for a in answers)


def test_the_shipped_stitch_planner_finished_every_step_from_the_sft_planner_with_every_r_qa_reward() -> None:
    """The STITCH planner (R_QA from the teacher, hints from the template traces): every configured step from the
    shipped SFT adapter, each step's R_QA mean logged, SFT injected at least once, no hint leaking the label and no R_QA
    reward missing in the invocation that finished it; its job finished so a restored checkout skips it."""
    from overstory.training.stitch import StitchConfig

    metrics = _rl_planner_from_the_sft_planner("stitch", "stitch")
    config = load_config(StitchConfig, ROOT / "configs/train/stitch-teacher.yaml")
    assert metrics["steps"] == config.stitch.steps == len(metrics["history"])
    assert [row["step"] for row in metrics["history"]] == list(range(1, config.stitch.steps + 1))
    assert all("qa_reward" in row["rewards"] for row in metrics["history"])
    assert metrics["sft_injections"] >= 1 and metrics["hint_leaks"] == 0


def test_the_shipped_planner_traces_are_the_pools_finished_and_served_by_the_teacher() -> None:
    """The finished traces of the planner mix: one record per trace id, from the pool's teachers only, the LLM
    teachers' served by the teacher, the template's by none; every teacher answered every question (the template
    teacher always yields, so its traces count the mix: each LLM teacher's kept and rejected replies add up to it),
    no failure is left, and the job's record is finished, so a restored checkout skips the job."""
    from collections import Counter

    from overstory.core.records import PlannerTrace, read_jsonl

    folder = SHIPPED / "planner"
    settings = json.loads((folder / "traces.settings.json").read_text())
    traces = list(read_jsonl(folder / "traces.jsonl", PlannerTrace))
    assert len(traces) == len({t.id for t in traces}) > 0
    assert {t.teacher for t in traces} == set(settings["teachers"])
    assert {t.served_model for t in traces if t.teacher != "template"} == {QWEN_CODER}
    assert {t.served_model for t in traces if t.teacher == "template"} == {""}
    kept = Counter(t.teacher for t in traces)
    rejected = Counter(json.loads(line)["id"].rsplit("/", 1)[1]
                       for line in (folder / "traces.rejected.jsonl").read_text().splitlines())
    assert all(kept[name] + rejected[name] == kept["template"] for name in settings["teachers"]), (kept, rejected)
    assert not (folder / "traces.failures.jsonl").exists()
    assert json.loads((SHIPPED / "jobs" / "planner-traces.json").read_text())["finished"] is True
