"""`runner: ray`: real data jobs on a local Ray cluster against a fleet of two embedded servers, compared with the
thread runner: SmolLM2 summaries of the shipped markdown docs (the same ids, the same summaries where each request is
served alone, resumed by id, and a server that is down counted as failures, never lost) and SmolLM2 planner traces of
real SQuAD questions from a pool of teachers, one of them on a server of its own (the same traces and rejections);
SmolLM2 LATTICE trees of real HotpotQA paragraphs, the keyword batches (top-down) or the node summaries (bottom-up)
on Ray (the same records and trees, resumed by id). One Ray cluster for the module, and at most one Ray run per job
kind and purpose: the suite's time is budgeted."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

from overstory.core.config import ConfigError, load_config
from overstory.core.records import PseudoLabel, SummaryRecord, read_jsonl, write_jsonl
from overstory.data_pipeline import lattice_tree, summaries, traces
from overstory.data_pipeline.corpora import load_corpus
from overstory.data_pipeline.fanout import Fanout, failures_path, settings_path
from overstory.data_pipeline.hierarchy import save_hierarchies, stored_hierarchy_path
from overstory.data_pipeline.lattice_tree import LatticeTreeConfig
from overstory.data_pipeline.pseudo_labels import single_document_questions
from overstory.data_pipeline.ray_runner import RayConfig, import_ray, ray_map
from overstory.data_pipeline.summaries import SummariesConfig
from overstory.data_pipeline.traces import TracesConfig, rejected_path
from overstory.retrieval.lattice.tree import Tree
from overstory.serving.client import BACKOFF_ENV, Client
from overstory.serving.config import ServeConfig
from overstory.serving.launch import serve_in_background

ray = pytest.importorskip("ray", reason="the `ray` extra (ray[data]) is part of .venv's lock")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster of two CPUs for the module (the job joins it: ``ray.address`` is left empty). Its workers
    start with this process's environment, in which the client's retries wait 0.01 s, as under the ``quick_retries``
    fixture (one test takes a server of the fleet down on purpose)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(BACKOFF_ENV, "0.01")
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


@pytest.fixture(scope="module")
def threads_run(tmp_path_factory: pytest.TempPathFactory, fleet: list[str]) -> Path:
    """The thread runner's output for the slice (4 chunks), one request at a time on the fleet's first server."""
    out = tmp_path_factory.mktemp("threads") / "summaries.jsonl"
    counts = summaries.run(_config(out, "limit=4", "concurrency=1", f"server_url={fleet[0]}"))
    assert (counts["ok"], counts["failed"]) == (4, 0)
    return out


@pytest.mark.slow
def test_ray_and_threads_summarise_the_same_chunks_alike(tmp_path: Path, ray_cluster: None, fleet: list[str],
                                                        threads_run: Path) -> None:
    """One request at a time on each runner (greedy decoding of a request served alone is the same every run): the
    Ray worker's chunks, spread over both servers, get the summaries the thread runner got from one."""
    on_ray = summaries.run(_config(tmp_path / "ray.jsonl", "limit=4", "concurrency=1", "runner=ray",
                                   _endpoints(fleet)))
    assert (on_ray["ok"], on_ray["failed"]) == (4, 0)
    expected, got = _records(threads_run), _records(tmp_path / "ray.jsonl")
    assert sorted(r.id for r in got) == sorted(r.id for r in expected)
    by_id = {r.id: r for r in expected}
    for record in got:
        assert record.summary == by_id[record.id].summary
        assert record.generator == by_id[record.id].generator == "builtin:smollm2-135m-instruct"
        np.testing.assert_allclose(record.target_embedding, by_id[record.id].target_embedding, atol=1e-5)


@pytest.mark.slow
def test_two_workers_a_server_down_and_a_rerun_finish_the_slice_once(tmp_path: Path, ray_cluster: None,
                                                                      fleet: list[str], threads_run: Path) -> None:
    """Two workers over three endpoints, the third down: the chunk sent there fails (a transport error, in the
    failures file the thread runner writes), the others are written. The rerun over the two live servers, for the
    whole slice, does only what is missing (the failed chunk and the 4th): each id is written once, the thread
    runner's ids, and the failure is resolved."""
    out = tmp_path / "ray.jsonl"
    partial = summaries.run(_config(out, "limit=3", "concurrency=2", "runner=ray", "max_failure_share=1.0",
                                    _endpoints([*fleet, _down_url()])))
    assert (partial["ok"], partial["failed"]) == (2, 1)
    (failure,) = read_jsonl(failures_path(out))
    assert "transport error" in failure["error"] and failure["id"] not in {r.id for r in _records(out)}
    rest = summaries.run(_config(out, "limit=4", "concurrency=2", "runner=ray", _endpoints(fleet)))
    assert (rest["ok"], rest["skipped"], rest["failed"], rest["resolved"]) == (2, 2, 0, 1)
    ids = [r.id for r in _records(out)]
    assert len(ids) == len(set(ids)) == 4 and set(ids) == {r.id for r in _records(threads_run)}
    assert list(read_jsonl(failures_path(out))) == []
    assert json.loads(settings_path(out).read_text())["served"]["generator"] == "builtin:smollm2-135m-instruct"


