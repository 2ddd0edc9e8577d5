"""`overstory data summaries`: LLM summaries of upper-level chunks and their embeddings (e_gt).

    overstory data summaries --config configs/data/summaries.yaml

For every chunk of the configured levels, the ``generator`` role summarises it with the SmartChunk
prompt ("Summarize the following text in at most n tokens"), the ``embedder`` role embeds the
summary (the compressor's target e_gt) and the chunk's children (its input), and one
``SummaryRecord`` is appended to ``out`` (the one-chunk step is ``data_pipeline/summarize.py``).
A summary that comes back empty, or not in the source's script, is retried; after ``max_attempts`` it goes to
``<out>.failures.jsonl`` with the raw text.
Finished ids are skipped on restart, so a killed run resumes; failures (rejected summaries, failed requests) are
retried on restart, and those written since leave the failures file (it lists what is still missing). The job runs
on the fan-out skeleton (``data_pipeline/fanout.py``): its settings and the models that served it are kept in
``<out>.settings.json`` (a rerun with others is refused), each record names the generator and encoder the server
reports, and the job fails (exit code 1) when more than ``max_failure_share`` of its chunks failed. The hierarchy
that was summarised is kept in ``<out>.hierarchy.jsonl`` for resumes and later jobs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Literal

from overstory.core.config import ConfigError
from overstory.core.records import Chunk, SummaryRecord, check_upper_levels
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.fanout import Fanout, ServedWork, failures_path, job_server, job_settings
from overstory.data_pipeline.hierarchy import (
    HierarchyConfig,
    build_hierarchies,
    load_hierarchies,
    save_hierarchies,
    stored_hierarchy_path,
)
from overstory.data_pipeline.ray_runner import RayConfig
from overstory.data_pipeline.summarize import SummaryFailed, summarise
from overstory.serving.client import Client, ClientError
from overstory.serving.config import ServeConfig
from overstory.serving.job_client import client_for, served_models


@dataclass(frozen=True)
class SummariesConfig:
    corpus: CorpusConfig
    out: str
    # an existing hierarchy JSONL (from `overstory data hierarchy`); empty builds it from the corpus
    hierarchies: str = ""
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)
    levels: list[str] = field(default_factory=lambda: ["paragraph", "subsection", "section"])
    max_summary_tokens: int = 128
    # chunks longer than this many characters are cut before summarising (keeps prompts in context)
    max_input_chars: int = 12000
    temperature: float = 0.0
    max_attempts: int = 3
    concurrency: int = 2
    runner: Literal["threads", "ray"] = "threads"  # ray: Ray Data workers, requests spread over ray.endpoints
    ray: RayConfig = field(default_factory=RayConfig)
    limit: int = 0  # summarise at most this many chunks (0 = all)
    max_failure_share: float = 0.0  # the job fails (exit 1) when more of its chunks than this failed
    server_url: str = ""
    # per request: a CPU stack summarising `concurrency` long sections at once can take minutes for each
    request_timeout_s: float = 120.0
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        try:
            check_upper_levels(self.levels)
        except ValueError as exc:
            raise ConfigError(f"levels: {exc}") from exc
        if self.max_attempts < 1 or self.concurrency < 1 or self.max_summary_tokens < 1:
            raise ConfigError("max_attempts, concurrency and max_summary_tokens must be positive")


def run(config: SummariesConfig) -> dict:
    """Summarise every chunk of the configured levels the output lacks (see the module docstring)."""
    chunks = summarised_hierarchy(config)
    by_id = {c.id: c for c in chunks}
    targets = [c for c in chunks if c.level in config.levels and c.children]
    if config.limit:
        targets = targets[: config.limit]
    with ExitStack() as stack:
        tracker = stack.enter_context(start_run(config.tracking, "data summaries", config))
        fanout = stack.enter_context(Fanout("summaries", config.out, job_settings(config, drop={"hierarchies"}),
                                            concurrency=config.concurrency, failure_types=(SummaryFailed, ClientError),
                                            max_failure_share=config.max_failure_share, runner=config.runner,
                                            ray=config.ray))
        todo = fanout.todo(targets, lambda c: c.id)
        generator_tokens = 0
        if todo:
            # on Ray with endpoints and no server_url, the first endpoint: the fleet needs no stack of the job's own
            url, options = job_server(config.server_url, config.runner, config.ray)
            client = stack.enter_context(client_for(config.serve, url, timeout_s=config.request_timeout_s, **options))
            served = served_models(client, ["generator", "embedder"])
            fanout.record_served(served)
            children = {c.id: [by_id[k] for k in c.children] for c in todo}

            def summariser(worker_client: Client) -> Callable[[Chunk], SummaryRecord]:
                return lambda c: summarise(c, children[c.id], worker_client, config, served)

            fanout.run(todo, lambda c: c.id, ServedWork(summariser, client, {"timeout_s": config.request_timeout_s}),
                       lambda _, record: fanout.write(record, "ok"), "summarising")
            generator_tokens = client.stats.summary().get("generator", {}).get("completion_tokens", 0)
        counts = {"ok": 0, **fanout.finish()}
        tracker.summary({**counts, "generator_tokens": generator_tokens})
    print(f"summaries: {counts['ok']} written, {counts['failed']} failed (see {failures_path(config.out)}), "
          f"{counts['skipped']} already done, {counts['resolved']} earlier failures since written -> {config.out}")
    fanout.raise_if_failed()
    return counts


def summarised_hierarchy(config: SummariesConfig) -> list[Chunk]:
    """The chunks to summarise: those stored beside the output (a resumed run and later jobs, training and
    evaluation, see exactly the chunk ids that were summarised, whatever the chunking code does meanwhile), else
    the configured hierarchy file or the corpus's hierarchy, then stored there."""
    kept = stored_hierarchy_path(config.out)
    if kept.exists():
        return load_hierarchies(kept)
    chunks = (load_hierarchies(config.hierarchies) if config.hierarchies
              else build_hierarchies(load_corpus(config.corpus)[0], config.hierarchy))
    save_hierarchies(kept, chunks)
    return chunks
