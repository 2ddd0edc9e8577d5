"""`overstory data pseudo-labels` on real SQuAD questions with SmolLM2 as the backbone and MiniLM retrieval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.core.config import ConfigError, load_config
from overstory.core.records import LEVELS, PseudoLabel, read_jsonl
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.gold_labels import label_corpus
from overstory.data_pipeline.hierarchy import load_hierarchies, stored_hierarchy_path
from overstory.data_pipeline.pseudo_labels import PseudoLabelsConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/data/pseudo_labels.yaml"
pytestmark = pytest.mark.slow


def test_pseudo_labels_on_a_real_slice_and_resume(tmp_path: Path) -> None:
    """The first 3 questions, round-robin over the three articles, are the smallest slice with both outcomes
    (measured: the first answered at attempt 1, the third at attempt 2 from 10 chunks, the second never)."""
    out = tmp_path / "labels.jsonl"
    args = ["data", "pseudo-labels", "--config", str(CONFIG), "--out", str(out),
            f"corpus.path={ROOT / 'data/squad/dev-v2.0-articles.json'}", "limit=3", "max_attempts=2",
            "tracking.backend=none"]
    assert main(args) == 0
    labels = list(read_jsonl(out, PseudoLabel))
    assert len(labels) == 3 and len({label.id for label in labels}) == 3
    backbone = load_config(PseudoLabelsConfig, CONFIG).serve.roles["generator"].model
    for label in labels:
        assert label.attempts in (1, 2) and label.backbone == backbone
        # what the backbone read: distinct chunks of the question's own document, one level per chunk
        assert len(set(label.retrieved_ids)) == len(label.retrieved_ids) == len(label.retrieved_levels) > 0
        assert all(chunk_id.startswith(f"{label.doc_id}#") for chunk_id in label.retrieved_ids)
        assert set(label.retrieved_levels) <= set(LEVELS)
        assert label.gold_level_min in LEVELS and label.gold_level_max in LEVELS
        if label.correct:  # the label spans exactly the levels that were read
            assert LEVELS.index(label.level_min) <= LEVELS.index(label.level_max)
            assert {label.level_min, label.level_max} <= set(label.retrieved_levels)
            assert min(label.retrieved_levels, key=LEVELS.index) == label.level_min
        else:
            assert label.level_min is None and label.attempts == 2
            # the second attempt reads from paragraphs upwards and more chunks
            assert "sentence" not in label.retrieved_levels and len(label.retrieved_ids) == 10
    assert any(label.correct for label in labels)  # measured: 2 of 3 with the contains rule
    # the hierarchy it labelled on is stored beside the labels, holding every chunk the labels name
    stored = {c.id for c in load_hierarchies(stored_hierarchy_path(out))}
    assert {i for label in labels for i in label.retrieved_ids} <= stored
    assert all(label.evidence and label.evidence[0].doc_id == label.doc_id for label in labels)

    before = out.read_text()
    assert main(args) == 0  # every id is done: nothing is regenerated
    assert out.read_text() == before


def test_qasper_labels_carry_gold_levels_and_narrativeqa_labels_their_document(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture) -> None:
    """QASPER questions get the gold levels of gold_labels.py beside the pseudo-label, and the run ends with the
    agreement report; questions whose evidence is only a figure or table are excluded and counted; NarrativeQA
    questions (no evidence spans) are labelled on the summary they were asked about."""
    qasper = tmp_path / "qasper.jsonl"
    assert main(["data", "pseudo-labels", "--config", str(ROOT / "configs/data/pseudo_labels-qasper.yaml"),
                 "--out", str(qasper), f"corpus.path={ROOT / 'data/qasper'}", "limit=2", "max_attempts=1",
                 "tracking.backend=none"]) == 0
    labels = list(read_jsonl(qasper, PseudoLabel))
    documents, questions = load_corpus(CorpusConfig(kind="qasper", path=str(ROOT / "data/qasper")))
    figure_only = {q.id for q in questions if q.metadata["figure_table_only"]}
    assert len(figure_only) == 2 and not figure_only & {x.id for x in labels}  # the shipped papers hold two
    assert "2 questions excluded, their evidence only a figure or table" in capsys.readouterr().out
    gold, _ = label_corpus(documents, [q for q in questions if q.id in {x.id for x in labels}],
                           load_hierarchies(stored_hierarchy_path(qasper)))
    assert len(labels) == 2 and gold  # the first questions round-robin over papers include gold-labelled ones (both)
    by_id = {x.id: x for x in labels}
    assert [(by_id[g.id].gold_level_min, by_id[g.id].gold_level_max) for g in gold] == \
        [(g.level_min, g.level_max) for g in gold]
    agreement = json.loads(qasper.with_suffix(".agreement.json").read_text())
    assert agreement["gold"] == len(gold) and 0 <= agreement["coverage"]["value"] <= 1
    assert qasper.with_suffix(".agreement.png").read_bytes()[:4] == b"\x89PNG"

    narrative = tmp_path / "narrativeqa.jsonl"
    assert main(["data", "pseudo-labels", "--config", str(ROOT / "configs/data/pseudo_labels-narrativeqa.yaml"),
                 "--out", str(narrative), f"corpus.path={ROOT / 'data/narrativeqa'}", "limit=2", "max_attempts=1",
                 "tracking.backend=none"]) == 0
    labels = list(read_jsonl(narrative, PseudoLabel))
    assert len(labels) == 2 and len({x.doc_id for x in labels}) == 2  # round-robin: two summaries
    assert all(x.doc_id.startswith("narrativeqa/") and x.gold_level_min is None for x in labels)
    assert all(i.startswith(f"{x.doc_id}#") for x in labels for i in x.retrieved_ids)
    assert not narrative.with_suffix(".agreement.json").exists()


def test_bad_settings_name_the_key() -> None:
    with pytest.raises(ConfigError, match="f1_threshold"):
        load_config(PseudoLabelsConfig, CONFIG, ["correctness.f1_threshold=0"])
    with pytest.raises(ConfigError, match="compressor role"):
        load_config(PseudoLabelsConfig, CONFIG, ["upper=compressor"])
    with pytest.raises(ConfigError, match="request_timeout_s must be positive"):
        load_config(PseudoLabelsConfig, CONFIG, ["request_timeout_s=0"])


def test_the_request_timeout_reaches_the_jobs_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """request_timeout_s is the job's client's timeout (the teacher's configs give it 1800 s: a CPU stack answering
    eight long prompts at once outlasts the client's 120 s default); the client is stopped there, nothing served."""
    from overstory.data_pipeline import pseudo_labels

    seen = {}

    def client_for(serve, url, **options):
        seen.update(options)
        raise RuntimeError("stopped at the client")

    monkeypatch.setattr(pseudo_labels, "client_for", client_for)
    config = load_config(PseudoLabelsConfig, CONFIG, [f"corpus.path={ROOT / 'data/squad/dev-v2.0-articles.json'}",
                                                      "limit=1", f"out={tmp_path / 'labels.jsonl'}",
                                                      "request_timeout_s=1800", "tracking.backend=none"])
    with pytest.raises(RuntimeError, match="stopped at the client"):
        pseudo_labels.run(config)
    assert seen["timeout_s"] == 1800


def test_replies_cut_by_max_tokens_are_asked_again_with_more_room_and_counted(tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture) -> None:
    """With room for one token the real backbone's every first reply is cut (finish_reason "length"): each is asked
    once more with twice the room; what is still cut is counted with its raw text, and the job's line says both."""
    out = tmp_path / "labels.jsonl"
    args = ["data", "pseudo-labels", "--config", str(CONFIG), "--out", str(out),
            f"corpus.path={ROOT / 'data/squad/dev-v2.0-articles.json'}", "limit=2", "max_attempts=1",
            "max_answer_tokens=1", "tracking.backend=none"]
    assert main(args) == 0
    labels = list(read_jsonl(out, PseudoLabel))
    assert len(labels) == 2
    for label in labels:
        assert label.truncated_replies == label.attempts  # one cut first reply per attempt
        assert 0 <= label.truncated_after_retry <= label.truncated_replies
        assert bool(label.truncated_raw) == (label.truncated_after_retry > 0)
    total = sum(label.truncated_replies for label in labels)
    still = sum(label.truncated_after_retry for label in labels)
    assert f"backbone replies cut by max_tokens: {total} (each asked again with twice the room), {still} still cut" \
        in capsys.readouterr().out
