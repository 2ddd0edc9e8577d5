"""`overstory eval planner` on real SQuAD questions: the base SmolLM2 next to a LoRA SFT planner, with SmartChunk QA."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.core.config import ConfigError, load_config
from overstory.core.records import LEVEL_RANK, Chunk, PseudoLabel, read_jsonl, write_jsonl
from overstory.data_pipeline.hierarchy import stored_hierarchy_path
from overstory.data_pipeline.planner_examples import PlannerDataConfig
from overstory.data_pipeline.splits import split_by_document
from overstory.evaluation.planner import EvalPlannerConfig, held_out_fraction, split_rows, unlabelled_held_out
from overstory.evaluation.planner_metrics import fixed_ranges, majority_baseline, plan_outcomes, qa_outcome, summarize
from overstory.models.planner import plan_json
from overstory.models.registry import SMOLLM2
from overstory.retrieval.smartchunk import FALLBACK_RANGE, SmartChunkConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/eval/planner.yaml"


def test_plan_outcomes_count_exact_gold_within_one_and_format() -> None:
    rows = [{"level_min": "sentence", "level_max": "paragraph", "gold_level_min": "sentence",
             "gold_level_max": "sentence", "doc_id": "qasper/a"},
            {"level_min": "paragraph", "level_max": "section", "gold_level_min": "", "gold_level_max": "",
             "doc_id": "squad/b"}]
    replies = [plan_json("sentence", "paragraph"), "no plan at all"]
    outcomes, ranges = plan_outcomes(rows, replies, [20, 200], length_limit=128, fallback=("sentence", "section"))
    metrics = summarize(outcomes)
    assert metrics["accuracy"] == 0.5 and metrics["accuracy_gold"] == 0.0 and metrics["format_valid"] == 0.5
    assert metrics["format_valid_strict"] == 0.5
    assert metrics["within_one_level"] == 0.5 and metrics["over_length"] == 0.5
    assert ranges == [("sentence", "paragraph"), ("sentence", "section")]  # invalid plan: the fallback range given
    assert metrics["repairs"] == {"plan_unparsed": 1}  # answered from the fallback: a repair, counted


def test_strict_format_rate_counts_only_the_exact_json() -> None:
    """The tolerant parser finds a plan in all four replies (what the runtime acts on); only the first is in the
    format the prompt asks for."""
    rows = [{"level_min": "sentence", "level_max": "paragraph", "gold_level_min": "", "gold_level_max": "",
             "doc_id": "squad/a"}] * 4
    replies = ['It asks for a date. {"largest_chunk_size": "paragraph", "smallest_chunk_size": "sentence"}',
               "{'largest_chunk_size': 'paragraph', 'smallest_chunk_size': 'sentence'}",
               '{"largest_chunk_size": "sentence", "smallest_chunk_size": "paragraph"}',
               '{"largest_chunk_size": "paragraphs", "smallest_chunk_size": "sentence"']
    metrics = summarize(plan_outcomes(rows, replies, [20] * 4, length_limit=128, fallback=FALLBACK_RANGE)[0])
    assert metrics["format_valid"] == 1.0 and metrics["format_valid_strict"] == 0.25


def test_compare_needs_known_variants_and_ranges() -> None:
    with pytest.raises(ConfigError, match="not in variants"):
        load_config(EvalPlannerConfig, CONFIG, ["compare=base,nope"])
    with pytest.raises(ConfigError, match="fixed_ranges: section..paragraph is not a range"):
        load_config(EvalPlannerConfig, CONFIG, ["fixed_ranges=[section..paragraph]"])
    with pytest.raises(ConfigError, match="fallback_range: level_min 'section' is larger"):
        load_config(EvalPlannerConfig, CONFIG, ["fallback_range=[section, paragraph]"])
    with pytest.raises(ConfigError, match="val_fraction: not used with train_data"):
        load_config(EvalPlannerConfig, CONFIG, ["train_data=labels.jsonl"])  # the config gives val_fraction: 0.2
    with pytest.raises(ConfigError, match="paired: stich in 'stich:sft' not in variants"):
        load_config(EvalPlannerConfig, CONFIG, ["paired=[stich:sft]"])
    with pytest.raises(ConfigError, match="paired: 'stitch' is not planner:other"):
        load_config(EvalPlannerConfig, CONFIG, ["paired=[stitch]"])


def test_the_fallback_range_is_the_runtimes_setting() -> None:
    """One setting: eval planner answers an unparsed plan from the range the SmartChunk runtime searches then."""
    assert load_config(EvalPlannerConfig, CONFIG).fallback_range == SmartChunkConfig().fallback_range
    assert load_config(EvalPlannerConfig, CONFIG, ["fallback_range=[sentence, section]"]).fallback_range == (
        "sentence", "section")


def _checkpoint(folder: Path, config: dict) -> str:
    """A checkpoint folder holding only the manifest a training recipe writes beside its weights."""
    folder.mkdir(parents=True)
    (folder / "overstory.json").write_text(json.dumps({"kind": "planner", "config": config}))
    return str(folder)


def test_val_fraction_is_checked_against_the_training_runs_manifests(tmp_path: Path) -> None:
    """SFT records train.val_fraction, GRPO and STITCH data.val_fraction; a model name has no manifest."""
    sft = _checkpoint(tmp_path / "sft", {"train": {"val_fraction": 0.25}})
    stitch = _checkpoint(tmp_path / "stitch", {"data": {"val_fraction": 0.25}, "train": {}})
    variants = {"base": SMOLLM2, "sft": sft, "stitch": stitch}
    config = load_config(EvalPlannerConfig, CONFIG, ["checkpoint=x"])  # the config gives val_fraction: 0.2
    with pytest.raises(ConfigError, match=r"val_fraction: 0.2 here, but sft's training run held out 0.25 .*sft"):
        held_out_fraction(config, variants)
    assert held_out_fraction(replace(config, val_fraction=0.25), variants) == 0.25
    assert held_out_fraction(replace(config, val_fraction=None), variants) == 0.25  # read from the manifests
    other = _checkpoint(tmp_path / "grpo", {"data": {"val_fraction": 0.1}})
    with pytest.raises(ConfigError, match="held out different shares.*sft 0.25.*grpo 0.1"):
        held_out_fraction(replace(config, val_fraction=None), {**variants, "grpo": other})
    with pytest.raises(ConfigError, match="no variant has a training manifest"):
        held_out_fraction(replace(config, val_fraction=None), {"base": SMOLLM2})
    everything = _checkpoint(tmp_path / "all", {"train": {"val_fraction": 0}})
    with pytest.raises(ConfigError, match="held out no documents"):
        held_out_fraction(replace(config, val_fraction=None), {"sft": everything})
    assert held_out_fraction(replace(config, val_fraction=None, train_data="t.jsonl"), variants) is None


def _row(doc_id: str, low: str, high: str, gold: tuple[str, str] = ("", "")) -> dict:
    return {"doc_id": doc_id, "example_id": f"{doc_id}:{low}:{high}", "level_min": low, "level_max": high,
            "gold_level_min": gold[0], "gold_level_max": gold[1]}


def test_majority_baseline_per_dataset_uses_each_datasets_own_majority() -> None:
    train = [_row("qasper/a", "sentence", "paragraph")] * 3 + [_row("narrativeqa/b", "paragraph", "section")] * 2
    held_out = [_row("qasper/c", "sentence", "paragraph", ("sentence", "section")),
                _row("narrativeqa/d", "paragraph", "section"), _row("narrativeqa/d", "paragraph", "section")]
    report = majority_baseline(train, held_out)
    assert report["label"] == ["sentence", "paragraph"] and report["accuracy"] == pytest.approx(1 / 3)
    assert report["accuracy_gold"] == 0.0  # only the QASPER question has gold levels
    narrative = report["by_dataset"]["narrativeqa"]
    assert narrative["accuracy"] == 0.0 and narrative["dataset_label"]["accuracy"] == 1.0
    assert narrative["dataset_label"]["label"] == ["paragraph", "section"]


def test_fixed_ranges_pick_the_best_on_training_questions_and_report_it_held_out() -> None:
    """A stand-in for the runtime (arithmetic, no model): a range answers correctly when it reaches the row's
    label's level_max, and reads 10 tokens per level of its top (given whole: shorter than the prompt's cut); the
    best range is the cheapest correct one."""
    def answer(row: dict, low: str, high: str) -> dict:
        correct = LEVEL_RANK[high] >= LEVEL_RANK[row["level_max"]]
        read = [Chunk("c", row["doc_id"], high, "x" * 40, None, [], 0, 40, 10 * (LEVEL_RANK[high] + 1))]
        return qa_outcome(correct, None, read)

    train = [_row("squad/a", "sentence", "paragraph")] * 4
    held_out = [_row("squad/b", "sentence", "paragraph"), _row("squad/b", "sentence", "section")]
    report = fixed_ranges(train, held_out, [("sentence", "sentence"), ("sentence", "paragraph"),
                                            ("sentence", "section")], answer)
    assert report["best"]["range"] == "sentence..paragraph"  # as correct on training as ..section, reads less
    best = report["best"]
    assert best["qa_accuracy"] == 0.5 and best["tokens_read"] == best["tokens_given"] == 20.0
    assert report["ranges"]["sentence..section"]["qa_accuracy"] == 1.0
    assert report["ranges"]["sentence..sentence"]["by_dataset"]["squad"]["chunk_tokens"] == 10.0


def _labels_of(labels: Path, doc_ids: set[str], path: Path) -> Path:
    """The labels of ``doc_ids``, stored with the hierarchy as the pseudo-labels job would."""
    path.parent.mkdir(exist_ok=True)
    write_jsonl(path, [r for r in read_jsonl(labels, PseudoLabel) if r.doc_id in doc_ids])
    shutil.copy(stored_hierarchy_path(labels), stored_hierarchy_path(path))
    return path


def test_train_data_holds_out_every_question_of_data(planner_labels: Path, tmp_path: Path) -> None:
    """With ``train_data``, the training rows (majority range, fixed-range selection) are all of its labels and the
    held-out rows all of ``data``'s; a document in both is refused, naming the key."""
    docs = sorted({r.doc_id for r in read_jsonl(planner_labels, PseudoLabel)})
    train = _labels_of(planner_labels, set(docs[:2]), tmp_path / "train" / "labels.jsonl")
    held = _labels_of(planner_labels, {docs[2]}, tmp_path / "dev" / "labels.jsonl")
    config = load_config(EvalPlannerConfig, CONFIG, [f"data={held}", f"train_data={train}", "checkpoint=x",
                                                     "val_fraction=null"])
    data = PlannerDataConfig(labels=str(held), metadata_tokens=64)
    train_rows, held_out, chunks, split = split_rows(config, data, SMOLLM2)
    assert {r["doc_id"] for r in train_rows} == set(docs[:2]) and {r["doc_id"] for r in held_out} == {docs[2]}
    assert len(train_rows) + len(held_out) == len(list(read_jsonl(planner_labels, PseudoLabel)))
    assert {c.doc_id for c in chunks} == set(docs) and str(train) in split
    # without train_data: data's own split by document, as before
    default = replace(config, train_data="", data=str(planner_labels))
    own_train, own_held, _, own_split = split_rows(default, replace(data, labels=str(planner_labels)), SMOLLM2)
    assert own_split == "validation documents" and own_train and own_held
    assert not {r["doc_id"] for r in own_train} & {r["doc_id"] for r in own_held}
    overlapping = _labels_of(planner_labels, set(docs[1:]), tmp_path / "overlap" / "labels.jsonl")
    with pytest.raises(ConfigError, match="train_data: 1 documents"):
        split_rows(replace(config, train_data=str(overlapping)), data, SMOLLM2)


