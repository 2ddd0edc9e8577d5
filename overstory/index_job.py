"""`overstory index build`: a saved retriever folder from a corpus, without writing Python.

    overstory index build --config configs/index/hotpotqa-naive.yaml
    overstory index build --config configs/index/hotpotqa-smartchunk.yaml

What ``Retriever.build(...).save(out)`` does in a program (docs/api.md), as a job: load the corpus
(``data_pipeline.corpora``), build its hierarchy (``data_pipeline.hierarchy``) document by document, reach the models
(``retrieval.api.Models``: ``server_url`` names a running stack; else ``serve``'s roles, loaded in this process for
the embedded engine, started in the background for ``engine: vllm``), build the strategy's index with its own config
section (``naive``, ``smartchunk``, ``lattice``, ``fable`` or ``orion``, the harness's sections), and save it to
``out``. ``overstory serve --retriever OUT`` serves the folder; ``overstory bench retrieval`` load-tests it.

Beside the saved versions, ``out/build.json`` records the build: documents, chunks per level, seconds, what the index
cost by role (calls, tokens, failed calls) and the embedder's model the manifest names. A folder that already holds
files is refused unless ``overwrite`` (the save then replaces it with a new version), so a rebuild never drops the
documents a served retriever added since.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from overstory.core.config import ConfigError, to_dict
from overstory.core.progress import track
from overstory.core.records import Chunk, Document
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchy, cached_tokenizer
from overstory.data_pipeline.hierarchy_job import level_stats
from overstory.evaluation.pipeline import DATASETS
from overstory.retrieval.answer import AnswerConfig
from overstory.retrieval.api import PERSISTENT, SECTIONS, Models, Retriever, check_lattice_tree
from overstory.retrieval.fable.strategy import FableConfig
from overstory.retrieval.lattice.strategy import LatticeStrategyConfig
from overstory.retrieval.naive import NaiveConfig
from overstory.retrieval.orion.strategy import OrionConfig
from overstory.retrieval.smartchunk import SmartChunkConfig
from overstory.serving.config import ServeConfig, resolve_api_key

SUMMARY = "build.json"  # the build's record, beside the saved versions in ``out``


@dataclass(frozen=True)
class IndexBuildConfig:
    """`overstory index build`: which corpus, how to split it, which strategy with which settings, which models, and
    the folder to save."""

    strategy: str = "naive"  # one of the strategies whose index persists: naive, smartchunk, lattice, fable, orion
    corpus: CorpusConfig = field(default_factory=lambda: DATASETS["hotpotqa"])
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)
    # each strategy's section, as `overstory eval pipeline` reads it; only the chosen strategy's is used, and the
    # others must stay at their defaults (a setting given for another strategy is refused, not ignored)
    naive: NaiveConfig = field(default_factory=NaiveConfig)
    smartchunk: SmartChunkConfig = field(default_factory=SmartChunkConfig)
    lattice: LatticeStrategyConfig = field(default_factory=LatticeStrategyConfig)
    fable: FableConfig = field(default_factory=FableConfig)
    orion: OrionConfig = field(default_factory=OrionConfig)
    # fable: a forest.json from `overstory data fable-forest` over the same corpus; empty: built here (LLM calls,
    # counted in the build's cost)
    fable_forest: str = ""
    answer: AnswerConfig = field(default_factory=AnswerConfig)  # how `answer` asks the generator (saved with it)
    server_url: str = ""  # a running stack (URL, role -> URL mapping or stack.json); empty: the serve section's roles
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    request_timeout_s: float = 600.0  # per request to a running stack (server_url)
    out: str = "runs/index/hotpotqa-naive"
    overwrite: bool = False  # save a new version over a folder that already holds files
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if self.strategy not in PERSISTENT:
            raise ConfigError(f"strategy: {self.strategy!r} has no index that saves; choose from "
                              f"{', '.join(PERSISTENT)}")
        if not self.out:
            raise ConfigError("out must name the folder to save the retriever in, e.g. runs/index/hotpotqa-naive")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if given := [name for name in PERSISTENT if name != self.strategy
                     and to_dict(getattr(self, name)) != to_dict(SECTIONS[name]())]:
            raise ConfigError(f"{', '.join(given)}: settings given for a strategy this build does not use "
                              f"(strategy={self.strategy}); remove them or set strategy")
        if self.strategy == "lattice":
            check_lattice_tree(self.lattice)
        if self.strategy == "orion" and not self.orion.tags:
            raise ConfigError("orion.tags: name the out folder of `overstory data orion-tags` over this corpus")
        if self.fable_forest and self.strategy != "fable":
            raise ConfigError(f"fable_forest: a FABLE forest, and strategy={self.strategy}")

    @property
    def section(self) -> Any:
        """The chosen strategy's config section."""
        return getattr(self, self.strategy)


