"""`overstory data summaries`: real summaries from SmolLM2 on a small slice, resume, and failure records."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from overstory.cli import main
from overstory.core.config import ConfigError
from overstory.core.records import Chunk, SummaryRecord, read_jsonl, write_jsonl
from overstory.data_pipeline.fanout import settings_path
from overstory.data_pipeline.hierarchy import load_hierarchies, stored_hierarchy_path
from overstory.data_pipeline.summaries import SummariesConfig, failures_path
from overstory.data_pipeline.summarize import SummaryFailed, SummaryRejected, check_summary, summarise
from overstory.models.registry import MINILM
from overstory.serving.config import ServeConfig
from overstory.serving.launch import serve_in_background

ROOT = Path(__file__).resolve().parents[2]


def _run(out: Path, *extra: str) -> int:
    return main(["data", "summaries", "--config", str(ROOT / "configs/data/summaries.yaml"), f"out={out}",
                 "corpus.kind=text", f"corpus.path={ROOT / 'data/markdown'}", "levels=[paragraph, subsection]",
                 "max_summary_tokens=24", "tracking.backend=none", *extra])


@pytest.mark.slow
def test_real_summaries_and_resume(tmp_path: Path) -> None:
    out = tmp_path / "summaries.jsonl"
    assert _run(out, "limit=3") == 0
    records = list(read_jsonl(out, SummaryRecord))
    assert len(records) == 3
    for record in records:
        assert record.summary and record.completion_tokens <= 24 and record.attempts >= 1
        assert len(record.child_embeddings) == len(record.child_ids) >= 1
        assert np.linalg.norm(record.target_embedding) == pytest.approx(1.0, abs=1e-3)
        assert record.generator == "builtin:smollm2-135m-instruct"
    kept = stored_hierarchy_path(out)
    assert {r.id for r in records} <= {c.id for c in load_hierarchies(kept)}
    # an earlier failure of a chunk that is now written leaves the failures file; one still missing stays
    failed = [{"id": records[0].id, "error": "timed out", "raw": ""}, {"id": "never-written", "error": "x", "raw": ""}]
    write_jsonl(failures_path(out), failed)
    assert _run(out, "limit=4") == 0  # resumes: only the 4th chunk is new
    again = list(read_jsonl(out, SummaryRecord))
    assert [r.id for r in again[:3]] == [r.id for r in records] and len(again) == 4
    assert [r["id"] for r in read_jsonl(failures_path(out))] == ["never-written"]


@pytest.mark.slow
def test_records_name_the_model_the_server_serves(tmp_path: Path) -> None:
    """The job's config says one generator; the server at server_url serves SmolLM2: the records say SmolLM2."""
    with serve_in_background(ServeConfig.local(port=0)) as url:
        out = tmp_path / "summaries.jsonl"
        assert _run(out, "limit=1", f"server_url={url}",
                    "serve.roles.generator.model=Qwen/Qwen2.5-7B-Instruct") == 0
    (record,) = read_jsonl(out, SummaryRecord)
    assert record.generator == "builtin:smollm2-135m-instruct" and record.encoder == MINILM
    assert json.loads(settings_path(out).read_text())["served"]["generator"] == "builtin:smollm2-135m-instruct"
    assert _run(out, "limit=2", "max_summary_tokens=32") == 2  # other settings are refused, naming the key


class EmptyGenerator:
    """Stand-in for an LLM that always answers with whitespace: a real model cannot be made to fail
    on purpose, and this is the failure path under test."""

    def __init__(self) -> None:
        self.calls = 0

    def chat(self, role, messages, **params):
        self.calls += 1
        return type("Reply", (), {"text": "  \n", "usage": {"prompt_tokens": 5, "completion_tokens": 1}})()


def test_unusable_summaries_are_retried_then_recorded(tmp_path: Path) -> None:
    config = SummariesConfig(corpus=None, out=str(tmp_path / "s.jsonl"), max_attempts=3)  # type: ignore[arg-type]
    chunk = Chunk("d#p0", "d", "paragraph", "Some text.", "d#ss0", ["d#s0"], 0, 10, 3)
    generator = EmptyGenerator()
    with pytest.raises(SummaryFailed) as failed:
        summarise(chunk, [], generator, config)  # type: ignore[arg-type]
    record = failed.value.record
    assert generator.calls == 3 and record.attempts == 3
    assert record.error == "empty summary" and record.raw == "  \n"
    assert failures_path(tmp_path / "s.jsonl").name == "s.failures.jsonl"


def test_check_summary() -> None:
    assert check_summary("Summary: The Normans ruled Normandy.", "The Normans ...") == "The Normans ruled Normandy."
    with pytest.raises(SummaryRejected, match="empty"):
        check_summary("Summary:   ", "text")
    with pytest.raises(SummaryRejected, match="language"):
        check_summary("诺曼人统治了诺曼底。", "The Normans ruled Normandy.")


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="sentences have no children"):
        SummariesConfig(corpus=None, out="x", levels=["sentence"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown level 'chaptr'"):
        SummariesConfig(corpus=None, out="x", levels=["chaptr"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="request_timeout_s must be positive"):
        SummariesConfig(corpus=None, out="x", levels=["section"], request_timeout_s=0)  # type: ignore[arg-type]