def test_unlabelled_questions_of_held_out_documents_come_with_their_answers_and_chunks(planner_labels: Path,
                                                                                      tmp_path: Path) -> None:
    """With ``train_data`` every document of ``data`` is held out, a document none of whose questions has a label
    included: its questions are planned and answered (reference answers kept), so its chunks must be there."""
    docs = sorted({r.doc_id for r in read_jsonl(planner_labels, PseudoLabel)})
    train = _labels_of(planner_labels, {docs[0]}, tmp_path / "train" / "labels.jsonl")
    held = tmp_path / "dev" / "labels.jsonl"
    held.parent.mkdir()
    write_jsonl(held, [replace(r, correct=False, level_min=None, level_max=None) if r.doc_id == docs[2] else r
                       for r in read_jsonl(planner_labels, PseudoLabel) if r.doc_id != docs[0]])
    shutil.copy(stored_hierarchy_path(planner_labels), stored_hierarchy_path(held))
    config = load_config(EvalPlannerConfig, CONFIG, [f"data={held}", f"train_data={train}", "checkpoint=x",
                                                     "val_fraction=null", "unlabelled=true", "limit=3"])
    data = PlannerDataConfig(labels=str(held), metadata_tokens=64)
    _, held_out, chunks, _ = split_rows(config, data, SMOLLM2)
    assert {r["doc_id"] for r in held_out} == {docs[1]} and docs[2] not in {c.doc_id for c in chunks}
    extra, chunks = unlabelled_held_out(config, data, SMOLLM2, held_out, chunks)
    assert len(extra) == 3 and {r["doc_id"] for r in extra} == {docs[2]}  # at most `limit` of them
    assert all(r["answers"] and r["prompt"] for r in extra) and "level_min" not in extra[0]
    assert docs[2] in {c.doc_id for c in chunks} and docs[1] in {c.doc_id for c in chunks}
    outcomes, _ = plan_outcomes(extra, [plan_json("sentence", "paragraph")] * 3, [20] * 3, length_limit=128,
                                fallback=FALLBACK_RANGE)
    metrics = summarize(outcomes)  # no label: no label-based rate, the rest counted
    assert metrics["accuracy"] is None and metrics["within_one_level"] is None and metrics["format_valid"] == 1.0
    assert unlabelled_held_out(replace(config, unlabelled=False), data, SMOLLM2, held_out, chunks)[0] == []


