"""`overstory data hierarchy` through the CLI: output written, a killed run resumes without duplicates."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import yaml

from overstory.cli import main
from overstory.core.records import LEVELS
from overstory.data_pipeline.hierarchy import load_hierarchies
from overstory.data_pipeline.hierarchy_job import level_stats

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/data/hierarchy.yaml"


def _run(out: Path, *extra: str) -> int:
    return main(["data", "hierarchy", "--config", str(CONFIG), f"out={out}",
                 f"corpus.path={ROOT / 'data/squad/dev-v2.0-articles.json'}", "tracking.backend=none", *extra])


def test_config_names_its_command() -> None:
    assert CONFIG.read_text().splitlines()[0] == "# overstory data hierarchy --config configs/data/hierarchy.yaml"
    assert yaml.safe_load(CONFIG.read_text())["corpus"]["kind"] == "squad"


def test_job_writes_and_resumes(tmp_path: Path, capsys) -> None:
    out = tmp_path / "squad.jsonl"
    assert _run(out) == 0
    full = load_hierarchies(out)
    assert Counter(c.level for c in full)["document"] == 3
    printed = capsys.readouterr().out
    assert all(level in printed for level in LEVELS) and "median tokens" in printed
    stats = level_stats(full)
    assert list(stats) == list(LEVELS) and stats["paragraph"]["count"] == 126
    assert stats["sentence"]["max_tokens"] <= stats["document"]["max_tokens"]

    # simulate a run killed inside the last document: drop its document node and cut a line in half
    lines = out.read_text().splitlines(keepends=True)
    last_doc = json.loads(lines[-1])["doc_id"]
    kept = [line for line in lines if not (json.loads(line)["doc_id"] == last_doc and
                                           json.loads(line)["level"] in ("document", "section"))]
    out.write_text("".join(kept) + kept[-1][: len(kept[-1]) // 2])
    assert _run(out) == 0
    assert "resuming: 2 of 3 documents" in capsys.readouterr().out
    resumed = load_hierarchies(out)
    assert sorted(resumed, key=lambda c: c.id) == sorted(full, key=lambda c: c.id)  # nothing lost or duplicated

    assert _run(out) == 0  # a finished file: nothing is rebuilt
    assert load_hierarchies(out) == resumed


def test_resume_with_other_settings_is_refused(tmp_path: Path, capsys) -> None:
    out = tmp_path / "tiny.jsonl"
    assert _run(out, "corpus.limit_docs=1") == 0
    capsys.readouterr()
    assert _run(out, "corpus.limit_docs=1", "hierarchy.subsection_tokens=128") == 2
    assert "other settings (hierarchy.subsection_tokens differ" in capsys.readouterr().err


def test_unknown_corpus_kind_is_a_config_error(tmp_path: Path, capsys) -> None:
    assert _run(tmp_path / "x.jsonl", "corpus.kind=sqad") == 2
    assert "did you mean 'squad'" in capsys.readouterr().err
