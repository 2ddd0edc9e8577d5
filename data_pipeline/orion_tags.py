"""`overstory data orion-tags`: Orion-RAG's tagged index of a corpus; `orion-tags-edit`: a person changes one document's
master tags.

    overstory data orion-tags --config configs/data/orion_tags.yaml
    overstory data orion-tags-edit tags=runs/orion/hotpotqa document=hotpotqa/twins-group add=[Cantopop] remove=[music]

The job cuts every document into sliding windows of characters (``chunking``), has the ``generator`` write each
document's master tags and each chunk's three paragraph tags (``retrieval.orion_tagger.Tagger``), and appends them to
``<out>/masters.jsonl`` and ``<out>/chunks.jsonl``: finished ids are skipped, so a killed run resumes (a fallback
counts as finished: delete its line to ask again; ``<out>/failures.jsonl`` keeps the raw replies behind fallbacks).
It then indexes every chunk (``retrieval.orion.OrionStrategy``), embedding only what ``<out>/vectors.npz`` lacks,
and writes ``<out>/build.json``: what tagging spent (LLM calls, prompt and completion tokens from the server's
usage, seconds; a resumed run counts only what it did itself) and what indexing embedded. The chunking settings are
kept in ``<out>/chunking.json``: chunk ids are window numbers, so a rerun with other settings is refused.

The edit (the paper's human in the loop) rewrites the document's master tags (``source`` becomes "human") and
re-indexes that document alone: its semantic paths change, so only they are embedded again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from rich.progress import Progress

from overstory.core.config import ConfigError
from overstory.core.records import Chunk, Document, JsonlAppender, write_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.fanout import SettingsRecord
from overstory.models.registry import MINILM
from overstory.retrieval.orion.strategy import OrionConfig, OrionStrategy
from overstory.retrieval.orion.tagger import ChunkingConfig, Tagged, Tagger, TaggingConfig, chunk_document
from overstory.retrieval.orion.tags import CHUNKS_FILE, MASTERS_FILE, DocumentTags, load_tags
from overstory.serving.client import Client
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.launch import client_for

CHUNKING_FILE, FAILURES_FILE, REPORT_FILE = "chunking.json", "failures.jsonl", "build.json"


@dataclass(frozen=True)
class OrionTagsConfig:
    corpus: CorpusConfig
    out: str = "runs/orion/hotpotqa"
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    tagging: TaggingConfig = field(default_factory=TaggingConfig)
    server_url: str = ""  # empty: start the stack in `serve` for the run
    request_timeout_s: float = 900.0  # per request: tagging replies are short, but a loaded CPU server queues them
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        if not self.out:
            raise ConfigError("out: name the folder the tags and the index go to")


def run(config: OrionTagsConfig) -> dict:
    documents = load_corpus(config.corpus)[0]
    if not documents:
        raise ConfigError(f"corpus: {config.corpus.path!r} holds no documents")
    with ExitStack() as stack:
        tracker = stack.enter_context(start_run(config.tracking, "data orion-tags", config))
        client = stack.enter_context(client_for(config.serve, config.server_url, timeout_s=config.request_timeout_s))
        report = tag_and_index(documents, client, config.out, config.chunking, config.tagging)
        tracker.summary({"documents": report["documents"], "chunks": report["chunks"],
                         "llm_calls": report["tagging"]["llm_calls"], "embedded": report["index"]["embedded"]})
    tagging = report["tagging"]
    print(f"orion tags: {report['documents']} documents, {report['chunks']} chunks; tagging {tagging['llm_calls']} "
          f"calls, {tagging['prompt_tokens']} + {tagging['completion_tokens']} tokens, {tagging['seconds']} s "
          f"({tagging['chunks_fallback']} chunk and {tagging['documents_fallback']} document fallbacks); "
          f"{report['index']['embedded']} texts embedded -> {config.out}")
    return report


def tag_and_index(documents: Sequence[Document], client: Client, out: str | Path, chunking: ChunkingConfig,
                  tagging: TaggingConfig) -> dict:
    """Tag what ``out`` lacks, index every chunk there, write build.json; returns its report."""
    out = Path(out)
    check_chunking(out, chunking)
    chunks = [chunk for document in documents for chunk in chunk_document(document, chunking)]
    started = time.perf_counter()
    counts = tag_missing(documents, chunks, client, out, tagging)
    usage = client.stats.summary().get("generator", {})
    tagging_cost = {"llm_calls": counts.pop("calls"), "prompt_tokens": usage.get("prompt_tokens", 0),
                    "completion_tokens": usage.get("completion_tokens", 0),
                    "seconds": round(time.perf_counter() - started, 2), **counts}
    started = time.perf_counter()
    strategy = OrionStrategy.build(client, OrionConfig(tags=str(out)))
    strategy.save_vectors(out)
    report = {"documents": len(documents), "chunks": len(chunks), "tagging": tagging_cost,
              "index": {"chunks": len(strategy.records), "embedded": strategy.embedded,
                        "seconds": round(time.perf_counter() - started, 2)}}
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    return report


def check_chunking(out: Path, chunking: ChunkingConfig) -> None:
    """Record the chunking settings beside the tags; refuse others than those of the tags there (chunk ids number
    windows, so tags of other windows would land on the wrong text)."""
    SettingsRecord(out / CHUNKS_FILE, asdict(chunking), out / CHUNKING_FILE)


def tag_missing(documents: Sequence[Document], chunks: Sequence[Chunk], client: Client, out: Path,
                tagging: TaggingConfig) -> dict[str, int]:
    """Master tags of the documents and paragraph tags of the chunks not yet in ``out``, appended as they come (the
    documents first: a chunk's path needs its document's tags). Returns the counts by source and the calls made."""
    tagger = Tagger(client, tagging)
    counts = {"calls": 0}
    with ExitStack() as stack, Progress() as progress:
        masters = stack.enter_context(JsonlAppender(out / MASTERS_FILE))
        tagged = stack.enter_context(JsonlAppender(out / CHUNKS_FILE))
        failures = stack.enter_context(JsonlAppender(out / FAILURES_FILE))
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=tagging.concurrency))
        for kind, items, done, tag in (("documents", documents, masters, tagger.master),
                                       ("chunks", chunks, tagged, tagger.paragraph)):
            todo = [item for item in items if item.id not in done]
            counts[f"{kind}_skipped_done"] = len(items) - len(todo)
            counts[f"{kind}_llm"] = counts[f"{kind}_fallback"] = 0
            task = progress.add_task(f"{kind[:-1]} tags", total=len(todo))
            for result in pool.map(tag, todo):
                _write(result, done, failures, counts, kind)
                progress.advance(task)
    return counts


def _write(result: Tagged, out: JsonlAppender, failures: JsonlAppender, counts: dict[str, int], kind: str) -> None:
    out.write(result.record)
    if result.failure is not None:
        failures.write(result.failure)
    counts[f"{kind}_{result.record.source}"] += 1
    counts["calls"] += result.calls


# ------------------------------------------------------------------------------------------------------ the edit


@dataclass(frozen=True)
class OrionTagEditConfig:
    tags: str  # the out folder of `overstory data orion-tags` (or a file in it)
    document: str  # the id of the document whose master tags change
    add: list[str] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)  # matched regardless of case
    server_url: str = ""  # empty: start the stack in `serve` (the embedder alone) for the edit
    request_timeout_s: float = 120.0
    serve: ServeConfig = field(default_factory=lambda: ServeConfig(
        port=0, roles={"embedder": RoleConfig(model=MINILM, kind="embedding")}))

    def __post_init__(self) -> None:
        if not self.document:
            raise ConfigError("document: name the document whose master tags change, e.g. document=hotpotqa/paris")
        if not self.add and not self.remove:
            raise ConfigError("add, remove: name a tag to add (add=[TAG]) or to remove (remove=[TAG])")
        if any(not " ".join(tag.split()) for tag in self.add):
            raise ConfigError(f"add: a tag must hold a word, got {self.add}")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be positive, got {self.request_timeout_s}")


def run_edit(config: OrionTagEditConfig) -> dict:
    """Check the edit against the stored tags, then apply it with an embedder (started here unless server_url)."""
    folder = tags_folder(config.tags)
    edited = edited_master(load_tags(folder)[0], config)
    with client_for(config.serve, config.server_url, timeout_s=config.request_timeout_s) as client:
        report = apply_edit(folder, edited, client)
    print(f"orion tags of {report['document']}: {report['before']} -> {report['after']}; {report['embedded']} "
          f"paths embedded again, {report['chunks']} chunks -> {folder}")
    return report


def tags_folder(tags: str) -> Path:
    """The tag folder ``tags`` names: itself, or the folder of a file in it."""
    path = Path(tags)
    folder = path.parent if path.is_file() else path
    if not (folder / MASTERS_FILE).is_file():
        raise ConfigError(f"tags: {tags!r} holds no {MASTERS_FILE}; write the tags with `overstory data orion-tags`")
    return folder


def edited_master(masters: dict[str, DocumentTags], config: OrionTagEditConfig) -> DocumentTags:
    """The document's master tags after the edit: ``remove`` taken out, then ``add`` appended (whitespace squeezed,
    tags already there skipped), ``source="human"``. A person's tags are kept as written (no word limit)."""
    if config.document not in masters:
        known = ", ".join(list(masters)[:3])
        raise ConfigError(f"document: {config.document!r} is not a document of these tags (e.g. {known})")
    current = masters[config.document]
    lowered = {tag.lower() for tag in current.tags}
    absent = [tag for tag in config.remove if tag.lower() not in lowered]
    if absent:
        raise ConfigError(f"remove: {absent[0]!r} is not a master tag of {config.document}; its tags are "
                          f"{current.tags}")
    removed = {tag.lower() for tag in config.remove}
    tags = [tag for tag in current.tags if tag.lower() not in removed]
    for tag in (" ".join(t.split()) for t in config.add):
        if tag.lower() not in {t.lower() for t in tags}:
            tags.append(tag)
    if not tags:
        raise ConfigError(f"remove: the edit would leave {config.document} without master tags; add one")
    return replace(current, tags=tags, source="human")


def apply_edit(folder: Path, edited: DocumentTags, client: Client) -> dict:
    """Re-index the edited document alone (its new paths embedded through ``client``), then rewrite masters.jsonl
    and vectors.npz. Returns what changed."""
    strategy = OrionStrategy.build(client, OrionConfig(tags=str(folder)))
    before = strategy.masters[edited.id].tags
    embedded = strategy.reindex_document(edited.id, lambda texts: client.embed("embedder", texts), master=edited)
    write_jsonl(folder / MASTERS_FILE, strategy.masters.values())
    strategy.save_vectors(folder)
    return {"document": edited.id, "before": before, "after": edited.tags, "embedded": embedded,
            "chunks": sum(1 for r in strategy.records if r.doc_id == edited.id)}
