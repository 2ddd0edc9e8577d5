"""`overstory data lattice-tree`: build LATTICE's semantic tree over a corpus; `lattice-tree-stats` describes one.

    overstory data lattice-tree --config configs/data/lattice_tree.yaml
    overstory data lattice-tree-stats tree=runs/lattice/hotpotqa/tree.json

The leaves are the corpus's chunks at ``leaf_level`` (paragraphs: a HotpotQA document is one; a QASPER
paper has dozens), made as ``retrieval.lattice.insert.leaf_node`` makes them. ``method: top-down`` (the default):
the ``generator`` writes each leaf's 5-level keyword summaries, ``keywords.batch_size`` leaves a request
(``retrieval.lattice.keywords``), then ``retrieval.lattice.top_down`` clusters them into a tree of branching at most
M. ``method: bottom-up`` clusters embeddings layer by layer and has the generator summarise each new node;
``method: hybrid`` keeps each document's own hierarchy and builds bottom-up above the documents
(``retrieval.lattice.bottom_up``).

What the generator writes runs on the data jobs' resumable skeleton (``data_pipeline/fanout.py``): the keyword
batches, or each layer's node summaries, are its items, on local threads or (``runner: ray``) on Ray Data workers
whose requests are spread over ``ray.endpoints`` (docs/scale.md, "Data jobs on Ray"); the results come back to the
job, which alone writes them. The embeddings and the top-down clustering go through the job's own client. The
keywords are appended to ``<out>/keywords.jsonl`` (a killed run resumes there; a leaf whose keywords fell back counts
as done, its raw reply in ``<out>/keywords.fallbacks.jsonl``: delete its line to ask again), the settings that
decide them and the served generator to ``<out>/keywords.settings.json``. The node summaries are appended to
``<out>/summaries.jsonl`` as they are made (the reply and what was made of it, keyed by the group's members and
prompt): a killed build rerun over the same corpus reuses them and asks only for the nodes it lacks; summaries that
fell back are listed in ``<out>/summaries.failures.jsonl`` and asked again. The settings that decide the summaries
and the served generator and embedder are kept in ``<out>/summaries.settings.json``. A rerun with other settings is
refused, naming the keys. The job writes ``<out>/tree.json`` (``Tree.load`` reads it) and ``<out>/build.json``: the
tree's statistics and what each stage spent (LLM calls, prompt and completion tokens from the server's usage,
seconds; for the node summaries, how many were reused from the record and how many asked for). A resumed run counts
only what it did itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from overstory.core.config import ConfigError
from overstory.core.failures import check_failure_share, raise_if_too_many
from overstory.core.records import Chunk, FailureRecord, JsonlAppender, check_level, read_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.fanout import Fanout, ServedWork, job_server, job_settings
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies, chunks_at_levels
from overstory.data_pipeline.ray_runner import RayConfig
from overstory.retrieval.lattice.bottom_up import (
    BottomUpBuilder,
    GroupMap,
    GroupOutcome,
    GroupRequest,
    SummaryCall,
    SummaryJournal,
)
from overstory.retrieval.lattice.insert import leaf_node
from overstory.retrieval.lattice.keywords import KeywordSummariser, LeafKeywords
from overstory.retrieval.lattice.top_down import TopDownBuilder
from overstory.retrieval.lattice.tree import Node, Tree
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig
from overstory.serving.job_client import client_for, served_models

SUMMARIES_FILE = "summaries.jsonl"  # bottom-up / hybrid node summaries (with .settings.json and .failures.jsonl)
KEYWORDS_FILE = "keywords.jsonl"  # top-down leaf keywords (with .settings.json and .failures.jsonl)
KEYWORD_FALLBACKS_FILE = "keywords.fallbacks.jsonl"  # the raw replies of the leaves whose keywords fell back
GENERATOR = {"generator": "generator"}  # what each Ray endpoint must serve: the role that writes the summaries


@dataclass(frozen=True)
class KeywordsConfig:
    batch_size: int = 20  # leaves per prompt (the paper: 20)
    max_passage_chars: int = 1000
    max_tokens: int = 2400  # a reply takes about 100 tokens a passage: leave room for batch_size of them
    max_attempts: int = 3
    concurrency: int = 4


@dataclass(frozen=True)
class ClusteringConfig:
    m_max: int = 10  # M: children per node at most (the paper: 10 to 20)
    m_min: int = 0  # clusters per LLM split at least; 0 = ceil(M / 2) (see retrieval/lattice/top_down.py)
    token_budget: int = 3000  # the cluster prompt's summaries must fit this many (estimated) tokens
    max_attempts: int = 2
    max_tokens: int = 1536
    seed: int = 0


@dataclass(frozen=True)
class GroupSummaryConfig:  # bottom-up and hybrid: one summary (theme, description, fingerprints) per new node
    max_tokens: int = 256
    max_attempts: int = 2
    concurrency: int = 4
    max_member_chars: int = 300  # each member's text is cut to this in the prompt


@dataclass(frozen=True)
class LatticeTreeConfig:
    corpus: CorpusConfig
    out: str
    # top-down: keyword summaries, then LLM clustering (Algorithm 3); bottom-up: embed, cluster, summarise each
    # layer; hybrid: each document's own hierarchy, organised bottom-up above the documents
    method: Literal["top-down", "bottom-up", "hybrid"] = "top-down"
    leaf_level: str = "paragraph"
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)
    keywords: KeywordsConfig = field(default_factory=KeywordsConfig)
    clustering: ClusteringConfig = field(default_factory=ClusteringConfig)  # m_max and seed serve every method
    summaries: GroupSummaryConfig = field(default_factory=GroupSummaryConfig)
    limit_leaves: int = 0  # build over the first N leaves only (0 = all)
    # bottom-up and hybrid: the share of node summaries whose requests may all fail (in transit: timeouts, 5xx)
    # before the job exits non-zero; the tree is saved either way, such nodes named from their members' heads
    max_failure_share: float = 0.0
    server_url: str = ""  # empty: start the stack in `serve` for the run
    request_timeout_s: float = 900.0  # per request: a keyword batch of 20 passages is a long reply on CPU
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # ray: the keyword batches (top-down) or the node summaries (bottom-up, hybrid) on Ray Data workers
    # (keywords.concurrency or summaries.concurrency of them), their requests spread over ray.endpoints; the
    # embeddings and the top-down clustering stay with the job's own client
    runner: Literal["threads", "ray"] = "threads"
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        try:
            check_level(self.leaf_level)
        except ValueError as exc:
            raise ConfigError(f"leaf_level: {exc}") from exc
        if self.leaf_level == "document":
            raise ConfigError("leaf_level: document chunks have no parent level to cluster; use paragraph")
        if self.clustering.m_max < 2:
            raise ConfigError(f"clustering.m_max must be >= 2, got {self.clustering.m_max}")
        if self.clustering.m_min and not 2 <= self.clustering.m_min <= self.clustering.m_max:
            raise ConfigError(f"clustering.m_min must be 0 or between 2 and m_max={self.clustering.m_max}, "
                              f"got {self.clustering.m_min}")
        if self.keywords.batch_size < 1 or self.keywords.max_attempts < 1 or self.keywords.concurrency < 1:
            raise ConfigError("keywords.batch_size, keywords.max_attempts and keywords.concurrency must be >= 1")
        if self.limit_leaves < 0:
            raise ConfigError(f"limit_leaves must be >= 0, got {self.limit_leaves}")
        if self.method not in ("top-down", "bottom-up", "hybrid"):
            raise ConfigError(f"method must be top-down, bottom-up or hybrid, got {self.method!r}")
        if self.summaries.max_attempts < 1 or self.summaries.concurrency < 1:
            raise ConfigError("summaries.max_attempts and summaries.concurrency must be >= 1")
        check_failure_share(self.max_failure_share)


def corpus_chunks(config: LatticeTreeConfig) -> list[Chunk]:
    """Every level of the corpus's hierarchies; with ``limit_leaves``, the documents whose ``leaf_level`` chunks
    come first, up to that many leaves (whole documents: the hybrid keeps each document's structure)."""
    documents = load_corpus(config.corpus)[0]
    chunks = build_hierarchies(documents, config.hierarchy)
    if config.limit_leaves:
        kept_docs: set[str] = set()
        for chunk in chunks_at_levels(chunks, config.leaf_level)[: config.limit_leaves]:
            kept_docs.add(chunk.doc_id)
        chunks = [c for c in chunks if c.doc_id in kept_docs]
    return chunks


def corpus_leaves(config: LatticeTreeConfig) -> list[Node]:
    """The corpus's chunks at ``leaf_level`` as tree leaves (chunk id, document id, the chunk's text)."""
    documents = load_corpus(config.corpus)[0]
    chunks = chunks_at_levels(build_hierarchies(documents, config.hierarchy), config.leaf_level)
    if config.limit_leaves:
        chunks = chunks[: config.limit_leaves]
    if not chunks:
        raise ConfigError(f"corpus {config.corpus.path!r} has no {config.leaf_level} chunks to build a tree over")
    return [leaf_node(chunk) for chunk in chunks]


def keyword_settings(config: LatticeTreeConfig) -> dict:
    """What decides the top-down keyword summaries, recorded beside them: the corpus (not its path or size), its
    hierarchy, the leaf level and the keyword settings but ``keywords.concurrency``."""
    settings = job_settings(config)
    keywords = {k: v for k, v in settings["keywords"].items() if k != "concurrency"}
    return {**{key: settings[key] for key in ("corpus", "hierarchy", "leaf_level")}, "keywords": keywords}


def summary_settings(config: LatticeTreeConfig) -> dict:
    """What decides the bottom-up and hybrid node summaries, recorded beside them: the job's settings without the
    operational keys (``fanout.job_settings``: the corpus may move or grow), the top-down keyword stage,
    ``limit_leaves`` (a summary is keyed by its group's members, so a build over more leaves reuses the groups it
    shares) and ``summaries.concurrency``; of ``clustering``, the M and seed these methods use."""
    settings = job_settings(config, drop={"keywords", "limit_leaves"})
    settings["clustering"] = {key: settings["clustering"][key] for key in ("m_max", "seed")}
    settings["summaries"] = {k: v for k, v in settings["summaries"].items() if k != "concurrency"}
    return settings


def run(config: LatticeTreeConfig) -> dict:
    out_dir = Path(config.out)
    with ExitStack() as stack:
        # the record of what the LLM writes is checked first: other settings are refused before a server starts
        record = stack.enter_context(_fanout(config, out_dir))
        tracker = stack.enter_context(start_run(config.tracking, "data lattice-tree", config))
        url, options = job_server(config.server_url, config.runner, config.ray)
        client = stack.enter_context(client_for(config.serve, url, timeout_s=config.request_timeout_s, **options))
        if config.method == "top-down":
            leaves = corpus_leaves(config)
            tree, report = _top_down(config, client, leaves, record, out_dir)
        else:
            tree, report, leaves = _bottom_up(config, client, record)
        tree.validate(max_branching=config.clustering.m_max, expected_leaves={leaf.id for leaf in leaves})
        tree.meta.update({"corpus": config.corpus.path, "leaf_level": config.leaf_level})
        tree.save(out_dir / "tree.json")
        report = {"method": config.method, "stats": tree.stats(), **report}
        (out_dir / "build.json").write_text(json.dumps(report, indent=2))
        tracker.summary({"leaves": len(leaves), "depth": report["stats"]["depth"],
                         "llm_calls": sum(part.get("llm_calls", 0) for part in report.values()
                                          if isinstance(part, dict)), **_summary_counts(report)})
    cost = "; ".join(f"{name} {part['llm_calls']} calls {part['seconds']} s" for name, part in report.items()
                     if isinstance(part, dict) and "llm_calls" in part)
    counts = _summary_counts(report)
    reused = (f"; node summaries: {counts['summaries_reused']} reused from {out_dir / SUMMARIES_FILE}, "
              f"{counts['summaries_asked']} asked for" if counts else "")
    print(f"lattice tree ({config.method}): {len(leaves)} leaves, depth {report['stats']['depth']}, "
          f"branching {report['stats']['branching']['mean']} mean / {report['stats']['branching']['max']} max; "
          f"{cost}{reused} -> {out_dir / 'tree.json'}")
    if "summaries" in report:
        _raise_if_summaries_failed(report["summaries"]["placements"], config.max_failure_share, out_dir)
    return report


def _fanout(config: LatticeTreeConfig, out_dir: Path) -> Fanout:
    """The fan-out of what the generator writes: the leaves' keywords (top-down) or the node summaries (bottom-up,
    hybrid), on the config's runner."""
    if config.method == "top-down":
        return Fanout("lattice-tree keywords", out_dir / KEYWORDS_FILE, keyword_settings(config),
                      concurrency=config.keywords.concurrency, runner=config.runner, ray=config.ray)
    return Fanout("lattice-tree", out_dir / SUMMARIES_FILE, summary_settings(config),
                  concurrency=config.summaries.concurrency, runner=config.runner, ray=config.ray)


def _summary_counts(report: dict) -> dict[str, int]:
    """The node summaries reused from the record and asked for this run (bottom-up and hybrid; else empty)."""
    if "summaries" not in report:
        return {}
    placements = report["summaries"]["placements"]
    return {key: placements.get(key, 0) for key in ("summaries_reused", "summaries_asked")}


def _raise_if_summaries_failed(placements: dict, max_failure_share: float, out_dir: Path) -> None:
    """``TooManyFailures`` when more node summaries than the share allows had every request fail."""
    failed = placements.get("summaries_failed", 0)
    attempted = failed + placements.get("summaries_llm", 0) + placements.get("summaries_fallback", 0)
    raise_if_too_many("data lattice-tree", {"failed": failed}, attempted, max_failure_share,
                      where=f"{out_dir / 'build.json'} (summaries_failed: the saved tree names those nodes from their "
                            "members' heads)")


def _top_down(config: LatticeTreeConfig, client: Client, leaves: list[Node], fanout: Fanout,
              out_dir: Path) -> tuple[Tree, dict]:
    """Keyword summaries of the leaves ``fanout``'s output lacks (batches on its runner), then Algorithm 3's
    recursive clustering through the job's client."""
    started = time.perf_counter()
    fanout.record_served(served_models(client, list(GENERATOR)))
    passages = [(leaf.id, leaf.text) for leaf in fanout.todo(leaves, lambda leaf: leaf.id)]
    size = config.keywords.batch_size
    batches = [passages[i: i + size] for i in range(0, len(passages), size)]
    calls = 0
    with JsonlAppender(out_dir / KEYWORD_FALLBACKS_FILE) as fallbacks:

        def write(_: list[tuple[str, str]], result: tuple[list[LeafKeywords], list[FailureRecord], int]) -> None:
            nonlocal calls
            records, failed, spent = result
            for leaf_keywords in records:
                fanout.write(leaf_keywords, kind=leaf_keywords.source)
            for failure in failed:
                fallbacks.write(failure)
            calls += spent

        work = ServedWork(partial(_keyword_batch, config.keywords), client, {"timeout_s": config.request_timeout_s},
                          served_roles=GENERATOR)
        fanout.run(batches, lambda batch: batch[0][0], work, write, "keyword summaries")
    counts = fanout.finish()
    fanout.raise_if_failed()
    keywords_usage = client.stats.summary().get("generator", {})
    keyword_cost = {"llm_calls": calls, "prompt_tokens": keywords_usage.get("prompt_tokens", 0),
                    "completion_tokens": keywords_usage.get("completion_tokens", 0),
                    "seconds": round(time.perf_counter() - started, 2),
                    "leaves_llm": counts.get("llm", 0), "leaves_fallback": counts.get("fallback", 0),
                    "leaves_skipped_done": counts["skipped"]}
    keywords = {r["id"]: r["keywords"] for r in read_jsonl(out_dir / KEYWORDS_FILE)}
    builder = TopDownBuilder(client, embed=lambda texts: client.embed("embedder", texts),
                             m_max=config.clustering.m_max, m_min=config.clustering.m_min or None,
                             token_budget=config.clustering.token_budget,
                             max_attempts=config.clustering.max_attempts, max_tokens=config.clustering.max_tokens,
                             seed=config.clustering.seed)
    tree = builder.build(leaves, keywords)
    tree.meta["keywords_cost"] = keyword_cost
    return tree, {"keywords": keyword_cost, "clustering": builder.stats.as_dict()}


def _keyword_batch(settings: KeywordsConfig, client: Client
                   ) -> Callable[[Sequence[tuple[str, str]]], tuple[list[LeafKeywords], list[FailureRecord], int]]:
    """The fan-out's work for the keywords: one batch through ``client`` (the job's, or a Ray worker's)."""
    return KeywordSummariser(client, max_attempts=settings.max_attempts, max_passage_chars=settings.max_passage_chars,
                             max_tokens=settings.max_tokens).summarise_batch


def _one_group(call: SummaryCall, client: Client) -> Callable[[GroupRequest], GroupOutcome]:
    """The fan-out's work for the node summaries: one group's ``call`` through ``client``."""
    return partial(call, client)


def _fanout_map(fanout: Fanout, client: Client, worker_options: dict[str, Any]) -> GroupMap:
    """The bottom-up builder's map: each layer's groups a run of ``fanout`` (its runner: threads on the job's
    client, or Ray workers on clients of their own made with ``worker_options``); the outcomes come back to this
    thread, which writes them."""

    def map_groups(call: SummaryCall, requests: Sequence[GroupRequest],
                   handle: Callable[[GroupRequest, GroupOutcome], None]) -> None:
        work = ServedWork(partial(_one_group, call), client, worker_options, served_roles=GENERATOR)
        fanout.run(requests, lambda request: request.key, work, handle, "node summaries")
    return map_groups


def _journal(record: Fanout) -> SummaryJournal:
    """The node summaries recorded in ``record``'s output (reused), and its hooks for this run's: a summary to the
    output, a fallback to the failures file (asked again by a rerun)."""
    recorded = {str(r["id"]): r for r in read_jsonl(record.out.path)}
    return SummaryJournal(recorded, write=lambda summary: record.write(summary, kind="summaries"),
                          fail=lambda key, error, raw, attempts: record.fail(
                              key, FailureRecord(key, record.job, error, raw, attempts)))


def _bottom_up(config: LatticeTreeConfig, client: Client, record: Fanout) -> tuple[Tree, dict, list[Node]]:
    """Bottom-up over the leaves, or the hybrid over the documents' own hierarchies (no keyword stage), reusing
    the node summaries ``record`` holds and adding this run's to it."""
    record.record_served(served_models(client, ["generator", "embedder"]))
    builder = BottomUpBuilder(_fanout_map(record, client, {"timeout_s": config.request_timeout_s}),
                              embed=lambda texts: client.embed("embedder", texts), m_max=config.clustering.m_max,
                              max_tokens=config.summaries.max_tokens, max_attempts=config.summaries.max_attempts,
                              max_member_chars=config.summaries.max_member_chars, seed=config.clustering.seed,
                              journal=_journal(record))
    if config.method == "bottom-up":
        leaves = corpus_leaves(config)
        tree = builder.build(leaves)
    else:
        tree = builder.build_hybrid(corpus_chunks(config), config.leaf_level)
        leaves = [n for n in tree.nodes.values() if n.leaf]
    if not leaves:
        raise ConfigError(f"corpus {config.corpus.path!r} has no {config.leaf_level} chunks to build a tree over")
    record.finish()  # the failures file keeps only the summaries still missing
    return tree, {"summaries": builder.stats.as_dict()}, leaves


@dataclass(frozen=True)
class LatticeTreeStatsConfig:
    tree: str

    def __post_init__(self) -> None:
        if not self.tree:
            raise ConfigError("tree: name a tree file, e.g. tree=runs/lattice/hotpotqa/tree.json")


def run_stats(config: LatticeTreeStatsConfig) -> dict:
    """Print and return a saved tree's depth, branching and leaves per internal node, and its build cost."""
    tree = Tree.load(config.tree)
    tree.validate()
    stats = tree.stats()
    print(json.dumps({"stats": stats, "meta": tree.meta}, indent=2))
    return stats
