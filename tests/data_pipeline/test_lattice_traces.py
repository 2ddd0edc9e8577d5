"""`overstory data lattice-traces`: every slate logged with what it needs for distillation, gold reached by the
oracle, resume after a kill (the LLM teacher's search has its own test in tests/retrieval/test_lattice_search.py).
The tree is the session's k-means tree over the first 150 HotpotQA paragraphs (``lattice_tree``, tests/conftest.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from overstory.cli import main
from overstory.core.config import load_config
from overstory.core.records import read_jsonl
from overstory.data_pipeline.lattice_traces import LatticeTracesConfig, run
from overstory.serving.launch import serve_in_background

ROOT = Path(__file__).resolve().parents[2]
CORPUS = [f"corpus.path={ROOT / 'data/hotpotqa'}", "corpus.limit_docs=150"]  # 11 questions


def _run(tree: Path, out: Path, *extra: str) -> int:
    return main(["data", "lattice-traces", "--config", str(ROOT / "configs/data/lattice_traces.yaml"), f"tree={tree}",
                 f"out={out}", *CORPUS, "scorer=oracle", "batch_queries=3", "search.iterations=8",
                 "tracking.backend=none", *extra])


def test_oracle_traces_log_every_slate_and_resume(lattice_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "traces.jsonl"
    assert _run(lattice_tree, out, "limit=3") == 0
    slates = list(read_jsonl(out))
    queries = list(read_jsonl(tmp_path / "traces.queries.jsonl"))
    assert len(queries) == 3 and len({s["query_id"] for s in slates}) == 3
    for slate in slates:
        n = len(slate["node_ids"])
        assert len(slate["texts"]) == len(slate["raw_scores"]) == len(slate["latent_scores"]) == n
        assert len(slate["leads_to_gold"]) == n and slate["teacher"] == "oracle"
        # the oracle scores exactly the candidates that lead to gold
        assert [s == 100.0 for s in slate["raw_scores"]] == slate["leads_to_gold"]
    assert all(q["recall@10"] == 1.0 for q in queries)  # the oracle reaches every gold paragraph
    # a killed run: the last line half written; the rerun drops it, skips the finished questions, adds the rest
    with out.open("a") as fh:
        fh.write('{"id": "half a li')
    assert _run(lattice_tree, out, "limit=5") == 0
    queries = list(read_jsonl(tmp_path / "traces.queries.jsonl"))
    assert len(queries) == 5 and len({q["id"] for q in queries}) == 5
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert len(ids) == len(set(ids)) and len({s.split("/")[0] for s in ids}) == 5


def test_a_tree_of_another_corpus_is_refused(lattice_tree: Path, tmp_path: Path, capsys) -> None:
    code = main(["data", "lattice-traces", "--config", str(ROOT / "configs/data/lattice_traces.yaml"),
                 f"tree={lattice_tree}", f"out={tmp_path / 'x.jsonl'}", "corpus.kind=squad",
                 f"corpus.path={ROOT / 'data/squad/dev-v2.0-articles.json'}", "scorer=oracle", "tracking.backend=none"])
    assert code == 2 and "has evidence in the tree's leaves" in capsys.readouterr().err


def _stand_in_scorer(answer) -> FastAPI:
    """Stand-in for a scorer server that lists its model and answers every slate with ``answer()``: a real server
    cannot be made to time out or refuse on purpose, and those failure paths are what is under test."""
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "scorer", "object": "model", "root": "model-x"}]}

    @app.post("/v1/chat/completions")
    async def chat() -> JSONResponse:
        return await answer()

    return app


class Unanswered:
    """A slate answer that never comes while the job runs: it waits until ``released``, set once the job has given
    up, so no reply can race the client's timeout, and the server stops at once afterwards (uvicorn lets a request
    in flight finish before it exits: a long fixed sleep would hold the test that long)."""

    def __init__(self) -> None:
        self.released = threading.Event()

    async def __call__(self) -> JSONResponse:
        while not self.released.is_set():
            await asyncio.sleep(0.05)
        return JSONResponse({})


async def _refuse() -> JSONResponse:
    return JSONResponse(status_code=400, content={"error": {"message": "unknown role", "code": 400}})


def _llm_run(tree: Path, out: Path, url: str) -> int:
    return main(["data", "lattice-traces", "--config", str(ROOT / "configs/data/lattice_traces.yaml"), f"tree={tree}",
                 f"out={out}", *CORPUS, "scorer=llm", f"server_url={url}", "limit=1", "search.iterations=4",
                 "request_timeout_s=0.2", "max_attempts=1", "tracking.backend=none"])


@pytest.mark.usefixtures("quick_retries")
def test_a_timed_out_slate_fails_its_question_for_a_rerun(lattice_tree: Path, tmp_path: Path, capsys) -> None:
    """A server that never answers a slate: with ``request_timeout_s=0.2`` each request times out, the question is
    not logged as done but listed as failed (a rerun searches it again), and the job exits 1 naming the count."""
    out = tmp_path / "traces.jsonl"
    never = Unanswered()
    with serve_in_background(_stand_in_scorer(never)) as url:
        try:
            assert _llm_run(lattice_tree, out, url) == 1
        finally:
            never.released.set()
    assert "lattice-traces: 1 of 1 items failed" in capsys.readouterr().err
    assert not list(read_jsonl(out)) and not list(read_jsonl(tmp_path / "traces.queries.jsonl"))
    (failure,) = read_jsonl(tmp_path / "traces.failures.jsonl")
    assert "lost to a request failure" in failure["error"] and "ReadTimeout" in failure["error"]
    assert json.loads((tmp_path / "traces.settings.json").read_text())["served"] == {"scorer": "model-x"}


def test_a_refused_slate_stops_the_job(lattice_tree: Path, tmp_path: Path, capsys) -> None:
    with serve_in_background(_stand_in_scorer(_refuse)) as url:
        assert _llm_run(lattice_tree, tmp_path / "traces.jsonl", url) == 1
    assert "request failed: LATTICE's slate scorer (role 'scorer'): the server refused" in capsys.readouterr().err
    assert not (tmp_path / "traces.queries.jsonl").read_text()


def test_a_killed_question_is_searched_again_from_scratch(lattice_tree: Path, tmp_path: Path) -> None:
    """A run killed between a question's slates and its summary: the rerun drops those slates and searches it again,
    so the file holds one search's slates per question."""
    out = tmp_path / "traces.jsonl"
    assert _run(lattice_tree, out, "limit=2") == 0
    queries = tmp_path / "traces.queries.jsonl"
    first, second = queries.read_text().splitlines()
    queries.write_text(first + "\n")  # the second question's summary never written
    # The questions are searched concurrently: the last slate may be either one's, so copy the unlogged one's.
    killed = [s for s in read_jsonl(out) if s["query_id"] == json.loads(second)["id"]][-1]
    orphan = {**killed, "id": "stale-slate-of-an-earlier-search"}
    with out.open("a") as fh:
        fh.write(json.dumps(orphan) + "\n")
    assert _run(lattice_tree, out, "limit=2") == 0
    slates = list(read_jsonl(out))
    assert "stale-slate-of-an-earlier-search" not in {s["id"] for s in slates}
    assert len(slates) == len({s["id"] for s in slates}) and len({s["query_id"] for s in slates}) == 2
    assert [q["id"] for q in read_jsonl(queries)] == [json.loads(first)["id"], json.loads(second)["id"]]