def check_out(out: Path, overwrite: bool) -> None:
    """A ConfigError when ``out`` already holds files and ``overwrite`` is off: a rebuild would replace the saved
    retriever, with whatever documents were added to it since."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConfigError(f"out={out}: already holds files (a saved retriever?); set overwrite=true to save a new "
                          "version over it, or name another folder")


def open_models(config: IndexBuildConfig) -> Models:
    """The models the index calls: the running stack of ``server_url``; else ``serve``'s roles, loaded in this process
    (embedded engine, no socket) or started in the background (``engine: vllm``)."""
    if config.server_url:
        return Models.from_url(config.server_url, timeout_s=config.request_timeout_s,
                               api_key=resolve_api_key(config.serve.api_key))
    if config.serve.engine == "vllm":
        return Models.start(config.serve)
    return Models.builtin(config.serve)


def split_corpus(documents: Sequence[Document], settings: HierarchyConfig) -> list[Chunk]:
    """Every document's hierarchy (``build_hierarchies``), with a progress bar over the documents."""
    tokenizer = cached_tokenizer(settings.tokenizer)
    return [chunk for document in track(documents, description="splitting documents")
            for chunk in build_hierarchy(document, tokenizer, settings)]


def build_summary(config: IndexBuildConfig, retriever: Retriever, chunks: Sequence[Chunk], seconds: float) -> dict:
    """What ``build.json`` records: the corpus, the chunks per level, the time, the index cost by role and the
    embedder's model."""
    cost = retriever.index_cost
    return {"strategy": config.strategy, "out": config.out, "corpus": to_dict(config.corpus),
            "documents": len(retriever.doc_ids), "chunks": len(chunks),
            "chunks_by_level": {level: row["count"] for level, row in level_stats(chunks).items()},
            "embedding_model": retriever.models.served_model("embedder"),
            "seconds": round(seconds, 2), "index_seconds": cost.seconds,
            "index_cost": {"calls": cost.calls, "tokens": cost.tokens, "by_role": cost.roles},
            "settings": {"hierarchy": to_dict(config.hierarchy), config.strategy: to_dict(config.section)}}


def print_summary(summary: dict) -> None:
    """The build's cost by role as a table, and one line on what was saved where."""
    table = Table(title=f"{summary['strategy']} index of {summary['documents']} documents, {summary['chunks']} chunks "
                        f"({summary['seconds']} s; embedder {summary['embedding_model']})")
    for column in ("role", "calls", "prompt tokens", "completion tokens", "failed calls"):
        table.add_column(column, justify="right")
    for role, spent in summary["index_cost"]["by_role"].items():
        table.add_row(role, str(spent["calls"]), str(spent["prompt_tokens"]), str(spent["completion_tokens"]),
                      str(spent["failed_calls"]))
    console = Console(width=120)
    console.print(table)
    console.print(f"-> {summary['out']} (serve it: overstory serve --config configs/serve/local.yaml --retriever "
                  f"{summary['out']}); {Path(summary['out']) / SUMMARY}", highlight=False)


def run(config: IndexBuildConfig) -> dict:
    """Build the configured strategy's index over the corpus, save it to ``out``; returns the build summary."""
    out = Path(config.out)
    check_out(out, config.overwrite)
    started = time.perf_counter()
    documents, _ = load_corpus(config.corpus)
    if not documents:
        raise ConfigError(f"corpus {config.corpus.path}: no documents to index")
    chunks = split_corpus(documents, config.hierarchy)
    console = Console(stderr=True)
    with start_run(config.tracking, "index build", config) as tracker, open_models(config) as models:
        with console.status(f"building the {config.strategy} index over {len(chunks)} chunks"):
            retriever = Retriever.build(config.strategy, documents, chunks, models, config.section, config.answer,
                                        forest=config.fable_forest, settings=config.hierarchy)
        with console.status(f"saving to {out}"):
            retriever.save(out)
        summary = build_summary(config, retriever, chunks, time.perf_counter() - started)
        (out / SUMMARY).write_text(json.dumps(summary, indent=2))
        tracker.summary({key: value for key, value in summary.items() if isinstance(value, int | float | str)})
    print_summary(summary)
    return summary

