"""`overstory data fable-forest`: its config, and a killed run resuming with only the documents it lacks. The job
runs end to end (corpus, hierarchy, trees, forest.json, build.json) against a scripted stand-in server; the real
built-in models build a forest in tests/retrieval/test_fable.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.core.config import ConfigError, load_config
from overstory.core.failures import TooManyFailures
from overstory.core.records import read_jsonl
from overstory.data_pipeline.fable_forest import FALLBACKS_FILE, TREES_FILE, FableForestConfig, run
from overstory.data_pipeline.fanout import failures_path, settings_path
from overstory.retrieval.fable.builder import ForestConfig
from overstory.retrieval.fable.forest import Forest
from overstory.retrieval.fable.strategy import FableStrategy
from overstory.serving.client import Client, ClientError

ROOT = Path(__file__).resolve().parents[2]
YAML = ROOT / "configs/data/fable_forest.yaml"

PAPER = "Introduction\n\nWe study rivers. Rivers are long.\n\nMethods\n\nWe measured the Nile. It is long."
CORPUS = [
    {"id": "a", "title": "Rivers", "text": "The Nile is the longest river. It runs through Egypt."},
    {"id": "b", "title": "Cities", "text": "Paris is the capital of France. Paris has the Eiffel Tower."},
    {"id": "c", "title": "Paper", "text": PAPER, "metadata": {
        "headings": [[1, "Introduction", 0, 12], [1, "Methods", 49, 56]],
        "paragraph_spans": [[14, 47], [58, len(PAPER)]]}},
]
REPLIES = {"chunk_starts": '{"chunk_starts": [0]}', "node_summary": '{"title": "Topic", "summary": "About it."}',
           "selection": '{"ids": [0]}', "answer": "Nile"}


class StandIn:
    """Stands in for the served generator and embedder (the ``Backend`` of serving/client.py), so the job's resume can
    be checked request by request and a given reply made unusable on demand (a real tiny model cannot be told to), or
    fail every chat or embedding request that holds ``down_for[kind]``: a chat request gets the next scripted reply for
    its response_format's name, else a default; every request is kept; an embedding is two numbers from the text."""

    def __init__(self, **scripts: list[str]):
        self.scripts = {name: list(replies) for name, replies in scripts.items()}
        self.prompts: list[str] = []
        self.down_for = {"chat": "", "embed": ""}

    def post(self, path, payload):
        down_for = self.down_for["embed" if path == "/v1/embeddings" else "chat"]
        if down_for and down_for in json.dumps(payload):  # a request no retry gets through
            raise ClientError(503, "server busy")
        if path == "/v1/embeddings":
            data = [{"index": i, "embedding": [1.0, float(len(text) % 7)]} for i, text in enumerate(payload["input"])]
            return {"data": data, "usage": {"prompt_tokens": 0, "total_tokens": 0}}, 0
        name = (payload.get("response_format") or {}).get("json_schema", {}).get("name", "answer")
        self.prompts.append(payload["messages"][-1]["content"])
        reply = self.scripts[name].pop(0) if self.scripts.get(name) else REPLIES[name]
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}, 0

    def get(self, path):
        return [{}]

    def close(self):
        pass


def job_config(tmp_path: Path, *overrides: str) -> FableForestConfig:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(record) + "\n" for record in CORPUS))
    return load_config(FableForestConfig, YAML, ["corpus.kind=jsonl", f"corpus.path={corpus}",
                                                 f"out={tmp_path / 'out'}", "server_url=http://stand-in",
                                                 "tracking.backend=none", *overrides])


def test_the_config_file_loads_and_bad_values_name_the_key(tmp_path):
    config = load_config(FableForestConfig, YAML)
    assert config.forest == ForestConfig() and config.out == "runs/fable/hotpotqa" and config.corpus.kind == "hotpotqa"
    for override, key in [("concurrency=0", "concurrency"), ("forest.depth=1", "forest.depth"),
                          ("request_timeout_s=0", "request_timeout_s"),
                          ("forest.max_children=1", "forest.max_children")]:
        with pytest.raises(ConfigError, match=key):
            job_config(tmp_path, override)