def test_a_rerun_with_other_settings_is_refused(lattice_tree: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "traces.jsonl"
    assert _run(lattice_tree, out, "limit=1") == 0
    assert _run(lattice_tree, out, "limit=2", "search.beam=3") == 2
    assert "search.beam differ" in capsys.readouterr().err


def test_a_non_positive_request_timeout_names_the_key(lattice_tree: Path, tmp_path: Path, capsys) -> None:
    assert _run(lattice_tree, tmp_path / "x.jsonl", "request_timeout_s=0") == 2
    assert "request_timeout_s" in capsys.readouterr().err


@pytest.mark.slow
def test_the_totals_add_up_truncated_replies_and_prompts_too_long(lattice_tree: Path, tmp_path: Path, capsys) -> None:
    """The real SmolLM2 as the teacher, served with a 700-token context and replying in at most 24 tokens: slates of
    long paragraphs do not fit and are not sent, the others' replies are cut inside their JSON. The job's totals and
    its printed line add up each question's failed slates and both causes, as its per-question records count them."""
    config = load_config(LatticeTracesConfig, ROOT / "configs/data/lattice_traces.yaml", [
        f"tree={lattice_tree}", f"out={tmp_path / 'traces.jsonl'}", *CORPUS, "scorer=llm", "limit=2",
        "search.iterations=4", "max_attempts=1", "max_tokens=24", "tracking.backend=none",
        "serve.roles.scorer.model=builtin:smollm2-135m-instruct", "serve.roles.scorer.max_model_len=700"])
    totals = run(config)
    queries = list(read_jsonl(tmp_path / "traces.queries.jsonl"))
    assert len(queries) == totals["questions"] == 2
    assert totals["failed_slates"] == sum(q["failed_slates"] for q in queries)
    for key in ("prompt_too_long_failed", "reply_truncated"):
        assert totals[key] == sum(q["problems"].get(key, 0) for q in queries) > 0, key
    assert totals["prompt_too_long_failed"] + totals["reply_truncated"] <= totals["slates"]
    printed = capsys.readouterr().out
    assert (f"{totals['failed_slates']} failed slates ({totals['prompt_too_long_failed']} prompt too long, not sent), "
            f"{totals['reply_truncated']} replies cut at max_tokens") in printed
