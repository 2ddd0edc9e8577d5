"""Real compressor training data, made once per test session: SmolLM2 summaries of 30 HotpotQA paragraphs."""

from __future__ import annotations

from pathlib import Path

import pytest

from overstory.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def summaries(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("summaries") / "hotpotqa.jsonl"
    code = main(["data", "summaries", "--config", str(ROOT / "configs/data/summaries.yaml"), f"out={out}",
                 "corpus.kind=hotpotqa", f"corpus.path={ROOT / 'data/hotpotqa'}", "levels=[paragraph]",
                 "limit=30", "max_summary_tokens=24", "tracking.backend=none"])
    assert code == 0
    return out


@pytest.fixture(scope="session")
def planner_traces(tmp_path_factory) -> Path:
    """Template-teacher traces for 24 real SQuAD questions over the three articles (labels chosen here,
    cycling through ranges, so the SFT tests see every level; the traces job itself is real)."""
    from data_pipeline.corpora import load_corpus
    from data_pipeline.formats import PseudoLabel, write_jsonl
    from data_pipeline.pseudo_labels import single_document_questions

    folder = tmp_path_factory.mktemp("planner")
    squad = ROOT / "data/squad/dev-v2.0-articles.json"
    picked: dict[str, list] = {}
    for question, doc_id in single_document_questions(load_corpus("squad", squad)[1]):
        picked.setdefault(doc_id, [])
        if len(picked[doc_id]) < 8:
            picked[doc_id].append((question, doc_id))
    ranges = [("sentence", "sentence"), ("sentence", "paragraph"), ("paragraph", "section"), ("sentence", "document")]
    labels = [PseudoLabel(q.id, d, q.question, q.answers, *ranges[i % len(ranges)], True, 1, [], [], q.answers[0],
                          "builtin:smollm2-135m-instruct", "contains")
              for i, (q, d) in enumerate(pair for pairs in picked.values() for pair in pairs)]
    write_jsonl(folder / "labels.jsonl", labels)
    assert main(["data", "traces", "--config", str(ROOT / "configs/data/traces.yaml"),
                 f"labels={folder / 'labels.jsonl'}", f"corpus.path={squad}", f"out={folder / 'traces.jsonl'}",
                 "teachers={template: {kind: template}}", "metadata_tokens=96", "tracking.backend=none"]) == 0
    return folder / "traces.jsonl"
