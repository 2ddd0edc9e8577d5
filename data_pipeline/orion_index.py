"""Orion-RAG's tagged index of a set of documents, written to a folder: what ``overstory data orion-tags`` runs over a
corpus and ``eval pipeline`` runs when its Orion strategy has no tags yet.

``tag_and_index`` cuts every document into sliding windows of characters (``chunking``), has the ``generator`` write
each document's master tags and each chunk's three paragraph tags (``retrieval.orion.tagger.Tagger``), and appends
them to ``<out>/masters.jsonl`` and ``<out>/chunks.jsonl`` (put in the corpus's order once tagging ends, whatever
order the requests finished in). It runs on the fan-out skeleton (``data_pipeline/fanout.py``), the documents first,
then the chunks of the documents that have their master tags (a chunk's semantic path starts with them):

- resume: finished ids are skipped, so a killed run asks only for what is missing; a fallback (no usable tags after
  ``tagging.max_attempts`` replies) counts as finished, its raw replies kept in ``<out>/fallbacks.jsonl`` (delete its
  line to ask again);
- settings: the chunking and tagging settings, the prompts' digest and the generator the server reports are kept in
  ``<out>/chunks.settings.json`` (``TAGS_SETTINGS_FILE``, where the strategy reads how the folder's chunks were cut
  and tagged); a rerun with others is refused (chunk ids number windows, so tags of other windows would land on the
  wrong text);
- failures: a document or chunk whose requests failed (after the client's retries) would hold fallback tags for
  replies that never came, so it is not written: it goes to ``<out>/chunks.failures.jsonl`` and a rerun tags it again
  (a failed document's chunks wait for it); more failures than ``max_failure_share`` of the items attempted raise
  ``TooManyFailures`` before anything is indexed. A request the server refuses (a 4xx other than 408 and 429: a
  wrong role, a bad request) is no item's failure: the tagger raises ``RequestRefused`` naming the role and the
  server's reason, and the job stops (what was tagged before stays, and a rerun with the stack fixed resumes).

Then every chunk there is indexed (``retrieval.orion.strategy.OrionStrategy``), embedding only what
``<out>/vectors.npz`` lacks, and ``<out>/build.json`` says what tagging spent (LLM calls, failed requests, prompt and
completion tokens from the server's usage, seconds; a resumed run counts only what it did itself), what failed and
what indexing embedded. The tagging runs on the fan-out's ``runner`` (threads, or Ray Data workers whose requests
are spread over ``ray.endpoints``: docs/scale.md, "Data jobs on Ray").
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

from overstory.core.records import Chunk, Document, FailureRecord, JsonlAppender, read_jsonl, write_jsonl
from overstory.data_pipeline.fanout import Fanout, ServedWork
from overstory.data_pipeline.ray_runner import RayConfig
from overstory.retrieval.orion.strategy import OrionConfig, OrionStrategy
from overstory.retrieval.orion.tagger import (
    PROMPTS_DIGEST,
    ChunkingConfig,
    Tagged,
    Tagger,
    TaggingConfig,
    chunk_document,
)
from overstory.retrieval.orion.tags import CHUNKS_FILE, MASTERS_FILE, ChunkTags, DocumentTags
from overstory.serving.client import Client
from overstory.serving.job_client import served_models

FALLBACKS_FILE, REPORT_FILE = "fallbacks.jsonl", "build.json"
GENERATOR = "generator"  # the role that writes the tags

Item = TypeVar("Item", Document, Chunk)


def tag_and_index(documents: Sequence[Document], client: Client, out: str | Path, chunking: ChunkingConfig,
                  tagging: TaggingConfig, max_failure_share: float = 0.0, runner: str = "threads",
                  ray: RayConfig | None = None, worker_options: dict | None = None) -> dict:
    """Tag what ``out`` lacks, index every chunk there, write build.json; returns its report (see the module
    docstring). ``TooManyFailures`` when more than ``max_failure_share`` of the items tagged this run failed.
    ``runner`` and ``ray``: where the tagging requests run (``data_pipeline/fanout.py``); ``worker_options``: the
    Ray workers' ``Client.from_url`` options (``timeout_s``), as ``client`` was built with."""
    out = Path(out)
    chunks = [chunk for document in documents for chunk in chunk_document(document, chunking)]
    started = time.perf_counter()
    # the fan-out keeps its settings beside chunks.jsonl (fanout.settings_path): TAGS_SETTINGS_FILE, the strategy's
    with Fanout("orion-tags", out / CHUNKS_FILE, tags_settings(chunking, tagging), concurrency=tagging.concurrency,
                max_failure_share=max_failure_share, runner=runner, ray=ray) as fanout:
        skipped, usage = tag_missing(documents, chunks, client, out, tagging, fanout, worker_options or {})
        counts = fanout.finish()
    fanout.raise_if_failed()
    in_given_order(out / MASTERS_FILE, [d.id for d in documents])
    in_given_order(out / CHUNKS_FILE, [c.id for c in chunks])
    tagging_cost = {"llm_calls": usage["requests"], "request_failures": usage["failures"],
                    "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
                    "seconds": round(time.perf_counter() - started, 2), **skipped, "failed": counts["failed"],
                    **{f"{kind}_{source}": counts.get(f"{kind}_{source}", 0) for kind in ("documents", "chunks")
                       for source in ("llm", "fallback")}}
    started = time.perf_counter()
    strategy = OrionStrategy.build(client, OrionConfig(tags=str(out)))
    strategy.save_vectors(out)
    report = {"documents": len(documents), "chunks": len(chunks), "tagging": tagging_cost,
              "index": {"chunks": len(strategy.records), "embedded": strategy.embedded,
                        "seconds": round(time.perf_counter() - started, 2)}}
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    return report