def _dies_once(marker: Path) -> Callable[[Client], Callable[[int], int]]:
    """Work that kills its Ray worker's process on item 2 the first time (the marker file records that it did):
    no model is needed to kill a worker, so the work is this, not a model call."""

    def build(_: Client) -> Callable[[int], int]:
        def work(item: int) -> int:
            if item == 2 and not marker.exists():
                marker.touch()
                os._exit(1)
            return item * 10
        return work
    return build


@pytest.mark.slow
def test_a_worker_killed_mid_item_has_it_retried_once(tmp_path: Path, ray_cluster: None, fleet: list[str]) -> None:
    with closing(Client.from_url(fleet[0])) as client:
        results = list(ray_map(_dies_once(tmp_path / "died"), client, [1, 2, 3], 2, RayConfig(endpoints=fleet)))
    assert (tmp_path / "died").exists()
    assert sorted((item, result, error) for item, result, error in results) == [(1, 10, None), (2, 20, None),
                                                                                  (3, 30, None)]


@pytest.fixture(scope="module")
def squad_labels(tmp_path_factory: pytest.TempPathFactory, squad_chunks: list) -> Path:
    """Pseudo-labels of three real SQuAD questions (the traces job's input; the labels are chosen here)."""
    _, questions = load_corpus("squad", ROOT / "data/squad/dev-v2.0-articles.json")
    ranges = [("sentence", "paragraph"), ("paragraph", "section"), ("sentence", "sentence")]
    path = tmp_path_factory.mktemp("labels") / "labels.jsonl"
    write_jsonl(path, [PseudoLabel(q.id, doc_id, q.question, q.answers, low, high, True, 1, [], [], q.answers[0],
                                   "builtin:smollm2-135m-instruct", "contains")
                       for (q, doc_id), (low, high) in zip(single_document_questions(questions), ranges)])
    save_hierarchies(stored_hierarchy_path(path), squad_chunks)
    return path


def _traces_config(labels: Path, out: Path, own_server: str, *overrides: str) -> TracesConfig:
    """Two SmolLM2 teachers, one served by the job's server(s), one by a server of its own (the pool)."""
    return load_config(TracesConfig, ROOT / "configs/data/traces.yaml", [
        f"labels={labels}", f"out={out}", "metadata_tokens=64", "rewrite=false", "concurrency=1",
        "max_failure_share=0", "limit=2", "tracking.backend=none",
        "teachers={job: {kind: llm, max_tokens: 32}, "
        f"own: {{kind: llm, style: stepwise, max_tokens: 32, server_url: '{own_server}'}}}}", *overrides])


def _outcomes(out: Path) -> dict[str, tuple[str, str]]:
    """Trace id -> (outcome, text): the kept traces' completions and the rejected replies' raw text."""
    kept = {r["id"]: ("kept", r["completion"]) for r in read_jsonl(out)} if out.exists() else {}
    return kept | {r["id"]: ("rejected", r["raw"]) for r in read_jsonl(rejected_path(out))}


@pytest.mark.slow
def test_traces_from_a_pool_on_ray_match_the_threads(tmp_path: Path, ray_cluster: None, fleet: list[str],
                                                     squad_labels: Path) -> None:
    """The (label, teacher) pairs on Ray: the job's teacher spread over both servers, the other teacher on its own
    server (rebuilt on each worker), one request at a time: every pair gets the outcome and the text the thread
    runner got, and both record the same models behind the teachers."""
    on_threads, on_ray = tmp_path / "threads.jsonl", tmp_path / "ray.jsonl"
    traces.run(_traces_config(squad_labels, on_threads, fleet[1], f"server_url={fleet[0]}"))
    traces.run(_traces_config(squad_labels, on_ray, fleet[1], "runner=ray", _endpoints(fleet)))
    expected = _outcomes(on_threads)
    assert len(expected) == 4 and {i.rsplit("/", 1)[1] for i in expected} == {"job", "own"}
    assert _outcomes(on_ray) == expected
    served = [json.loads(settings_path(out).read_text())["served"] for out in (on_threads, on_ray)]
    assert served[0] == served[1] == {"teacher/job": "builtin:smollm2-135m-instruct",
                                      "teacher/own": "builtin:smollm2-135m-instruct"}


