"""`overstory index build` (overstory/index_job.py) through the command line, on the shipped HotpotQA sample cut to 20
documents, with the built-in MiniLM as the only served role: the naive build calls no LLM, its folder loads through
the Python API and finds a document by its own words, and its build.json says what the build did and cost. Refused
before any model loads: a folder that already holds files (left as it was), a misspelt key (named with the closest
one), settings for a strategy the build does not use, LATTICE without a tree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from overstory import cli
from overstory.core.config import ConfigError, load_config
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.index_job import IndexBuildConfig, run
from overstory.models.registry import MINILM
from overstory.retrieval.api import Models, Retriever
from overstory.retrieval.index_manifest import current_version
from overstory.serving.config import RoleConfig, ServeConfig

ROOT = Path(__file__).resolve().parents[1]
NAIVE = ROOT / "configs/index/hotpotqa-naive.yaml"
DOCS = 20


def test_index_build_saves_a_naive_retriever_that_loads_and_retrieves(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "naive"
    monkeypatch.chdir(ROOT)  # the config's corpus path is relative to the repository, as a user runs it
    argv = ["index", "build", "--config", str(NAIVE), f"corpus.limit_docs={DOCS}", f"out={out}",
            "tracking.backend=none"]
    assert cli.main(argv) == 0
    summary = json.loads((out / "build.json").read_text())
    assert summary["strategy"] == "naive" and summary["documents"] == DOCS
    by_level = summary["chunks_by_level"]
    assert summary["chunks"] == sum(by_level.values()) and by_level["paragraph"] == by_level["document"] == DOCS
    assert summary["embedding_model"] == MINILM
    # only the embedder was served and called: the naive index costs no LLM call
    assert set(summary["index_cost"]["by_role"]) == {"embedder"}
    spent = summary["index_cost"]["by_role"]["embedder"]
    assert spent["calls"] >= 1 and spent["prompt_tokens"] > 0 and spent["failed_calls"] == 0
    assert summary["settings"]["naive"] == {"index": "hybrid", "levels": ["paragraph"], "k": 5}

    documents, _ = load_corpus(CorpusConfig("hotpotqa", str(ROOT / "data/hotpotqa"), limit_docs=DOCS))
    embedder_only = ServeConfig(port=0, roles={"embedder": RoleConfig(model=MINILM, kind="embedding")})
    with Models.builtin(embedder_only) as models:
        loaded = Retriever.load(out, models)
        assert loaded.strategy_name == "naive" and loaded.doc_ids == {d.id for d in documents}
        target = documents[7]
        found = loaded.retrieve(target.text.split(". ")[0], k=3)
    assert found.failure == "" and found.evidence[0].doc_id == target.id
    assert set(found.cost.roles) == {"embedder"}


def test_a_folder_that_holds_files_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "index"
    out.mkdir()
    (out / "notes.txt").write_text("kept")
    config = IndexBuildConfig(corpus=CorpusConfig("hotpotqa", str(ROOT / "data/hotpotqa")), out=str(out))
    with pytest.raises(ConfigError, match=f"out={out}: already holds files.*overwrite=true"):
        run(config)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and current_version(out) is None


@pytest.mark.parametrize(("overrides", "message"), [
    (["naive.kk=3"], "unknown config key 'naive.kk'; did you mean 'naive.k'?"),
    (["strategy=raptor"], "strategy: 'raptor' has no index that saves; choose from naive, smartchunk"),
    (["smartchunk.k=3"], "smartchunk: settings given for a strategy this build does not use"),
    (["strategy=lattice"], "lattice.tree: the lattice strategy needs a tree"),
    (["strategy=orion"], "orion.tags: name the out folder of `overstory data orion-tags`"),
])
def test_bad_settings_are_refused_naming_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(IndexBuildConfig, NAIVE, overrides)
