"""FABLE's forest job and Orion-RAG's tagging job against a stack that answers every chat request with one error
status (``tests/stand_ins.py``'s ``failing_server``, over HTTP, through ``overstory``'s command line): a refusal (a
4xx: a wrong role, a bad request) stops the job at once with exit code 1, naming the role and the server's reason,
and fails no item; a transient failure (a 503, after the client's retries) is a counted failed item that a rerun
retries."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI

from overstory.cli import main
from overstory.core.records import read_jsonl
from overstory.data_pipeline.fanout import failures_path
from overstory.serving.launch import serve_in_background
from tests.stand_ins import failing_server

# one document of one sentence: FABLE makes one call (the root's summary), Orion two (master tags, then its chunk's)
CORPUS = [{"id": "nile", "title": "Nile", "text": "The Nile is the longest river in Africa."}]
# job -> (config, the file its finished items go to, the file its failures file is named after)
JOBS = {"fable-forest": ("configs/data/fable_forest.yaml", "trees.jsonl", "trees.jsonl"),
        "orion-tags": ("configs/data/orion_tags.yaml", "chunks.jsonl", "chunks.jsonl")}
pytestmark = pytest.mark.usefixtures("quick_retries")  # the 503s' retries, without their waits


def with_embeddings(app: FastAPI) -> FastAPI:
    """The failing stack with an embedder that answers, so that only the chat requests fail."""

    @app.post("/v1/embeddings")
    def embeddings(payload: dict) -> dict:
        texts = [payload["input"]] if isinstance(payload["input"], str) else payload["input"]
        return {"object": "list", "data": [{"index": i, "embedding": [1.0, float(len(t) % 7)]}
                                           for i, t in enumerate(texts)], "usage": {"prompt_tokens": 0}}

    return app


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in CORPUS))
    return path


def run_job(job: str, url: str, corpus: Path, out: Path) -> int:
    return main(["data", job, "--config", JOBS[job][0], "corpus.kind=jsonl", f"corpus.path={corpus}", f"out={out}",
                 f"server_url={url}", "tracking.backend=none"])


@pytest.fixture(scope="module")
def refusing() -> Iterator[str]:
    with serve_in_background(with_embeddings(failing_server(404, "The model `generator` does not exist."))) as url:
        yield url


@pytest.mark.parametrize("job", JOBS)
def test_a_refused_request_stops_the_job_naming_the_role_and_the_reason(job, refusing, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_job(job, refusing, corpus, out) == 1
    error = capsys.readouterr().err
    assert error.startswith("request failed: ") and "(role 'generator')" in error
    assert "The model `generator` does not exist." in error and "HTTP 404" in error
    # no item counted as failed (a rerun would only be refused again) and none written
    assert not failures_path(out / JOBS[job][2]).read_text() and not (out / JOBS[job][1]).read_text()
    assert not (out / "build.json").exists()


@pytest.mark.parametrize("job", JOBS)
def test_a_transient_failure_is_a_counted_failed_item_for_the_rerun(job, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    with serve_in_background(with_embeddings(failing_server(503, "overloaded"))) as url:
        assert run_job(job, url, corpus, out) == 1
    assert f"job failed: {job}: 1 of 1 items failed" in capsys.readouterr().err
    (failure,) = read_jsonl(failures_path(out / JOBS[job][2]))  # the document: a rerun builds or tags it again
    assert failure["id"] == "nile" and "503: overloaded" in failure["raw"]
    assert not (out / JOBS[job][1]).read_text()


# four one-paragraph documents under a tree of at most two children a node: the bottom-up build summarises 3 groups
TREE_CORPUS = [{"id": f"d{i}", "title": title, "text": f"{title} is a river of {place}."}
               for i, (title, place) in enumerate([("Nile", "Africa"), ("Rhine", "Europe"), ("Amazon", "Brazil"),
                                                   ("Volga", "Russia")])]


def run_tree(url: str, tmp_path: Path) -> tuple[int, Path]:
    corpus, out = tmp_path / "rivers.jsonl", tmp_path / "tree"
    corpus.write_text("".join(json.dumps(record) + "\n" for record in TREE_CORPUS))
    code = main(["data", "lattice-tree", "--config", "configs/data/lattice_tree.yaml", "method=bottom-up",
                 "corpus.kind=jsonl", f"corpus.path={corpus}", "clustering.m_max=2", f"out={out}",
                 f"server_url={url}", "tracking.backend=none"])
    return code, out


def test_a_refused_node_summary_stops_the_tree_build(refusing, tmp_path, capsys):
    code, out = run_tree(refusing, tmp_path)
    assert code == 1
    error = capsys.readouterr().err
    assert error.startswith("request failed: ") and "node summary" in error and "HTTP 404" in error
    assert not (out / "tree.json").exists()


def test_node_summaries_that_fail_in_transit_are_counted_and_fail_the_tree_build(tmp_path, capsys):
    with serve_in_background(with_embeddings(failing_server(503, "overloaded"))) as url:
        code, out = run_tree(url, tmp_path)
    assert code == 1
    placements = json.loads((out / "build.json").read_text())["summaries"]["placements"]
    groups = placements["summaries_failed"]
    assert groups >= 2 and not placements.get("summaries_llm") and not placements.get("summaries_fallback")
    assert f"job failed: data lattice-tree: {groups} of {groups} items failed" in capsys.readouterr().err
    tree = json.loads((out / "tree.json").read_text())  # saved, its nodes named from their members' heads
    assert tree