def _with_unanswered(labels: Path, folder: Path, n: int) -> tuple[Path, set[str]]:
    """The labels with the last ``n`` of the held-out document's questions turned into ones the backbone never
    answered (no correct label), stored with their hierarchy as the pseudo-labels job would; and those ids."""
    records = list(read_jsonl(labels, PseudoLabel))
    _, val = split_by_document([r for r in records if r.correct], 0.2)
    unanswered = {r.id for r in val[-n:]}
    records = [replace(r, correct=False, level_min=None, level_max=None) if r.id in unanswered else r
               for r in records]
    folder.mkdir()
    write_jsonl(folder / "labels.jsonl", records)
    shutil.copy(stored_hierarchy_path(labels), stored_hierarchy_path(folder / "labels.jsonl"))
    return folder / "labels.jsonl", unanswered


def _as_if_trained_with(checkpoint: Path, val_fraction: float, folder: Path) -> Path:
    """A copy of ``checkpoint`` whose manifest records ``val_fraction`` (a stand-in: the shared SFT fixture trains on
    every document, val_fraction 0, and a second SFT run only to hold some out would double the test's cost)."""
    shutil.copytree(checkpoint, folder)
    manifest = json.loads((folder / "overstory.json").read_text())
    manifest["config"]["train"]["val_fraction"] = val_fraction
    (folder / "overstory.json").write_text(json.dumps(manifest))
    return folder


