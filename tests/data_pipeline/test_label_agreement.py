"""Agreement of pseudo-labels with gold levels: the rates, their intervals, the confusion counts and the PNG."""

from __future__ import annotations

from pathlib import Path

from overstory.core.records import PseudoLabel
from overstory.data_pipeline.label_agreement import label_agreement, plot_agreement


def _label(pseudo: tuple[str | None, str | None], gold: tuple[str | None, str | None]) -> PseudoLabel:
    return PseudoLabel("q", "d", "?", ["a"], *pseudo, pseudo[0] is not None, 1, [], [], "", "m", "f1", *gold)


def test_agreement_counts_only_questions_with_both_labels(tmp_path: Path) -> None:
    labels = ([_label(("sentence", "paragraph"), ("sentence", "paragraph"))] * 6
              + [_label(("paragraph", "subsection"), ("sentence", "paragraph"))] * 2
              + [_label((None, None), ("sentence", "document"))] * 2  # the backbone never answered
              + [_label(("sentence", "sentence"), (None, None))] * 3)  # no gold (NarrativeQA, unanswerable)
    report = label_agreement(labels)
    assert (report["labels"], report["gold"], report["both"]) == (13, 10, 8)
    assert report["coverage"]["value"] == 0.8
    assert report["exact_range"]["value"] == 0.75 and report["level_min"]["value"] == 0.75
    assert report["within_one"]["value"] == 1.0
    assert report["max_offset_levels"]["value"] == 0.25  # two of eight one level coarser than the evidence
    low, high = report["exact_range"]["ci95"]
    assert 0 <= low < 0.75 < high <= 1
    assert report["confusion"]["level_max"]["paragraph"] == {"sentence": 0, "paragraph": 6, "subsection": 2,
                                                             "section": 0, "document": 0}
    png = plot_agreement(report, "test", tmp_path / "agreement.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_no_gold_gives_empty_rates() -> None:
    report = label_agreement([_label(("sentence", "sentence"), (None, None))])
    assert report["gold"] == 0 and report["exact_range"] == {"value": None, "ci95": None}
