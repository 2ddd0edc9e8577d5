"""`overstory data lattice-traces`: every slate logged with what it needs for distillation, gold reached by the
oracle, resume after a kill (the LLM teacher's search has its own test in tests/retrieval/test_lattice_search.py).
The tree is the session's k-means tree over the first 150 HotpotQA paragraphs (``lattice_tree``, tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

from overstory.cli import main
from overstory.core.records import read_jsonl

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


def test_request_timeout_reaches_the_client(lattice_tree: Path, tmp_path: Path) -> None:
    """A server that accepts connections and never answers: with ``request_timeout_s=0.2`` each slate fails on
    the client's timeout (recorded with the reason), and the question is still logged, not lost."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        out = tmp_path / "traces.jsonl"
        assert main(["data", "lattice-traces", "--config", str(ROOT / "configs/data/lattice_traces.yaml"),
                     f"tree={lattice_tree}", f"out={out}", *CORPUS, "scorer=llm", f"server_url={url}", "limit=1",
                     "search.iterations=4", "request_timeout_s=0.2", "max_attempts=1", "tracking.backend=none"]) == 0
    (query,) = read_jsonl(tmp_path / "traces.queries.jsonl")
    assert query["failed_slates"] >= 1
    slates = list(read_jsonl(out))
    assert slates and all("ReadTimeout" in s["raw_reply"] and not s["parsed"] for s in slates)


def test_a_non_positive_request_timeout_names_the_key(lattice_tree: Path, tmp_path: Path, capsys) -> None:
    assert _run(lattice_tree, tmp_path / "x.jsonl", "request_timeout_s=0") == 2
    assert "request_timeout_s" in capsys.readouterr().err