def in_given_order(path: Path, ids: Sequence[str]) -> None:
    """Rewrite ``path`` (atomically) with its records in the order of ``ids`` (others after them, as they were), when
    they are not: tags are appended as they finish, and the index's order, which breaks its score ties, should not
    depend on which request finished first."""
    records = list(read_jsonl(path))
    position = {record_id: i for i, record_id in enumerate(ids)}
    ordered = sorted(records, key=lambda r: position.get(r["id"], len(position)))
    if ordered != records:
        write_jsonl(path, ordered)


def tags_settings(chunking: ChunkingConfig, tagging: TaggingConfig) -> dict:
    """What decides the tags: the chunking (chunk ids number its windows), the tagging settings without how many
    requests run at once, and the prompts (their digest)."""
    return {"chunking": asdict(chunking), "tagging": {k: v for k, v in asdict(tagging).items() if k != "concurrency"},
            "prompts": PROMPTS_DIGEST}


def tag_missing(documents: Sequence[Document], chunks: Sequence[Chunk], client: Client, out: Path,
                tagging: TaggingConfig, fanout: Fanout, worker_options: dict | None = None
                ) -> tuple[dict[str, int], Counter]:
    """Master tags of the documents, then paragraph tags of the chunks (of documents with master tags), for those not
    yet in ``out``, appended as they come (counted in ``fanout`` by kind and source: ``chunks_llm``,
    ``documents_fallback``...). Returns what was done before or waits for its document, and the generator's usage."""
    usage: Counter = Counter()
    with JsonlAppender(out / MASTERS_FILE) as masters, JsonlAppender(out / FALLBACKS_FILE) as fallbacks:
        todo = fanout.todo(documents, lambda d: d.id, masters.done)
        if todo or any(c.id not in fanout.out for c in chunks):
            fanout.record_served(served_models(client, [GENERATOR]))

        def keep_master(record: DocumentTags, kind: str) -> None:
            masters.write(record)
            fanout.count(kind)

        options = worker_options or {}
        _tag(todo, "documents", Tagger.master, keep_master, (client, options), tagging, fanout, fallbacks, usage)
        ready = [c for c in chunks if c.doc_id in masters]
        todo_chunks = fanout.todo(ready, lambda c: c.id)
        _tag(todo_chunks, "chunks", Tagger.paragraph, fanout.write, (client, options), tagging, fanout, fallbacks,
             usage)
    return {"documents_skipped_done": len(documents) - len(todo), "chunks_skipped_done": len(ready) - len(todo_chunks),
            "chunks_waiting": len(chunks) - len(ready)}, usage


def _tag(items: Sequence[Item], kind: str, tag: Callable[[Tagger, Item], Tagged],
         keep: Callable[[DocumentTags | ChunkTags, str], None], served: tuple[Client, dict], tagging: TaggingConfig,
         fanout: Fanout, fallbacks: JsonlAppender, usage: Counter) -> None:
    """Tag ``items`` on the fan-out's workers, each through a client of its own (a fork of the worker's client, so
    that its failed requests are told apart; its usage is then added back to that client, and from a Ray worker's to
    the job's), and ``keep`` each tagged record under ``<kind>_<source>``; an item whose tags fell back after a failed
    request is listed as failed instead. ``served``: the job's client and the options the Ray workers build theirs
    with."""

    def tagger(worker_client: Client) -> Callable[[Item], tuple[Tagged, dict]]:
        def work(item: Item) -> tuple[Tagged, dict]:
            own = worker_client.fork()
            tagged = tag(Tagger(own, tagging, GENERATOR), item)
            worker_client.stats.absorb(own.stats)  # the caller's client still counts the tagging (the index cost)
            return tagged, own.stats.summary().get(GENERATOR, {})
        return work

    def write(item: Item, result: tuple[Tagged, dict]) -> None:
        tagged, spent = result
        usage.update({k: spent.get(k, 0) for k in ("requests", "failures", "prompt_tokens", "completion_tokens")})
        if tagged.failure is not None and spent.get("failures", 0):
            fanout.fail(item.id, FailureRecord(item.id, "orion-tags", f"{spent['failures']} of {spent['requests']} "
                                               "requests failed after the client's retries", tagged.failure.raw,
                                               tagged.calls))
            return
        keep(tagged.record, f"{kind}_{tagged.record.source}")
        if tagged.failure is not None:
            fallbacks.write(tagged.failure)

    fanout.run(items, lambda item: item.id, ServedWork(tagger, *served), write, f"{kind[:-1]} tags")
