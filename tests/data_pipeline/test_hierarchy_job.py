"""`overstory data hierarchy` through the CLI: output written, a killed run resumes without duplicates."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from data_pipeline.hierarchy import load_hierarchies
from overstory.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _run(out: Path, *extra: str) -> int:
    return main(["data", "hierarchy", "--config", str(ROOT / "configs/data/hierarchy.yaml"), f"out={out}",
                 f"corpus.path={ROOT / 'data/squad/dev-v2.0-articles.json'}", "tracking.backend=none", *extra])


def test_job_writes_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "squad.jsonl"
    assert _run(out) == 0
    full = load_hierarchies(out)
    assert Counter(c.level for c in full)["document"] == 3

    # simulate a run killed inside the last document: drop its document node and cut a line in half
    lines = out.read_text().splitlines(keepends=True)
    last_doc = json.loads(lines[-1])["doc_id"]
    kept = [line for line in lines if not (json.loads(line)["doc_id"] == last_doc and
                                           json.loads(line)["level"] in ("document", "section"))]
    out.write_text("".join(kept) + kept[-1][: len(kept[-1]) // 2])
    assert _run(out) == 0
    resumed = load_hierarchies(out)
    assert sorted(c.id for c in resumed) == sorted(c.id for c in full)
    assert len({c.id for c in resumed}) == len(resumed)


def test_unknown_corpus_kind_is_a_config_error(tmp_path: Path, capsys) -> None:
    assert _run(tmp_path / "x.jsonl", "corpus.kind=sqad") == 2
    assert "did you mean 'squad'" in capsys.readouterr().err