def test_a_killed_run_resumes_with_only_the_missing_documents(tmp_path, monkeypatch, capsys):
    backend = StandIn(node_summary=["no json here"])  # the first document's summary falls back
    monkeypatch.setattr(Client, "from_url", lambda url, **options: Client(backend))
    out = tmp_path / "out"
    first = run(job_config(tmp_path, "corpus.limit_docs=2", "concurrency=1"))
    assert (first["documents"], first["built"], first["skipped_done"]) == (2, 2, 0)
    assert first["fallbacks"]["summary"] == 1 and first["cost"]["llm_calls"] == len(backend.prompts) == 4
    (fallback,) = read_jsonl(out / FALLBACKS_FILE)
    assert fallback["id"] == "a#root/summary" and fallback["raw"] == "no json here"
    # killed while writing the third document's line
    with (out / "trees.jsonl").open("a") as fh:
        fh.write('{"id": "c", "title": "Pap')
    backend.prompts.clear()
    second = run(job_config(tmp_path))
    assert (second["documents"], second["built"], second["skipped_done"]) == (3, 1, 2)
    assert not any(CORPUS[0]["text"] in p or CORPUS[1]["text"] in p for p in backend.prompts)  # only c was asked
    assert second["cost"]["llm_calls"] == len(backend.prompts) and second["seeded_documents"] == 1
    assert second["nodes"] == {"root": 3, "leaf": 4, "section": 2}  # c: Introduction and Methods, a leaf each
    assert [r["id"] for r in read_jsonl(out / "trees.jsonl")] == ["a", "b", "c"]
    assert json.loads((out / "build.json").read_text()) == second
    assert "3 documents (1 built, 2 done before, 0 failed" in capsys.readouterr().out
    forest = Forest.load(out / "forest.json")
    assert list(forest.documents) == ["a", "b", "c"] and forest.meta["forest"]["depth"] == 4
    titles = [forest.nodes[s].title for s in forest.nodes["c#root"].children]
    assert titles == ["Introduction", "Methods"]
    answer = FableStrategy.load(out / "forest.json").answer("Which river is the longest?", Client(StandIn()))
    assert answer.prediction == "Nile" and answer.evidence and answer.failure == ""
    # a finished forest: nothing left to ask
    backend.prompts.clear()
    assert run(job_config(tmp_path))["built"] == 0 and backend.prompts == []
    # more trees built another way would mix two forests: refused, naming the key
    with pytest.raises(ConfigError, match=r"forest\.min_chunk_tokens differ"):
        run(job_config(tmp_path, "forest.min_chunk_tokens=0"))
    assert json.loads(settings_path(out / TREES_FILE).read_text())["forest"]["min_chunk_tokens"] == 64


def test_a_document_whose_requests_failed_is_listed_and_built_by_the_rerun(tmp_path, monkeypatch):
    """Every chat request about the Nile fails (its chunking and its summary), then its embeddings: the document is
    not written, since its tree would hold fallbacks for replies that never came; the job fails past
    max_failure_share, and a rerun builds only that document."""
    backend = StandIn()
    backend.down_for["chat"] = "Nile"
    monkeypatch.setattr(Client, "from_url", lambda url, **options: Client(backend))
    out = tmp_path / "out"
    with pytest.raises(TooManyFailures, match="fable-forest: 1 of 2 items failed") as failed:
        run(job_config(tmp_path, "corpus.limit_docs=2", "concurrency=1"))
    assert failed.value.counts["built"] == 1
    (failure,) = read_jsonl(failures_path(out / TREES_FILE))
    assert failure["id"] == "a" and failure["error"] == "2 of 2 requests failed after the client's retries"
    assert "503: server busy" in failure["raw"] and not (out / FALLBACKS_FILE).read_text()
    assert [r["id"] for r in read_jsonl(out / TREES_FILE)] == ["b"]
    report = json.loads((out / "build.json").read_text())
    assert (report["documents"], report["failed"], report["cost"]["request_failures"]) == (1, 1, 2)
    # a request that raises (an embedding) fails the document the same way; allowed by max_failure_share
    backend.down_for = {"chat": "", "embed": "Nile"}
    report = run(job_config(tmp_path, "corpus.limit_docs=2", "max_failure_share=1"))
    assert (report["built"], report["failed"], report["skipped_done"]) == (0, 1, 1)
    assert "503: server busy" in next(read_jsonl(failures_path(out / TREES_FILE)))["error"]
    backend.down_for["embed"] = ""
    report = run(job_config(tmp_path, "corpus.limit_docs=2"))
    assert (report["documents"], report["built"], report["failed"]) == (2, 1, 0)
    assert not failures_path(out / TREES_FILE).read_text()
