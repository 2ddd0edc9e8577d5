"""FABLE forests, summaries and pseudo-labels with ``runner: ray``, ``ray.endpoints`` and no ``server_url``: the job's
own client (what it asks which models serve it) is the first endpoint (``fanout.job_server``), not a stack of its own
started beside the fleet. No Ray session and no model: the job stops at its client, which records the URL it was
asked for; tests/data_pipeline/test_fanout_ray.py runs summaries this way on a real Ray cluster and fleet."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from overstory.core.config import load_config
from overstory.data_pipeline import fable_forest, pseudo_labels, summaries

ROOT = Path(__file__).resolve().parents[2]
ENDPOINTS = ["http://127.0.0.1:9/first", "http://127.0.0.1:9/second"]  # never called: the job stops before
CORPUS = [{"id": "a", "title": "Rivers", "text": "The Nile is the longest river.\n\nIt runs through Egypt."}]


class ReachedClient(Exception):
    """Raised where the job would make its client."""


def _summaries(tmp_path: Path, *overrides: str) -> summaries.SummariesConfig:
    return load_config(summaries.SummariesConfig, ROOT / "configs/data/summaries.yaml", [
        "corpus.kind=text", f"corpus.path={ROOT / 'data/markdown'}", "levels=[section]", "limit=1",
        f"out={tmp_path / 'summaries.jsonl'}", *overrides])


def _pseudo_labels(tmp_path: Path, *overrides: str) -> pseudo_labels.PseudoLabelsConfig:
    return load_config(pseudo_labels.PseudoLabelsConfig, ROOT / "configs/data/pseudo_labels.yaml", [
        "limit=1", f"out={tmp_path / 'labels.jsonl'}", *overrides])


def _fable_forest(tmp_path: Path, *overrides: str) -> fable_forest.FableForestConfig:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(record) + "\n" for record in CORPUS))
    return load_config(fable_forest.FableForestConfig, ROOT / "configs/data/fable_forest.yaml", [
        "corpus.kind=jsonl", f"corpus.path={corpus}", f"out={tmp_path / 'forest'}", *overrides])


@pytest.mark.parametrize(("job", "make_config"), [(summaries, _summaries), (pseudo_labels, _pseudo_labels),
                                                  (fable_forest, _fable_forest)],
                         ids=["summaries", "pseudo_labels", "fable_forest"])
def test_on_ray_with_endpoints_the_jobs_client_is_the_first_endpoint(
        job: ModuleType, make_config: Callable[..., object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[object] = []

    def client_for(serve, server_url="", **http_options):
        asked.append(server_url)
        raise ReachedClient

    monkeypatch.setattr(job, "client_for", client_for)
    endpoints = f"ray.endpoints=[{', '.join(ENDPOINTS)}]"
    own = "http://127.0.0.1:9/own"
    cases = [(("runner=ray", endpoints), ENDPOINTS[0]),
             (("runner=ray", endpoints, f"server_url={own}"), own),  # a server_url still comes first
             (("runner=threads", endpoints), "")]  # the thread runner starts the job's stack
    for run, (overrides, expected) in enumerate(cases):
        folder = tmp_path / str(run)
        folder.mkdir()
        with pytest.raises(ReachedClient):
            job.run(make_config(folder, "tracking.backend=none", *overrides))
        assert asked[-1] == expected


def test_pseudo_labels_with_the_compressor_on_the_endpoints_is_not_refused(tmp_path: Path) -> None:
    """``upper: compressor`` needs a compressor somewhere: in serve.roles, at server_url, or on the fleet."""
    config = _pseudo_labels(tmp_path, "upper=compressor", "runner=ray", f"ray.endpoints=[{ENDPOINTS[0]}]")
    assert config.upper == "compressor" and "compressor" not in config.serve.roles
