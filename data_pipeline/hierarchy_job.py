"""`overstory data hierarchy`: build the chunk hierarchies of a corpus and report per-level statistics.

    overstory data hierarchy --config configs/data/hierarchy.yaml

Writes one JSONL of chunks (``Chunk`` records, smallest level first, the document node last). The
job appends document by document and skips documents already complete in the file, so a killed run
resumes where it stopped. The hierarchy settings are kept beside the output (``<out>.settings.json``, the data
jobs' settings record in ``data_pipeline/fanout.py``); resuming with different settings is a config error rather
than a file mixing two chunkings.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from overstory.core.config import ConfigError, to_dict
from overstory.core.progress import track
from overstory.core.records import LEVEL_RANK, LEVELS, Chunk, JsonlAppender, read_jsonl, write_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.fanout import SettingsRecord, settings_path
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchy, cached_tokenizer, load_hierarchies


@dataclass(frozen=True)
class HierarchyJobConfig:
    """`overstory data hierarchy`: which corpus, how to chunk it, and the JSONL to write."""

    corpus: CorpusConfig
    out: str
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if not self.out:
            raise ConfigError("out must name the JSONL file to write, e.g. runs/hierarchy/squad.jsonl")


def level_stats(chunks: Sequence[Chunk]) -> dict[str, dict[str, float]]:
    """Per level: chunk count and token statistics (mean, median, max)."""
    stats = {}
    for level in LEVELS:
        tokens = [c.n_tokens for c in chunks if c.level == level]
        if tokens:
            stats[level] = {"count": len(tokens), "mean_tokens": round(statistics.fmean(tokens), 1),
                            "median_tokens": statistics.median(tokens), "max_tokens": max(tokens)}
    return stats


def print_level_stats(stats: dict[str, dict[str, float]], title: str) -> None:
    """The per-level statistics as a rich table on the console."""
    table = Table(title=title)
    for column in ("level", "chunks", "mean tokens", "median tokens", "max tokens"):
        table.add_column(column, justify="right" if column != "level" else "left")
    for level, row in stats.items():
        table.add_row(level, str(row["count"]), f"{row['mean_tokens']:.1f}", f"{row['median_tokens']:g}",
                      str(row["max_tokens"]))
    Console().print(table)


def _complete_documents(path: Path) -> set[str]:
    """Ids of documents fully written to ``path``; the chunks of a document cut off by a killed run
    are removed so that it is rebuilt whole."""
    if not path.exists():
        return set()
    records = list(read_jsonl(path))
    complete = {r["doc_id"] for r in records if r["level"] == "document"}
    if any(r["doc_id"] not in complete for r in records):
        write_jsonl(path, [r for r in records if r["doc_id"] in complete])
    return complete


def _check_settings(out: Path, config: HierarchyJobConfig) -> None:
    """Record the hierarchy settings beside ``out``, or check them against those already recorded."""
    SettingsRecord(out, {"corpus_kind": config.corpus.kind, "hierarchy": to_dict(config.hierarchy)},
                   settings_path(out))


def run(config: HierarchyJobConfig) -> dict:
    """Build and write the hierarchies of the configured corpus; returns ``level_stats`` of its chunks."""
    documents, _ = load_corpus(config.corpus)
    tokenizer = cached_tokenizer(config.hierarchy.tokenizer)
    out = Path(config.out)
    _check_settings(out, config)
    with start_run(config.tracking, "data hierarchy", config) as tracker:
        done = _complete_documents(out)
        todo = [d for d in documents if d.id not in done]
        if len(todo) < len(documents):
            print(f"resuming: {len(documents) - len(todo)} of {len(documents)} documents already in {out}")
        with JsonlAppender(out) as writer:
            for doc in track(todo, description="building hierarchies"):
                # smallest level first, the document node last: its presence marks the document complete
                for chunk in sorted(build_hierarchy(doc, tokenizer, config.hierarchy),
                                    key=lambda c: LEVEL_RANK[c.level]):
                    writer.write(chunk)
        wanted = {d.id for d in documents}
        chunks = [c for c in load_hierarchies(out) if c.doc_id in wanted]
        stats = level_stats(chunks)
        print_level_stats(stats, f"{config.corpus.kind}: {len(documents)} documents -> {out}")
        tracker.summary({f"{level}/{key}": value for level, row in stats.items() for key, value in row.items()})
    return stats
