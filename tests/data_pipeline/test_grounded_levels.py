"""The answer-grounded labelling rule on SQuAD's real answers (whose gold range is sentence..sentence), its order of
places, what it cannot ground, and the label mix and agreement report that use it."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.core.records import PseudoLabel, read_jsonl
from overstory.data_pipeline.corpora import load_corpus
from overstory.data_pipeline.gold_labels import label_corpus
from overstory.data_pipeline.grounded_levels import answer_units, ground_labels
from overstory.data_pipeline.pseudo_labels import report_labels
from tests.conftest import SQUAD, store_labels

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def squad_labels(squad_chunks) -> list[PseudoLabel]:
    """SQuAD's 473 answerable questions as correct pseudo-labels that read their whole article and replied with the
    first gold answer; the gold levels (sentence..sentence) beside them, the method's range left empty."""
    documents, questions = load_corpus("squad", SQUAD)
    gold, _ = label_corpus(documents, questions, squad_chunks)
    article = {c.doc_id: c.id for c in squad_chunks if c.level == "document"}
    return [PseudoLabel(g.id, g.doc_id, g.question, g.answers, None, None, True, 1, [article[g.doc_id]], ["document"],
                        g.answers[0], "m", "f1", gold_level_min=g.level_min, gold_level_max=g.level_max)
            for g in gold]


def test_an_article_narrows_to_the_sentence_holding_the_answer(squad_labels, squad_chunks) -> None:
    """From the whole article, the rule walks down to the answer: SQuAD's gold range, sentence..sentence, for nearly
    every question; an answer split over sentences keeps them all (a wider level_max), never a coarser level_min."""
    grounded, counts = ground_labels(squad_labels, squad_chunks)
    ranges = Counter((x.level_min, x.level_max) for x in grounded if x.level_min)
    assert counts["grounded"] + counts["ungrounded"] == len(squad_labels) == 473 and counts["unlabelled"] == 0
    assert counts["grounded"] >= 465  # a handful of answers normalise to tokens their article writes otherwise
    assert ranges[("sentence", "sentence")] >= 440
    assert sum(n for (low, _), n in ranges.items() if low == "sentence") >= 460
    assert all(x.source == "grounded" and x.correct for x in grounded)
    assert all(x.level_min is None for x in grounded if x.level_max is None)


def test_the_best_ranked_chunk_holding_the_reply_is_the_place(squad_labels, squad_chunks) -> None:
    """Retrieved chunks are read in rank order: one that does not hold the reply is passed over, and a repeat of the
    answer elsewhere does not widen the range; a reply no retrieved chunk holds is ungrounded, an unsolved question
    unlabelled."""
    by_id = {c.id: c for c in squad_chunks}
    label = squad_labels[0]
    answer_sentence = answer_units(label, by_id)[0]
    other = next(c for c in squad_chunks if c.doc_id == label.doc_id and c.level == "paragraph"
                 and not (c.start <= answer_sentence.start < c.end) and label.answer.lower() not in c.text.lower())
    ranked = replace(label, retrieved_ids=[other.id, answer_sentence.id, label.retrieved_ids[0]])
    assert answer_units(ranked, by_id) == [answer_sentence]
    yes = replace(label, answer="Yes", retrieved_ids=[other.id])
    unsolved = replace(label, correct=False)
    grounded, counts = ground_labels([ranked, yes, unsolved], squad_chunks)
    assert counts == {"grounded": 1, "ungrounded": 1, "unlabelled": 1}
    assert (grounded[0].level_min, grounded[0].level_max) == ("sentence", "sentence")
    assert (grounded[1].level_min, grounded[1].level_max) == (None, None) and grounded[1].correct


def test_the_mix_takes_grounded_ranges_and_counts_what_it_left_out(squad_labels, squad_chunks, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """``grounded`` names a pseudo-label source: its labels take the rule's ranges (not the method's), the ungrounded
    are counted and join the questions without a label (kept with ``unlabelled``); a gold source is refused by name."""
    method = [replace(x, level_min="sentence", level_max="section", answer=x.answer if i else "Yes")
              for i, x in enumerate(squad_labels[:12])]
    source = store_labels(tmp_path / "squad_pseudo.jsonl", method, squad_chunks)
    mapping = f"{{squad: {source}}}"
    out = tmp_path / "mix.jsonl"
    assert main(["data", "mix", "--config", str(ROOT / "configs/data/planner_mix.yaml"), "--out", str(out),
                 f"sources={mapping}", "grounded=[squad]", "tracking.backend=none"]) == 0
    mixed = list(read_jsonl(out, PseudoLabel))
    assert len(mixed) == 11 and all(x.source == "grounded" for x in mixed)
    assert Counter(x.level_max for x in mixed)["section"] < 11  # the method's top is gone
    assert "1 without one: no retrieved chunk holds the reply" in capsys.readouterr().out
    assert main(["data", "mix", "--config", str(ROOT / "configs/data/planner_mix.yaml"), "--out", str(out),
                 f"sources={mapping}", "grounded=[squad]", "unlabelled=[squad]", "tracking.backend=none"]) == 0
    kept = list(read_jsonl(out, PseudoLabel))
    assert len(kept) == 12 and [x.answer for x in kept if not x.correct] == ["Yes"]
    gold = store_labels(tmp_path / "squad_gold.jsonl", [replace(x, source="gold") for x in method], squad_chunks)
    with pytest.raises(ValueError, match="grounded: sources.squad .* holds gold labels"):
        main(["data", "mix", "--config", str(ROOT / "configs/data/planner_mix.yaml"), "--out", str(out),
              f"sources={{squad: {gold}}}", "grounded=[squad]", "tracking.backend=none"])


def test_the_labels_summary_measures_both_rules(squad_labels, squad_chunks, tmp_path: Path) -> None:
    """The pseudo-label job's summary and agreement report: the method's ranges and the answer-grounded rule's, each
    against gold."""
    method = [replace(x, level_min="sentence", level_max="paragraph", attempts=1 + i % 2)
              for i, x in enumerate(squad_labels[:20])]
    out = store_labels(tmp_path / "squad.jsonl", method, squad_chunks)
    summary = report_labels(str(out))
    assert json.loads(out.with_suffix(".summary.json").read_text()) == summary
    assert (summary["labels"], summary["labelled"], summary["labelled_at_attempt"]) == (20, 20, {"1": 10, "2": 10})
    assert summary["ranges"]["method"] == {"sentence..paragraph": 20} and summary["backbones"] == ["m"]
    saved = json.loads(out.with_suffix(".agreement.json").read_text())
    assert saved["level_max"]["value"] == summary["agreement"]["method"]["level_max"]["value"] == 0.0
    rule = saved["grounded_rule"]
    assert rule["counts"] == summary["grounding"] and rule["counts"]["grounded"] + rule["counts"]["ungrounded"] == 20
    assert summary["agreement"]["grounded"]["level_max"]["value"] > 0.5
    assert sum(summary["ranges"]["grounded"].values()) == rule["both"] == rule["counts"]["grounded"]
    assert out.with_name("squad.grounded-agreement.png").read_bytes()[:4] == b"\x89PNG"
