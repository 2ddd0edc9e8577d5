"""A killed bottom-up or hybrid `overstory data lattice-tree` build resumes where it stopped: the node summaries it
recorded (``<out>/summaries.jsonl``) are reused and only the missing nodes are asked for, the finished tree equals an
uninterrupted build's, and a rerun with other settings or another served model is refused naming the key.

The summaries come from the real built-in model (SmolLM2-135M, temperature 0, one request at a time so that no
batching changes a reply). Two things a real model cannot be made to do are stood in for: the kill (the job's client
raises ``Killed`` on the chat request after a given number, as a process killed between two summaries would stop),
and another model being served (``tests/stand_ins.py``'s ``failing_server``, whose model list names ``model-x``; the
job is refused before it sends a chat request)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.core.records import read_jsonl
from overstory.data_pipeline import lattice_tree
from overstory.data_pipeline.fanout import settings_path
from overstory.retrieval.lattice.tree import Tree
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig
from overstory.serving.job_client import client_for as real_client_for
from overstory.serving.launch import serve_in_background
from tests.stand_ins import failing_server

# every test reads the builds of the real model (the module's fixtures: one server, one build per method), on one
# pytest-xdist worker so that they are made once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lattice_tree_resume")]
ROOT = Path(__file__).resolve().parents[2]
# two documents, four short paragraphs (short replies: seconds a summary): with M = 2, the bottom-up build summarises
# two or more groups; the hybrid keeps the first document's three paragraphs under it (a pair grouped under the
# document: two summaries) and the second document is its own paragraph
CORPUS = [{"id": "rivers", "title": "Rivers",
           "text": "The Nile is in Egypt.\n\nThe Rhine is in Germany.\n\nThe Amazon is in Brazil."},
          {"id": "volga", "title": "Volga", "text": "The Volga is in Russia."}]
METHODS = ("bottom-up", "hybrid")


class Killed(Exception):
    """Stands in for the job's process being killed before a chat request."""


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serve_in_background(ServeConfig.local(port=0)) as url:
        yield url


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "rivers.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in CORPUS))
    return path


def build(url: str, corpus: Path, out: Path, method: str, *extra: str) -> int:
    return main(["data", "lattice-tree", "--config", str(ROOT / "configs/data/lattice_tree.yaml"),
                 f"method={method}", "corpus.kind=jsonl", f"corpus.path={corpus}", "clustering.m_max=2",
                 "summaries.concurrency=1", f"out={out}", f"server_url={url}", "tracking.backend=none", *extra])


def placements(out: Path) -> dict:
    return json.loads((out / "build.json").read_text())["summaries"]["placements"]


@pytest.fixture(scope="module")
def whole(server: str, corpus: Path, tmp_path_factory) -> dict[str, Path]:
    """Each method's build, uninterrupted, in its own folder."""
    folders = {}
    for method in METHODS:
        folders[method] = tmp_path_factory.mktemp(method) / "tree"
        assert build(server, corpus, folders[method], method) == 0
    return folders


def counting_client_for(calls: list[int], kill_after: int | None = None):
    """``client_for`` whose client counts its chat requests in ``calls`` and raises ``Killed`` instead of sending
    the one after ``kill_after``."""

    @contextmanager
    def client_for(*args, **kwargs) -> Iterator[Client]:
        with real_client_for(*args, **kwargs) as client:
            chat = client.chat

            def counted(*chat_args, **chat_kwargs):
                if kill_after is not None and len(calls) >= kill_after:
                    raise Killed(f"killed after {kill_after} chat requests")
                calls.append(1)
                return chat(*chat_args, **chat_kwargs)

            client.chat = counted  # type: ignore[method-assign]
            yield client

    return client_for


def same_tree(a: Path, b: Path) -> bool:
    """The two saved trees have the same root and nodes (names, descriptions, children, leaves)."""
    first, second = Tree.load(a / "tree.json"), Tree.load(b / "tree.json")
    return first.root == second.root and first.nodes == second.nodes


