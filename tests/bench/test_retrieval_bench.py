"""`overstory bench retrieval` (overstory/retrieval_bench.py) on a naive retriever saved over ten HotpotQA documents
(MiniLM the only served role), behind an API key: served in this process as `overstory serve --retriever` serves it,
a few dozen requests answer well-formed, each malformed case with its expected status, and metrics.json, load.png and
the memory by quarter are written; against a URL with the wrong key, every valid request fails, the files are still
written (memory: not sampled, no server_pids) and the job raises what `overstory` turns into exit code 1."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from overstory.bench.retrieval_load import RETRIEVAL_MALFORMED
from overstory.core.config import ConfigError
from overstory.core.failures import TooManyFailures
from overstory.core.tracking import TrackingConfig
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.models.registry import MINILM
from overstory.retrieval.api import Models, Retriever
from overstory.retrieval_bench import RetrievalBenchConfig, run, serve_here
from overstory.serving.config import RoleConfig, ServeConfig

ROOT = Path(__file__).resolve().parents[2]
KEY = "bench-retrieval-key"
EMBEDDER_ONLY = ServeConfig(port=0, roles={"embedder": RoleConfig(model=MINILM, kind="embedding")})


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A naive retriever over ten HotpotQA documents, built and saved through the Python API."""
    documents, _ = load_corpus(CorpusConfig("hotpotqa", str(ROOT / "data/hotpotqa"), limit_docs=10))
    folder = tmp_path_factory.mktemp("retriever") / "naive"
    with Models.builtin(EMBEDDER_ONLY) as models:
        settings = HierarchyConfig()
        Retriever.build("naive", documents, build_hierarchies(documents, settings), models, settings=settings).save(
            folder)
    return str(folder)


def bench_config(tmp_path: Path, **settings) -> RetrievalBenchConfig:
    return RetrievalBenchConfig(**{"serve": EMBEDDER_ONLY, "requests": 36, "concurrency": 4, "warm_up": 4,
                                   "questions": str(ROOT / "data/hotpotqa/questions.json"), "out": str(tmp_path),
                                   "tracking": TrackingConfig(backend="none"), **settings})


def test_a_saved_retriever_served_here_answers_a_bounded_load(saved: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERSTORY_API_KEY", KEY)  # the served routes check it, the load sends it
    metrics = run(bench_config(tmp_path, retriever=saved))
    assert metrics == json.loads((tmp_path / "metrics.json").read_text())
    assert (tmp_path / "load.png").stat().st_size > 0
    assert metrics["target"] == {"retriever": saved, "engine": "embedded", "strategy": "naive", "documents": 10}
    assert metrics["sent"] == metrics["requests"] == 36 and metrics["warm_up"] == {"sent": 4, "failed_valid": 0}
    assert metrics["failed_valid"] == metrics["malformed_not_4xx"] == metrics["malformed_bad_error_body"] == 0
    assert set(metrics["by_kind"]) == {"retrieve", "batch", "search_r1", "malformed"}
    assert all(row["ok"] == row["sent"] > 0 and row["p95_s"] >= row["p50_s"] > 0 for row in metrics["by_kind"].values())
    sent_cases = RETRIEVAL_MALFORMED[:metrics["by_kind"]["malformed"]["sent"]]
    assert metrics["malformed_statuses"] == {name: [expect] for name, expect, *_ in sent_cases}
    assert len(metrics["rss_quarters_mib"]) >= 1 and metrics["rss_first_quarter_mib"] > 0
    assert metrics["health"]["answered"] == metrics["health"]["probes"] >= 1


def test_a_url_answering_401s_fails_the_job_after_writing_its_metrics(saved: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERSTORY_API_KEY", KEY)
    with serve_here(bench_config(tmp_path, retriever=saved)) as here:
        monkeypatch.setenv("OVERSTORY_API_KEY", "another-key")  # what the load sends; the server checks KEY
        with pytest.raises(TooManyFailures, match="failed the load test") as failed:
            run(bench_config(tmp_path, retriever="", url=here.url, requests=12, warm_up=0))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    valid = sum(row["sent"] for kind, row in metrics["by_kind"].items() if kind != "malformed")
    assert failed.value.counts["failed_valid"] == metrics["failed_valid"] == valid > 0
    assert metrics["failures"][0]["status"] == 401
    assert metrics["rss_quarters_mib"] is None and metrics["memory"].startswith("not sampled")
    assert metrics["target"] == {"url": here.url}


def test_retriever_or_url_and_k_within_the_servers_limit() -> None:
    with pytest.raises(ConfigError, match="not both"):
        RetrievalBenchConfig(retriever="a", url="http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="not neither"):
        RetrievalBenchConfig(retriever="")
    with pytest.raises(ConfigError, match="past serve.retriever_max_k=100"):
        RetrievalBenchConfig(k=101)
    with pytest.raises(ConfigError, match="unknown request kind"):
        RetrievalBenchConfig(weights={"chat": 1.0})
    assert dataclasses.replace(RetrievalBenchConfig(), k=100).k == 100