@pytest.mark.slow
def test_eval_planner_compares_base_and_sft(planner_labels: Path, sft_planner: Path, tmp_path: Path,
                                            capsys) -> None:
    labels, unanswered = _with_unanswered(planner_labels, tmp_path / "labels", 1)
    out = tmp_path / "eval"

    # k=2: each QA answer reads the top 2 chunks of its range, not 5 (up to 1,500 characters each: with 5 sections
    # a prompt of about 2,000 tokens, for each of the ~16 answers); 2 labelled held-out questions and 1 unlabelled,
    # the fewest that keep a label-based rate, a question without a label and a fixed-range selection set (2 training
    # questions) apart: every figure is still computed and checked
    def evaluate(sft: Path) -> int:
        return main(["eval", "planner", "--config", str(CONFIG), "--data", str(labels), "--out", str(out),
                     "metadata_tokens=96",
                     f"variants={{base: builtin:smollm2-135m-instruct, sft: {sft}, stitch: runs/not-trained}}",
                     "--compare", "base,sft", "paired=[sft:base, stitch:sft]", "limit=2", "max_new_tokens=72",
                     "unlabelled=true", "k=2",
                     "fixed_ranges=[sentence..sentence, paragraph..section]", "fixed_range_selection=2",
                     "tracking.backend=none"])

    # the fixture's run trained on every document: its held-out questions would be training questions
    assert evaluate(sft_planner / "final") == 2
    assert "val_fraction: 0.2 here, but sft's training run held out 0.0" in capsys.readouterr().err
    assert evaluate(_as_if_trained_with(sft_planner / "final", 0.2, tmp_path / "sft")) == 0
    report = json.loads((out / "metrics.json").read_text())
    assert report["val_fraction"] == 0.2 and report["fallback_range"] == list(FALLBACK_RANGE)
    assert set(report["variants"]) == {"base", "sft"} and report["n_questions"] == 2 and report["n_unlabelled"] == 1
    assert not unanswered & {row["id"] for m in report["variants"].values() for row in m["examples"]}
    for metrics in report["variants"].values():
        assert metrics["accuracy_gold"] is None  # the fixture's labels carry no gold levels
        for key in ("accuracy", "within_one_level", "format_valid", "format_valid_strict", "median_completion_tokens",
                    "p90_completion_tokens", "seconds_per_plan", "qa_accuracy", "recall@2"):
            assert metrics[key] is not None, key
        assert 0 <= metrics["accuracy"] <= metrics["within_one_level"] <= 1
        assert metrics["format_valid_strict"] <= metrics["format_valid"]  # both over all 3 planned questions
        low, high = metrics["ci95"]["accuracy"]
        assert low <= metrics["accuracy"] <= high and metrics["tokens_read"] > 0 and metrics["chunk_tokens"] > 0
        assert 0 < metrics["tokens_given"] <= metrics["tokens_read"]  # chunks longer than the prompt's cut count less
        # the question without a label is planned and answered too: in every rate but the label-based ones
        assert list(metrics["by_dataset"]) == ["squad"] and metrics["by_dataset"]["squad"]["n"] == 3
        assert metrics["accuracy"] in {0.0, 0.5, 1.0} and metrics["format_valid"] * 3 == round(
            metrics["format_valid"] * 3)
    assert report["variants"]["base"]["format_valid"] == 0.0  # measured: the base model never writes the plan
    assert report["variants"]["base"]["repairs"] == {"plan_unparsed": 3}  # each answered from the fallback range
    assert report["variants"]["sft"]["format_valid"] > 0  # the SFT adapter does, on labelled and unlabelled ones
    majority = report["majority_baseline"]  # the reference row: the training labels' most common range
    assert len(majority["label"]) == 2 and 0 <= majority["accuracy"] <= majority["within_one_level"] <= 1
    assert set(majority["by_dataset"]) == {"squad"}
    fixed = report["fixed_ranges"]  # the end-to-end references, on the same questions
    assert set(fixed["ranges"]) == {"sentence..sentence", "paragraph..section"}
    assert fixed["best"]["range"] in fixed["ranges"] and fixed["best"]["selection_questions"] == 2
    sentences = fixed["ranges"]["sentence..sentence"]
    assert sentences["n"] == 3 and sentences["chunk_tokens"] < fixed["ranges"]["paragraph..section"]["chunk_tokens"]
    # question by question: the pair asked for (stitch is not compared in this run: skipped, not refused), then each
    # planner against the best fixed range, on the same 3 planned questions as the means above
    paired = report["paired"]
    assert paired["skipped"] == ["stitch:sft"]
    assert [(c["planner"], c["against"]) for c in paired["comparisons"]] == [
        ("sft", "base"), ("base", "best fixed range"), ("sft", "best fixed range")]
    planners = {**{name: report["variants"][name] for name in ("base", "sft")}, "best fixed range": fixed["best"]}
    for comparison in paired["comparisons"]:
        cell, mine, theirs = comparison["overall"], planners[comparison["planner"]], planners[comparison["against"]]
        assert cell["n"] == 3 and list(comparison["by_dataset"]) == ["squad"]
        for metric in ("qa_accuracy", "tokens_given"):
            assert cell[metric]["delta"] == pytest.approx(mine[metric] - theirs[metric])
            low, high = cell[metric]["delta_ci95"]
            assert low <= cell[metric]["delta"] <= high
        assert cell["qa_accuracy"]["higher"] + cell["qa_accuracy"]["lower"] <= 3 - cell["same_range"]
    base_ranges = {record["range"] for record in report["variants"]["base"]["questions"]}
    assert base_ranges == {"..".join(FALLBACK_RANGE)}  # every unparsed plan answered from the fallback range
    assert "sft against base, question by question (3, " in capsys.readouterr().out
    assert (out / "chunk_size_by_dataset.png").stat().st_size > 5_000
    assert (out / "qa_vs_tokens.png").stat().st_size > 5_000
    assert (out / "planner_comparison.png").stat().st_size > 5_000
    assert (out / "paired.png").stat().st_size > 5_000
    assert (out / "training_curves.png").stat().st_size > 5_000
