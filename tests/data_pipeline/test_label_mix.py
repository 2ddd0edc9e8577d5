"""`overstory data mix` on the gold labels of the shipped QASPER and SQuAD slices."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.core.records import PseudoLabel, read_jsonl, write_jsonl
from overstory.data_pipeline.hierarchy import load_hierarchies, save_hierarchies, stored_hierarchy_path
from overstory.data_pipeline.splits import document_bucket

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gold(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gold")
    assert main(["data", "gold-labels", "--config", str(ROOT / "configs/data/gold_labels.yaml"), "--out", str(out),
                 f"corpora.qasper_train.path={ROOT / 'data/qasper/train.json'}",
                 f"corpora.qasper_dev.path={ROOT / 'data/qasper/dev.json'}",
                 f"corpora.squad.path={ROOT / 'data/squad/dev-v2.0-articles.json'}", "tracking.backend=none"]) == 0
    return out


def _mix(sources: dict[str, Path], out: Path, *extra: str) -> int:
    mapping = "{" + ", ".join(f"{name}: {path}" for name, path in sources.items()) + "}"
    return main(["data", "mix", "--config", str(ROOT / "configs/data/planner_mix.yaml"), "--out", str(out),
                 f"sources={mapping}", *extra, "tracking.backend=none"])


def test_mix_takes_each_source_round_robin_with_its_documents(gold: Path, tmp_path: Path) -> None:
    out = tmp_path / "mix.jsonl"
    sources = {"qasper": gold / "qasper_dev.jsonl", "squad": gold / "squad.jsonl"}
    assert _mix(sources, out, "per_source_limit=4") == 0
    labels = list(read_jsonl(out, PseudoLabel))
    assert [x.doc_id.split("/")[0] for x in labels] == ["qasper"] * 4 + ["squad"] * 4
    assert len({x.doc_id for x in labels[:4]}) == 4  # round-robin over papers, not the first paper's questions
    chunks = load_hierarchies(stored_hierarchy_path(out))
    assert {c.doc_id for c in chunks} == {x.doc_id for x in labels}
    assert {i for x in labels for i in x.retrieved_ids} <= {c.id for c in chunks}

    again = tmp_path / "again.jsonl"  # a source named twice: its questions are taken once
    assert _mix({**sources, "qasper_again": gold / "qasper_dev.jsonl"}, again, "per_source_limit=4") == 0
    assert [x.id for x in read_jsonl(again, PseudoLabel)] == [x.id for x in labels]


def test_a_document_chunked_differently_by_two_sources_is_refused(gold: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.jsonl"  # other questions on the same articles, chunked without sentences
    write_jsonl(other, [replace(x, id=f"{x.id}-other") for x in read_jsonl(gold / "squad.jsonl", PseudoLabel)])
    chunks = load_hierarchies(stored_hierarchy_path(gold / "squad.jsonl"))
    save_hierarchies(stored_hierarchy_path(other), [c for c in chunks if c.level != "sentence"])
    with pytest.raises(ValueError, match="chunked differently"):
        _mix({"squad": gold / "squad.jsonl", "squad_other": other}, tmp_path / "mix.jsonl")


def _with_unanswered(gold: Path, folder: Path) -> Path:
    """QASPER dev gold labels with every third question made unanswered (no label), as a pseudo-labels file has."""
    folder.mkdir()
    records = [replace(x, correct=False, level_min=None, level_max=None) if i % 3 == 0 else x
               for i, x in enumerate(read_jsonl(gold / "qasper_dev.jsonl", PseudoLabel))]
    write_jsonl(folder / "labels.jsonl", records)
    shutil.copy(stored_hierarchy_path(gold / "qasper_dev.jsonl"), stored_hierarchy_path(folder / "labels.jsonl"))
    return folder / "labels.jsonl"


def test_hold_out_splits_a_source_by_document_and_keeps_its_unlabelled_questions_on_request(gold: Path,
                                                                                              tmp_path: Path) -> None:
    sources = {"qasper": _with_unanswered(gold, tmp_path / "qasper"), "squad": gold / "squad.jsonl"}
    train, held_out = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
    assert _mix(sources, train, "hold_out={qasper: 0.34}") == 0  # the training side (the default)
    assert _mix(sources, held_out, "hold_out={qasper: 0.34}", "side=held_out", "unlabelled=[qasper]") == 0
    train_labels, held_labels = list(read_jsonl(train, PseudoLabel)), list(read_jsonl(held_out, PseudoLabel))

    def papers(labels: list[PseudoLabel]) -> set[str]:
        return {x.doc_id for x in labels if x.doc_id.startswith("qasper/")}

    # a paper is held out when the hash of its id falls below the share: here 3 of the 6, none on both sides
    assert papers(held_labels) == {d for d in papers(train_labels + held_labels) if document_bucket(d) < 0.34}
    assert len(papers(held_labels)) == 3 and len(papers(train_labels)) == 3
    assert not papers(train_labels) & papers(held_labels)
    assert all(x.correct for x in train_labels)  # unlabelled questions only where named
    held_qasper = [x for x in held_labels if x.doc_id.startswith("qasper/")]
    first = next(i for i, x in enumerate(held_qasper) if not x.correct)  # after every labelled one of the source
    assert first > 0 and all(x.correct for x in held_qasper[:first]) and not any(x.correct for x in held_qasper[first:])
    squad = [[x.id for x in labels if x.doc_id.startswith("squad/")] for labels in (train_labels, held_labels)]
    assert squad[0] == squad[1] and squad[0]  # a source not held out from is taken whole on either side
    assert {c.doc_id for c in load_hierarchies(stored_hierarchy_path(held_out))} == {x.doc_id for x in held_labels}


def test_hold_out_and_unlabelled_name_sources(gold: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for override, message in [("hold_out={hotpotqa: 0.2}", "hold_out: hotpotqa not in sources (squad)"),
                              ("unlabelled=[narrativeqa]", "unlabelled: narrativeqa not in sources (squad)"),
                              ("hold_out={squad: 1.5}", "hold_out.squad must be a share of documents in (0, 1)")]:
        assert _mix({"squad": gold / "squad.jsonl"}, tmp_path / "mix.jsonl", override) != 0
        assert message in capsys.readouterr().err
    assert not (tmp_path / "mix.jsonl").exists()