def _tree_config(out: Path, method: str, *overrides: str) -> LatticeTreeConfig:
    """A tiny real slice: the first HotpotQA paragraphs, M = 4, k-means only for the top-down clustering (no level
    fits budget 0: the keywords are what runs on Ray), one attempt and short replies."""
    return load_config(LatticeTreeConfig, ROOT / "configs/data/lattice_tree.yaml", [
        f"out={out}", f"method={method}", f"corpus.path={ROOT / 'data/hotpotqa'}", "clustering.m_max=4",
        "clustering.token_budget=0", "keywords.batch_size=2", "keywords.max_tokens=320", "keywords.max_attempts=1",
        "keywords.concurrency=1", "summaries.max_tokens=96", "summaries.max_attempts=1", "summaries.concurrency=1",
        "tracking.backend=none", *overrides])


def _by_id(path: Path, drop: tuple[str, ...] = ()) -> dict[str, dict]:
    return {r["id"]: {k: v for k, v in r.items() if k not in drop} for r in read_jsonl(path)}


@pytest.mark.slow
@pytest.mark.parametrize(("method", "leaves", "written"), [("top-down", 2, "keywords.jsonl"),
                                                           ("bottom-up", 8, "summaries.jsonl")])
def test_lattice_trees_on_ray_match_the_threads(method: str, leaves: int, written: str, tmp_path: Path,
                                                ray_cluster: None, fleet: list[str]) -> None:
    """The keyword batches (top-down) or the node summaries (bottom-up) on Ray, spread over both servers, one
    request at a time: the same records under the same ids as the thread runner on one server, the same tree (the
    embeddings and the clustering are the job's own, on the first server), the same served models recorded; a rerun
    on Ray asks for nothing."""
    on_threads, on_ray = tmp_path / "threads", tmp_path / "ray"
    expected = lattice_tree.run(_tree_config(on_threads, method, f"limit_leaves={leaves}", f"server_url={fleet[0]}"))
    report = lattice_tree.run(_tree_config(on_ray, method, f"limit_leaves={leaves}", "runner=ray", _endpoints(fleet)))
    assert _by_id(on_ray / written) == _by_id(on_threads / written) and len(_by_id(on_ray / written)) >= 2
    first, second = Tree.load(on_threads / "tree.json"), Tree.load(on_ray / "tree.json")
    assert (first.root, first.nodes) == (second.root, second.nodes) and report["stats"]["leaves"] == leaves
    stage = "keywords" if method == "top-down" else "summaries"
    for key in ("llm_calls", "prompt_tokens", "completion_tokens"):  # the workers' usage came back to the job
        assert report[stage][key] == expected[stage][key] > 0
    recorded = [json.loads(settings_path(out / written).read_text())["served"] for out in (on_threads, on_ray)]
    assert recorded[0] == recorded[1] and recorded[0]["generator"] == "builtin:smollm2-135m-instruct"
    again = lattice_tree.run(_tree_config(on_ray, method, f"limit_leaves={leaves}", "runner=ray", _endpoints(fleet)))
    if method == "top-down":
        assert again["keywords"]["llm_calls"] == 0 and again["keywords"]["leaves_skipped_done"] == leaves
    else:
        assert again["summaries"]["llm_calls"] == 0
        assert again["summaries"]["placements"]["summaries_reused"] == len(_by_id(on_ray / written))
    assert Tree.load(on_ray / "tree.json").nodes == first.nodes


def test_the_endpoints_api_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_KEY", "s3cret")
    monkeypatch.delenv("OVERSTORY_API_KEY", raising=False)
    assert RayConfig(api_key_env="FLEET_KEY").http_options({"timeout_s": 5}) == {"api_key": "s3cret", "timeout_s": 5}
    assert RayConfig().http_options() == {}  # OVERSTORY_API_KEY unset: no key is sent
    with pytest.raises(ConfigError, match="ray.api_key_env"):
        RayConfig(api_key_env="not a name")


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


def test_without_ray_the_error_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as it does where the extra is not installed
    with pytest.raises(ImportError, match=r"pip install 'overstory\[ray\]'"):
        Fanout("x", tmp_path / "x.jsonl", {}, runner="ray")
    assert not (tmp_path / "x.settings.json").exists()  # refused before anything was recorded
