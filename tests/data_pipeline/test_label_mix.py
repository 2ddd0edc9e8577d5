"""`overstory data mix` on the gold labels of the shipped QASPER and SQuAD slices."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.data_pipeline.formats import PseudoLabel, read_jsonl, write_jsonl
from overstory.data_pipeline.hierarchy import load_hierarchies, save_hierarchies, stored_hierarchy_path

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