@pytest.mark.parametrize("method", METHODS)
def test_a_killed_build_resumes_asking_only_for_the_missing_nodes(method, server, corpus, whole, tmp_path,
                                                                  monkeypatch, capsys) -> None:
    full = placements(whole[method])
    internal = sum(1 for n in Tree.load(whole[method] / "tree.json").nodes.values() if not n.leaf) - 1  # not the root
    assert full["summaries_asked"] == internal >= 2 and full.get("summaries_reused", 0) == 0
    recorded = list(read_jsonl(whole[method] / "summaries.jsonl"))
    assert len(recorded) == full.get("summaries_llm", 0) and all(r["reply"] and r["members"] for r in recorded)

    out, calls = tmp_path / "tree", []
    monkeypatch.setattr(lattice_tree, "client_for", counting_client_for(calls, kill_after=1))
    with pytest.raises(Killed):
        build(server, corpus, out, method)
    assert not (out / "tree.json").exists()
    kept = list(read_jsonl(out / "summaries.jsonl"))  # the one summary made before the kill
    assert len(kept) == 1 and kept[0]["id"] in {r["id"] for r in recorded}

    calls.clear()
    monkeypatch.setattr(lattice_tree, "client_for", counting_client_for(calls))
    assert build(server, corpus, out, method) == 0
    resumed = placements(out)
    assert resumed["summaries_reused"] == 1 and resumed["summaries_asked"] == internal - 1
    assert len(calls) == json.loads((out / "build.json").read_text())["summaries"]["llm_calls"] >= internal - 1
    assert f"node summaries: 1 reused from {out / 'summaries.jsonl'}, {internal - 1} asked for" in \
        capsys.readouterr().out
    assert same_tree(out, whole[method])

    calls.clear()  # a rerun of the finished build asks for nothing
    assert build(server, corpus, out, method) == 0
    assert not calls and placements(out).get("summaries_asked", 0) == 0
    assert placements(out)["summaries_reused"] == internal and same_tree(out, whole[method])


@pytest.mark.parametrize(("override", "key"), [("summaries.max_member_chars=200", "summaries.max_member_chars"),
                                               ("clustering.seed=1", "clustering.seed"),
                                               ("leaf_level=sentence", "leaf_level"),
                                               ("hierarchy.subsection_tokens=128", "hierarchy.subsection_tokens")])
def test_a_rerun_with_other_settings_is_refused_naming_the_key(override, key, server, corpus, whole, tmp_path,
                                                               capsys) -> None:
    out = tmp_path / "tree"
    shutil.copytree(whole["hybrid"], out)
    before = (out / "summaries.jsonl").read_bytes()
    assert build(server, corpus, out, "hybrid", override) == 2
    error = capsys.readouterr().err
    assert error.startswith("config error: ") and f"({key} differ from {settings_path(out / 'summaries.jsonl')})" \
        in error
    assert (out / "summaries.jsonl").read_bytes() == before  # nothing lost or appended


def test_a_rerun_under_another_method_is_refused(server, corpus, whole, tmp_path, capsys) -> None:
    out = tmp_path / "tree"
    shutil.copytree(whole["bottom-up"], out)
    assert build(server, corpus, out, "hybrid") == 2
    assert "(method differ from" in capsys.readouterr().err


def test_a_rerun_against_another_served_model_is_refused(corpus, whole, tmp_path, capsys) -> None:
    out = tmp_path / "tree"
    shutil.copytree(whole["bottom-up"], out)
    with serve_in_background(failing_server(503, "unused: the job stops before asking")) as url:
        assert build(url, corpus, out, "bottom-up") == 2
    error = capsys.readouterr().err
    assert "served.embedder, served.generator differ from" in error
    assert json.loads(settings_path(out / "summaries.jsonl").read_text())["served"]["generator"] == \
        "builtin:smollm2-135m-instruct"  # the record still names the model that made the summaries


def test_the_record_keeps_the_settings_that_decide_a_summary(whole) -> None:
    """Of clustering, the M and seed; not limit_leaves nor summaries.concurrency, which decide no summary (the
    summaries are keyed by their groups), so a rerun over more leaves or on more threads is not refused."""
    recorded = json.loads(settings_path(whole["bottom-up"] / "summaries.jsonl").read_text())
    assert "limit_leaves" not in recorded and "concurrency" not in recorded["summaries"]
    assert recorded["clustering"] == {"m_max": 2, "seed": 0} and recorded["method"] == "bottom-up"
