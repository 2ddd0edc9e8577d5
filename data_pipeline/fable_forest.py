"""`overstory data fable-forest`: build FABLE's forest (one LLM-built tree per document) over a corpus.

    overstory data fable-forest --config configs/data/fable_forest.yaml

Every document of the corpus is chunked by the ``generator`` into semantic leaves, organised into a tree of depth
at most ``forest.depth`` (sections from the document's headings where it has them, else grouped by the model),
summarised bottom-up and embedded by the ``embedder`` (``retrieval.fable.ForestBuilder``; the module docstring of
``retrieval/fable.py`` gives the details). Each finished document's tree is appended to ``<out>/trees.jsonl``, so a
killed run resumes: finished documents are skipped (to rebuild one, delete its line); the settings that shape a tree
are kept in ``<out>/settings.json``, and resuming with others is refused, naming the keys. Replies that had to fall back
are kept with their raw text in ``<out>/failures.jsonl``. At the end the job writes ``<out>/forest.json`` (every
document of the corpus, in corpus order; ``FableStrategy.load`` reads it) and ``<out>/build.json``: nodes by kind,
fallbacks, and what this run spent (LLM calls, prompt and completion tokens from the servers' usage, embedding
requests, seconds). A resumed run counts only what it did itself.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.progress import Progress

from overstory.core.config import ConfigError, to_dict
from overstory.core.records import JsonlAppender, read_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.fanout import SettingsRecord
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.retrieval.fable.builder import ForestBuilder, ForestConfig
from overstory.retrieval.fable.forest import Forest
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig
from overstory.serving.launch import client_for


@dataclass(frozen=True)
class FableForestConfig:
    corpus: CorpusConfig
    out: str  # trees.jsonl, failures.jsonl, forest.json and build.json go here
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)  # sentences, token counts, headings' sections
    forest: ForestConfig = field(default_factory=ForestConfig)
    concurrency: int = 2  # documents built at once (their calls are independent requests)
    server_url: str = ""  # empty: start the stack in `serve` for the run
    request_timeout_s: float = 600.0  # per request: a first structured-output call compiles its grammar
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if not self.out:
            raise ConfigError("out: name a folder for the forest, e.g. out=runs/fable/hotpotqa")
        if self.concurrency < 1:
            raise ConfigError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be positive, got {self.request_timeout_s}")


def run(config: FableForestConfig) -> dict:
    with ExitStack() as stack:
        tracker = stack.enter_context(start_run(config.tracking, "data fable-forest", config))
        client = stack.enter_context(client_for(config.serve, config.server_url, timeout_s=config.request_timeout_s))
        report = build_forest(config, client)
        tracker.summary({"documents": report["documents"], "built": report["built"],
                         "llm_calls": report["cost"]["llm_calls"], "seconds": report["cost"]["seconds"]})
    nodes = ", ".join(f"{n} {kind}" for kind, n in report["nodes"].items())
    print(f"fable forest: {report['documents']} documents ({report['built']} built, {report['skipped_done']} done "
          f"before), {nodes}; {report['cost']['llm_calls']} LLM calls, {report['cost']['seconds']} s "
          f"-> {Path(config.out) / 'forest.json'}")
    return report


def build_forest(config: FableForestConfig, client: Client) -> dict:
    """Build the trees the out folder lacks through ``client``, then write forest.json and build.json; returns
    the report (build.json's content)."""
    started = time.perf_counter()
    documents = load_corpus(config.corpus)[0]
    if not documents:
        raise ConfigError(f"corpus {config.corpus.path!r} has no documents")
    out = Path(config.out)
    trees_path = out / "trees.jsonl"
    _check_settings(out, config)
    totals: Counter = Counter()
    with JsonlAppender(trees_path) as trees, JsonlAppender(out / "failures.jsonl") as failures:
        todo = [d for d in documents if d.id not in trees]
        chunks: dict[str, list] = {d.id: [] for d in todo}
        for chunk in build_hierarchies(todo, config.hierarchy):
            chunks[chunk.doc_id].append(chunk)
        builder = ForestBuilder(client, config.forest)
        with Progress() as progress, ThreadPoolExecutor(max_workers=config.concurrency) as pool:
            task = progress.add_task("document trees", total=len(todo))
            for future in as_completed([pool.submit(builder.build, d, chunks[d.id]) for d in todo]):
                tree = future.result()
                trees.write(tree.record())
                for failure in tree.failures:
                    failures.write(failure)
                totals.update(tree.stats)
                progress.advance(task)
    records = {r["id"]: r for r in read_jsonl(trees_path)}
    forest = Forest.from_records([records[d.id] for d in documents],
                                 {"corpus": asdict(config.corpus), "forest": asdict(config.forest)})
    forest.save(out / "forest.json")
    report = _report(forest, len(documents) - len(todo), len(todo), totals, client, time.perf_counter() - started)
    (out / "build.json").write_text(json.dumps(report, indent=2))
    return report


def _check_settings(out: Path, config: FableForestConfig) -> None:
    """Record what shapes a tree (the corpus kind, the sentence hierarchy, the forest settings) beside the trees, or
    refuse to add trees built another way to those already there. The corpus's path and size may change: a run over
    more documents of the same corpus adds their trees."""
    settings = {"corpus_kind": config.corpus.kind, "hierarchy": to_dict(config.hierarchy),
                "forest": to_dict(config.forest)}
    SettingsRecord(out / "trees.jsonl", settings, out / "settings.json")


def _report(forest: Forest, skipped: int, built: int, totals: Counter, client: Client, seconds: float) -> dict:
    """What the forest holds, and what this run did and spent."""
    usage = client.stats.summary()
    generator, embedder = usage.get("generator", {}), usage.get("embedder", {})
    return {
        "documents": len(forest.documents), "built": built, "skipped_done": skipped,
        "nodes": dict(Counter(n.kind for n in forest.nodes.values())),
        "max_depth": max(n.depth for n in forest.nodes.values()),
        "seeded_documents": totals["seeded"],
        "fallbacks": {what: totals[f"{what}_fallbacks"] for what in ("chunk", "group", "summary")},
        "repairs": {f"{what}_{repair}": totals[f"{what}_{repair}"] for what in ("chunk", "group")
                    for repair in ("ids_dropped", "runs_split", "runs_merged")}
        | {"group_runs_rebalanced": totals["group_runs_rebalanced"]},
        "cost": {"llm_calls": generator.get("requests", 0), "request_failures": totals["request_failures"],
                 "prompt_tokens": generator.get("prompt_tokens", 0),
                 "completion_tokens": generator.get("completion_tokens", 0),
                 "embedding_requests": embedder.get("requests", 0), "seconds": round(seconds, 2)},
    }
