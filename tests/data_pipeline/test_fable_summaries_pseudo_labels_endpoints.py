"""FABLE forests, summaries, pseudo-labels, LATTICE trees and Orion tags with ``runner: ray``, ``ray.endpoints`` and
no ``server_url``: the job's own client (what it asks which models serve it) is the first endpoint
(``fanout.job_server``), not a stack of its own started beside the fleet, and it sends the key the Ray workers send
(``ray.api_key_env``'s). No Ray session and no model: the job stops at its client, which records the URL and options
it was asked for; tests/data_pipeline/test_fanout_ray.py runs these jobs on a real Ray cluster and fleet."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from overstory.core.config import load_config
from overstory.data_pipeline import fable_forest, lattice_tree, orion_tags, pseudo_labels, summaries
from overstory.data_pipeline.ray_runner import EndpointWorker, RayConfig

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


def _lattice_tree(tmp_path: Path, *overrides: str) -> lattice_tree.LatticeTreeConfig:
    return load_config(lattice_tree.LatticeTreeConfig, ROOT / "configs/data/lattice_tree.yaml", [
        f"corpus.path={ROOT / 'data/hotpotqa'}", "limit_leaves=2", f"out={tmp_path / 'tree'}", *overrides])


def _orion_tags(tmp_path: Path, *overrides: str) -> orion_tags.OrionTagsConfig:
    return load_config(orion_tags.OrionTagsConfig, ROOT / "configs/data/orion_tags.yaml", [
        "corpus.kind=text", f"corpus.path={ROOT / 'data/markdown'}", f"out={tmp_path / 'tags'}", *overrides])


@pytest.mark.parametrize(("job", "make_config"), [(summaries, _summaries), (pseudo_labels, _pseudo_labels),
                                                  (fable_forest, _fable_forest), (lattice_tree, _lattice_tree),
                                                  (orion_tags, _orion_tags)],
                         ids=["summaries", "pseudo_labels", "fable_forest", "lattice_tree", "orion_tags"])
def test_on_ray_with_endpoints_the_jobs_client_is_the_first_endpoint(
        job: ModuleType, make_config: Callable[..., object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[object, dict]] = []

    def client_for(serve, server_url="", **http_options):
        asked.append((server_url, http_options))
        raise ReachedClient

    monkeypatch.setattr(job, "client_for", client_for)
    monkeypatch.setenv("FLEET_KEY", "s3cret")
    endpoints = f"ray.endpoints=[{', '.join(ENDPOINTS)}]"
    own = "http://127.0.0.1:9/own"
    cases = [(("runner=ray", endpoints, "ray.api_key_env=FLEET_KEY"), ENDPOINTS[0], "s3cret"),
             (("runner=ray", endpoints, "ray.api_key_env=NO_SUCH_KEY"), ENDPOINTS[0], None),  # as the workers: none
             # a server_url still comes first; it, and the stack the thread runner starts, get client_for's key
             (("runner=ray", endpoints, f"server_url={own}", "ray.api_key_env=FLEET_KEY"), own, "(unset)"),
             (("runner=threads", endpoints, "ray.api_key_env=FLEET_KEY"), "", "(unset)")]
    for run, (overrides, expected, key) in enumerate(cases):
        folder = tmp_path / str(run)
        folder.mkdir()
        with pytest.raises(ReachedClient):
            job.run(make_config(folder, "tracking.backend=none", *overrides))
        assert asked[-1][0] == expected and asked[-1][1].get("api_key", "(unset)") == key


def test_the_workers_pool_clients_send_the_jobs_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray worker rebuilds a teacher's own-server client with the key it sends the endpoints (ray.api_key_env's).
    The worker is built here without Ray (no request is made: its clients' headers are what is checked)."""
    monkeypatch.setenv("FLEET_KEY", "s3cret")
    options = RayConfig(api_key_env="FLEET_KEY").http_options({"timeout_s": 5})
    worker = EndpointWorker(lambda client, pool: str, ENDPOINTS, options, {"own": "http://127.0.0.1:9/own"})
    for client in (*worker.clients, worker.pool["own"]):
        assert client.backend._http.headers["authorization"] == "Bearer s3cret"


def test_pseudo_labels_with_the_compressor_on_the_endpoints_is_not_refused(tmp_path: Path) -> None:
    """``upper: compressor`` needs a compressor somewhere: in serve.roles, at server_url, or on the fleet."""
    config = _pseudo_labels(tmp_path, "upper=compressor", "runner=ray", f"ray.endpoints=[{ENDPOINTS[0]}]")
    assert config.upper == "compressor" and "compressor" not in config.serve.roles
