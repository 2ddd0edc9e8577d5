"""`overstory data fable-forest`: build FABLE's forest (one LLM-built tree per document) over a corpus.

    overstory data fable-forest --config configs/data/fable_forest.yaml

Every document of the corpus is chunked by the ``generator`` into semantic leaves, organised into a tree of depth
at most ``forest.depth`` (sections from the document's headings where it has them, else grouped by the model),
summarised bottom-up and embedded by the ``embedder`` (``retrieval.fable.builder.ForestBuilder``; the module
docstring of ``retrieval/fable/builder.py`` gives the details). The job runs on the fan-out skeleton
(``data_pipeline/fanout.py``), a document an item: each finished document's tree is appended to
``<out>/trees.jsonl``, so a killed run resumes with only the documents it lacks (to rebuild one, delete its line);
the settings that shape a tree and the models that served it are kept in ``<out>/trees.settings.json``, and resuming
with others is refused, naming the keys. Replies that had to fall back are kept with their raw text in
``<out>/fallbacks.jsonl`` (counted in build.json). A document whose requests failed (after the client's retries) is
not written, since its tree would hold fallbacks for replies that never came: it goes to
``<out>/trees.failures.jsonl`` with the errors and a rerun builds it again; the job fails (exit code 1) when more
than ``max_failure_share`` of the documents it attempted failed. A request the server refuses (a 4xx other than 408
and 429: a wrong role, a bad request) fails no document: it stops the job at once with exit code 1, naming the role
and the server's reason (``RequestRefused``), since every document would fail alike; the trees built before stay.
At the end the job writes ``<out>/forest.json`` (every document with a tree, in corpus order; ``FableStrategy.load``
reads it) and ``<out>/build.json``: nodes by kind, fallbacks, failed documents, and what this run spent (LLM calls,
failed requests, prompt and completion tokens from the servers' usage, embedding requests, seconds). A resumed run
counts only what it did itself.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from overstory.core.config import ConfigError
from overstory.core.records import Document, FailureRecord, JsonlAppender, read_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.fanout import Fanout, ServedWork, job_server, job_settings
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.data_pipeline.ray_runner import RayConfig
from overstory.retrieval.fable.builder import DocumentTree, ForestBuilder, ForestConfig
from overstory.retrieval.fable.forest import Forest
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig
from overstory.serving.job_client import client_for, served_models

TREES_FILE, FALLBACKS_FILE = "trees.jsonl", "fallbacks.jsonl"


@dataclass(frozen=True)
class FableForestConfig:
    corpus: CorpusConfig
    out: str  # trees.jsonl (with its .settings.json and .failures.jsonl), fallbacks.jsonl, forest.json, build.json
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)  # sentences, token counts, headings' sections
    forest: ForestConfig = field(default_factory=ForestConfig)
    concurrency: int = 2  # documents built at once (their calls are independent requests)
    runner: Literal["threads", "ray"] = "threads"  # ray: Ray Data workers, requests spread over ray.endpoints
    ray: RayConfig = field(default_factory=RayConfig)
    max_failure_share: float = 0.0  # the job fails (exit 1) when more of its documents than this failed
    server_url: str = ""  # empty: the first of ray.endpoints on Ray, else start the stack in `serve` for the run
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
    """Build the trees the out folder lacks, then write forest.json and build.json (see the module docstring)."""
    out = Path(config.out)
    with ExitStack() as stack:
        tracker = stack.enter_context(start_run(config.tracking, "data fable-forest", config))
        fanout = stack.enter_context(Fanout("fable-forest", out / TREES_FILE, job_settings(config),
                                            concurrency=config.concurrency,
                                            max_failure_share=config.max_failure_share, runner=config.runner,
                                            ray=config.ray))
        report = build_forest(config, fanout, stack)
        tracker.summary({"documents": report["documents"], "built": report["built"], "failed": report["failed"],
                         "llm_calls": report["cost"]["llm_calls"], "seconds": report["cost"]["seconds"]})
    nodes = ", ".join(f"{n} {kind}" for kind, n in report["nodes"].items())
    print(f"fable forest: {report['documents']} documents ({report['built']} built, {report['skipped_done']} done "
          f"before, {report['failed']} failed: see {fanout.failures.path}), {nodes}; {report['cost']['llm_calls']} "
          f"LLM calls, {report['cost']['seconds']} s -> {out / 'forest.json'}")
    fanout.raise_if_failed()
    return report


def build_forest(config: FableForestConfig, fanout: Fanout, stack: ExitStack) -> dict:
    """Build the trees ``fanout``'s output lacks (through a client for ``server_url``, the first of ``ray.endpoints``
    on Ray, or a stack started for the run, held open by ``stack``), then write forest.json and build.json; returns
    the report (build.json's content)."""
    started = time.perf_counter()
    documents = load_corpus(config.corpus)[0]
    if not documents:
        raise ConfigError(f"corpus {config.corpus.path!r} has no documents")
    out = Path(config.out)
    todo = fanout.todo(documents, lambda d: d.id)
    totals: Counter = Counter()
    client = None
    if todo:
        # on Ray with endpoints and no server_url, the first endpoint: the fleet needs no stack of the job's own
        url, options = job_server(config.server_url, config.runner, config.ray)
        client = stack.enter_context(client_for(config.serve, url, timeout_s=config.request_timeout_s, **options))
        fanout.record_served(served_models(client, ["generator", "embedder"]))
        with JsonlAppender(out / FALLBACKS_FILE) as fallbacks:
            build_trees(todo, config, client, fanout, fallbacks, totals)
    counts = fanout.finish()
    records = {r["id"]: r for r in read_jsonl(out / TREES_FILE)}
    forest = Forest.from_records([records[d.id] for d in documents if d.id in records],
                                 {"corpus": asdict(config.corpus), "forest": asdict(config.forest)})
    forest.save(out / "forest.json")
    report = _report(forest, counts, totals, client, time.perf_counter() - started)
    (out / "build.json").write_text(json.dumps(report, indent=2))
    return report


def build_trees(todo: list[Document], config: FableForestConfig, client: Client, fanout: Fanout,
                fallbacks: JsonlAppender, totals: Counter) -> None:
    """Build the trees of ``todo`` on the fan-out's workers; each finished tree is appended (with its fallbacks kept
    in ``fallbacks`` and its counts added to ``totals``), each document whose requests failed is listed as failed."""
    chunks: dict[str, list] = {d.id: [] for d in todo}
    for chunk in build_hierarchies(todo, config.hierarchy):
        chunks[chunk.doc_id].append(chunk)

    def tree_builder(worker_client: Client) -> Callable[[Document], DocumentTree]:
        """Build one document's tree through ``worker_client`` (the job's, or a Ray worker's for its endpoint)."""
        builder = ForestBuilder(worker_client, config.forest)
        return lambda d: builder.build(d, chunks[d.id])

    def write(document: Document, tree: DocumentTree) -> None:
        if tree.stats["request_failures"]:
            fanout.fail(document.id, requests_failed(tree))
            return
        fanout.write(tree.record(), "built")
        for fallback in tree.failures:
            fallbacks.write(fallback)
        totals.update(tree.stats)

    fanout.run(todo, lambda d: d.id, ServedWork(tree_builder, client, {"timeout_s": config.request_timeout_s}), write,
               "document trees")


def requests_failed(tree: DocumentTree) -> FailureRecord:
    """The failure of a document some of whose requests failed: how many, and the raw text behind its fallbacks
    (the errors of the failed requests among them)."""
    calls = sum(n for key, n in tree.stats.items() if key.endswith("_calls"))
    return FailureRecord(tree.document.id, "fable-forest",
                         f"{tree.stats['request_failures']} of {calls} requests failed after the client's retries",
                         "\n".join(f"{f.id}: {f.raw}" for f in tree.failures), 1)


def _report(forest: Forest, counts: dict[str, int], totals: Counter, client: Client | None, seconds: float) -> dict:
    """What the forest holds, and what this run did and spent."""
    usage = client.stats.summary() if client is not None else {}
    generator, embedder = usage.get("generator", {}), usage.get("embedder", {})
    return {
        "documents": len(forest.documents), "built": counts.get("built", 0), "skipped_done": counts["skipped"],
        "failed": counts["failed"],
        "nodes": dict(Counter(n.kind for n in forest.nodes.values())),
        "max_depth": max((n.depth for n in forest.nodes.values()), default=0),
        "seeded_documents": totals["seeded"],
        "fallbacks": {what: totals[f"{what}_fallbacks"] for what in ("chunk", "group", "summary")},
        "repairs": {f"{what}_{repair}": totals[f"{what}_{repair}"] for what in ("chunk", "group")
                    for repair in ("ids_dropped", "runs_split", "runs_merged")}
        | {"group_runs_rebalanced": totals["group_runs_rebalanced"]},
        "cost": {"llm_calls": generator.get("requests", 0), "request_failures": generator.get("failures", 0),
                 "prompt_tokens": generator.get("prompt_tokens", 0),
                 "completion_tokens": generator.get("completion_tokens", 0),
                 "embedding_requests": embedder.get("requests", 0), "seconds": round(seconds, 2)},
    }
