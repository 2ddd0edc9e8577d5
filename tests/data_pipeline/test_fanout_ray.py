"""`runner: ray`: a real data job (SmolLM2 summaries of the shipped markdown docs) on a local Ray cluster against a
fleet of two embedded servers, compared with the thread runner: the same ids, the same summaries where each
request is served alone, resumed by id, and a server that is down counted as failures, never lost."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from overstory.core.config import ConfigError, load_config
from overstory.core.records import SummaryRecord, read_jsonl
from overstory.data_pipeline import summaries
from overstory.data_pipeline.fanout import Fanout, failures_path, settings_path
from overstory.data_pipeline.ray_runner import RayConfig, import_ray
from overstory.data_pipeline.summaries import SummariesConfig
from overstory.serving.config import ServeConfig
from overstory.serving.launch import serve_in_background

ray = pytest.importorskip("ray", reason="the `ray` extra (ray[data]) is part of .venv's lock")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster of two CPUs for the module (the job joins it: ``ray.address`` is left empty)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[str]]:
    """Two embedded servers of SmolLM2 (and MiniLM): the endpoints the Ray workers spread the requests over."""
    with serve_in_background(ServeConfig.local(port=0)) as first:
        with serve_in_background(ServeConfig.local(port=0)) as second:
            yield [first, second]


def _config(out: Path, *overrides: str) -> SummariesConfig:
    return load_config(SummariesConfig, ROOT / "configs/data/summaries.yaml", [
        f"out={out}", "corpus.kind=text", f"corpus.path={ROOT / 'data/markdown'}", "levels=[paragraph]",
        "max_summary_tokens=16", "tracking.backend=none", *overrides])


def _endpoints(urls: list[str]) -> str:
    return f"ray.endpoints=[{', '.join(urls)}]"


def _records(out: Path) -> list[SummaryRecord]:
    return list(read_jsonl(out, SummaryRecord))


def _down_url() -> str:
    """The URL of a port nothing listens on (bound, then closed): a server of the fleet that is down."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.slow
def test_ray_and_threads_summarise_the_same_chunks_alike(tmp_path: Path, ray_cluster: None, fleet: list[str]) -> None:
    """One request at a time on each runner (greedy decoding of a request served alone is the same every run): the
    Ray worker's chunks, spread over both servers, get the summaries the thread runner got from one."""
    threads = summaries.run(_config(tmp_path / "threads.jsonl", "limit=4", "concurrency=1", f"server_url={fleet[0]}"))
    on_ray = summaries.run(_config(tmp_path / "ray.jsonl", "limit=4", "concurrency=1", "runner=ray",
                                   _endpoints(fleet)))
    assert threads["ok"] == on_ray["ok"] == 4 and threads["failed"] == on_ray["failed"] == 0
    expected, got = _records(tmp_path / "threads.jsonl"), _records(tmp_path / "ray.jsonl")
    assert sorted(r.id for r in got) == sorted(r.id for r in expected)
    by_id = {r.id: r for r in expected}
    for record in got:
        assert record.summary == by_id[record.id].summary
        assert record.generator == by_id[record.id].generator == "builtin:smollm2-135m-instruct"
        np.testing.assert_allclose(record.target_embedding, by_id[record.id].target_embedding, atol=1e-5)


@pytest.mark.slow
def test_two_ray_workers_over_two_servers_resume_by_id(tmp_path: Path, ray_cluster: None, fleet: list[str]) -> None:
    """Two workers against two servers: a partial run (the first 3 chunks), then the whole slice: only the other 3
    are summarised, and the output holds each of the 6 ids once, the ids the thread runner's slice holds."""
    out = tmp_path / "ray.jsonl"
    first = summaries.run(_config(out, "limit=3", "concurrency=2", "runner=ray", _endpoints(fleet)))
    rest = summaries.run(_config(out, "limit=6", "concurrency=2", "runner=ray", _endpoints(fleet)))
    assert (first["ok"], rest["ok"], rest["skipped"]) == (3, 3, 3)
    ids = [r.id for r in _records(out)]
    assert len(ids) == len(set(ids)) == 6
    targets = [c for c in summaries.summarised_hierarchy(_config(out)) if c.level == "paragraph" and c.children]
    assert set(ids) == {c.id for c in targets[:6]}
    assert json.loads(settings_path(out).read_text())["served"]["generator"] == "builtin:smollm2-135m-instruct"


@pytest.mark.slow
def test_a_server_that_is_down_fails_its_items_which_a_rerun_retries(tmp_path: Path, ray_cluster: None,
                                                                      fleet: list[str]) -> None:
    """Three endpoints, the third down: the chunk sent there fails (a transport error, in the failures file the
    thread runner writes), the others are written; a rerun against the two live servers writes it."""
    out = tmp_path / "ray.jsonl"
    counts = summaries.run(_config(out, "limit=3", "concurrency=2", "runner=ray", "max_failure_share=1.0",
                                   _endpoints([*fleet, _down_url()])))
    assert (counts["ok"], counts["failed"]) == (2, 1)
    (failure,) = read_jsonl(failures_path(out))
    assert "transport error" in failure["error"] and failure["id"] not in {r.id for r in _records(out)}
    again = summaries.run(_config(out, "limit=3", "concurrency=2", "runner=ray", _endpoints(fleet)))
    assert (again["ok"], again["skipped"], again["resolved"]) == (1, 2, 1)
    assert failure["id"] in {r.id for r in _records(out)} and list(read_jsonl(failures_path(out))) == []


def test_bad_ray_settings_name_their_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ray.endpoints\\[0\\]"):
        _config(tmp_path / "x.jsonl", "ray.endpoints=[node1:8000]")
    with pytest.raises(ConfigError, match="ray.address"):
        RayConfig(address="http://head:6379")
    with pytest.raises(ConfigError, match="runner"):
        _config(tmp_path / "x.jsonl", "runner=dask")
    with pytest.raises(ConfigError, match="runner"):
        Fanout("x", tmp_path / "x.jsonl", {}, runner="dask")
    assert import_ray() is ray
