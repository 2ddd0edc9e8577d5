"""The data jobs' fan-out skeleton: resume, retried failures, the settings record, the failure share, the runner."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from overstory.core.config import ConfigError
from overstory.core.failures import TooManyFailures
from overstory.core.records import FailureRecord, read_jsonl
from overstory.data_pipeline.corpora import CorpusConfig
from overstory.data_pipeline.fanout import (
    Fanout,
    failures_path,
    job_settings,
    settings_path,
    thread_runner,
)
from overstory.data_pipeline.summaries import SummariesConfig
from overstory.serving.client import ClientError


def _double(item: int) -> dict:
    if item < 0:
        raise ClientError(503, f"item {item}: server busy")
    return {"id": str(item), "value": 2 * item}


def _run(out: Path, items: list[int], settings: dict | None = None, share: float = 0.0) -> dict:
    with Fanout("double", out, settings or {"factor": 2}, concurrency=3, max_failure_share=share) as fanout:
        todo = fanout.todo(items, str)
        fanout.run(todo, str, _double, lambda _, record: fanout.write(record, "ok"), "doubling")
        counts = fanout.finish()
        fanout.raise_if_failed()
    return counts


def test_failed_items_are_listed_counted_and_retried_by_a_rerun(tmp_path: Path) -> None:
    out = tmp_path / "double.jsonl"
    with pytest.raises(TooManyFailures, match="double: 2 of 5 items failed") as failed:
        _run(out, [1, 2, -1, 3, -2])
    assert failed.value.counts["ok"] == 3 and failed.value.counts["failed"] == 2
    assert sorted(r["id"] for r in read_jsonl(out)) == ["1", "2", "3"]
    failures = {r["id"]: r["error"] for r in read_jsonl(failures_path(out))}
    assert failures == {"-1": "503: item -1: server busy", "-2": "503: item -2: server busy"}
    # the rerun skips what is written and tries the failed items again; the file keeps one line per missing item
    counts = _run(out, [1, 2, 3, 4, -1, -2], share=1.0)
    assert counts["skipped"] == 3 and counts["ok"] == 1 and counts["failed"] == 2
    assert sorted(r["id"] for r in read_jsonl(failures_path(out))) == ["-1", "-2"]
    # an item written since leaves the failures file
    with Fanout("double", out, {"factor": 2}) as fanout:
        fanout.write({"id": "-1"})
        assert fanout.finish()["resolved"] == 1
    assert [r["id"] for r in read_jsonl(failures_path(out))] == ["-2"]


def test_a_failure_resolved_as_an_outcome_kept_elsewhere_leaves_the_failures_file(tmp_path: Path) -> None:
    """A job that keeps some final outcomes in another file (rejected traces) names their ids to ``todo``: an item
    that failed once and ends there on the rerun is no longer missing."""
    out = tmp_path / "double.jsonl"
    with Fanout("x", out, {}) as fanout:
        fanout.fail("a", FailureRecord("a", "x", "timed out", "partial reply", 2))
        fanout.fail("b", "server busy")
        fanout.finish()
    assert list(read_jsonl(failures_path(out))) == [
        {"id": "a", "job": "x", "error": "timed out", "raw": "partial reply", "attempts": 2},
        {"id": "b", "job": "x", "error": "server busy", "raw": "", "attempts": 1}]
    rejected: set[str] = set()
    with Fanout("x", out, {}) as fanout:
        assert fanout.todo(["a", "b"], str, rejected) == ["a", "b"]
        rejected.add("a")  # the rerun's outcome for a: rejected, kept elsewhere
        assert fanout.finish()["resolved"] == 1
    assert [r["id"] for r in read_jsonl(failures_path(out))] == ["b"]


def test_a_finished_run_writes_its_output_in_the_items_order(tmp_path: Path) -> None:
    """Results are appended as they complete; the finished run's file is in the items' order, also across a resume
    (its earlier records take their items' places), so a trainer reading it sees the same data every run."""
    out = tmp_path / "double.jsonl"
    first_written = threading.Event()
    written: list[str] = []

    def work(item: int) -> dict:
        if item == 1:  # the first item completes only once a later one is written
            assert first_written.wait(timeout=60)
        return _double(item)

    def write(_: int, record: dict) -> None:
        written.append(record["id"])
        first_written.set()
        fanout.write(record)

    with Fanout("double", out, {"factor": 2}, concurrency=2) as fanout:
        fanout.run(fanout.todo([1, 2], str), str, work, write, "doubling")
        assert [r["id"] for r in read_jsonl(out)] == written == ["2", "1"]  # completion order until the end
        fanout.finish()
    assert [r["id"] for r in read_jsonl(out)] == ["1", "2"]
    with Fanout("double", out, {"factor": 2}, concurrency=2) as fanout:
        fanout.run(fanout.todo([0, 1, 2, 3], str), str, _double, lambda _, record: fanout.write(record), "doubling")
        fanout.finish()
    assert [r["id"] for r in read_jsonl(out)] == ["0", "1", "2", "3"]


def test_the_failure_share_is_of_the_items_attempted(tmp_path: Path) -> None:
    assert _run(tmp_path / "a.jsonl", [1, 2, 3, -1], share=0.25)["failed"] == 1  # 1 of 4 is not more than 25 %
    with pytest.raises(TooManyFailures, match="2 of 4 items failed"):
        _run(tmp_path / "b.jsonl", [1, 2, -3, -1], share=0.25)
    with pytest.raises(ConfigError, match="max_failure_share"):
        Fanout("x", tmp_path / "c.jsonl", {}, max_failure_share=1.5)


def test_an_exception_that_is_no_item_failure_stops_the_run(tmp_path: Path) -> None:
    def broken(item: int) -> dict:
        raise KeyError("a bug, not a failed request")

    with Fanout("x", tmp_path / "x.jsonl", {}) as fanout, pytest.raises(KeyError):
        fanout.run([1, 2], str, broken, lambda _, record: fanout.write(record), "x")


def test_a_rerun_with_other_settings_is_refused_naming_the_keys(tmp_path: Path) -> None:
    out = tmp_path / "double.jsonl"
    _run(out, [1], {"factor": 2, "model": {"temperature": 0.0}})
    assert json.loads(settings_path(out).read_text()) == {"factor": 2, "model": {"temperature": 0.0}}
    with pytest.raises(ConfigError, match=r"model\.temperature differ"):
        _run(out, [2], {"factor": 2, "model": {"temperature": 0.7}})
    _run(out, [2], {"factor": 2, "model": {"temperature": 0.0}})  # the same settings resume
    settings_path(out).unlink()
    with pytest.raises(ConfigError, match="without a record of their settings"):
        _run(out, [3])


def test_another_served_model_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "double.jsonl"
    with Fanout("x", out, {}) as fanout:
        fanout.record_served({"generator": "model-x"})
        fanout.write({"id": "1"})
        fanout.finish()
    assert json.loads(settings_path(out).read_text())["served"] == {"generator": "model-x"}
    with Fanout("x", out, {}) as fanout, pytest.raises(ConfigError, match=r"served\.generator differ"):
        fanout.record_served({"generator": "model-y"})


def test_job_settings_leave_out_how_the_job_runs() -> None:
    settings = job_settings(SummariesConfig(corpus=CorpusConfig(kind="squad", path="a.json", limit_docs=3),
                                            out="x.jsonl", concurrency=8, limit=5, server_url="http://h:1"))
    assert settings["corpus"] == {"kind": "squad", "split": "", "paragraph_words": 0}
    assert not {"out", "concurrency", "limit", "server_url", "serve", "tracking", "max_failure_share"} & set(settings)
    assert settings["max_summary_tokens"] == 128 and settings["levels"] == ["paragraph", "subsection", "section"]


def test_the_thread_runner_cancels_what_has_not_started_when_stopped() -> None:
    started: list[int] = []
    gate = threading.Event()

    def work(item: int) -> int:
        started.append(item)
        if item:
            gate.wait(30)
        return item

    runner = thread_runner(work, list(range(20)), 2)
    assert next(runner) == (0, 0, None)
    threading.Timer(0.5, gate.set).start()  # lets the items already running finish while the runner closes
    runner.close()  # a hard error in the job: the items not yet started never run
    assert 2 <= len(started) < 20
