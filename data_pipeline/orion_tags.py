"""`overstory data orion-tags`: Orion-RAG's tagged index of a corpus; `orion-tags-edit`: a person changes one document's
master tags.

    overstory data orion-tags --config configs/data/orion_tags.yaml
    overstory data orion-tags-edit tags=runs/orion/hotpotqa document=hotpotqa/twins-group add=[Cantopop] remove=[music]

The job tags and indexes the corpus with ``tag_and_index`` (``data_pipeline/orion_index.py``, whose docstring gives
the details): the ``generator`` writes each document's master tags and each chunk's paragraph tags
(``retrieval.orion.tagger.Tagger``) into ``<out>/masters.jsonl`` and ``<out>/chunks.jsonl`` on the fan-out skeleton
(a killed run resumes; the settings and the served generator are kept in ``<out>/chunks.settings.json`` and a rerun
with others is refused; items whose requests failed are listed in ``<out>/chunks.failures.jsonl`` for the rerun, and
the job fails with exit code 1 when more than ``max_failure_share`` of them failed); then every chunk is indexed
(``retrieval.orion.strategy.OrionStrategy``) and ``<out>/build.json`` says what it spent.

The edit (the paper's human in the loop) rewrites the document's master tags (``source`` becomes "human") and
re-indexes that document alone: its semantic paths change, so only they are embedded again.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from overstory.core.config import ConfigError
from overstory.core.records import write_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.fanout import job_server
from overstory.data_pipeline.orion_index import tag_and_index
from overstory.data_pipeline.ray_runner import RayConfig
from overstory.models.registry import MINILM
from overstory.retrieval.orion.strategy import OrionConfig, OrionStrategy
from overstory.retrieval.orion.tagger import ChunkingConfig, TaggingConfig
from overstory.retrieval.orion.tags import MASTERS_FILE, DocumentTags, load_tags
from overstory.serving.client import Client
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.job_client import client_for


@dataclass(frozen=True)
class OrionTagsConfig:
    corpus: CorpusConfig
    out: str = "runs/orion/hotpotqa"
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    tagging: TaggingConfig = field(default_factory=TaggingConfig)
    max_failure_share: float = 0.0  # the job fails (exit 1) when more of its documents and chunks than this failed
    server_url: str = ""  # empty: start the stack in `serve` for the run
    request_timeout_s: float = 900.0  # per request: tagging replies are short, but a loaded CPU server queues them
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # ray: Ray Data workers (tagging.concurrency of them), the requests spread over ray.endpoints
    runner: Literal["threads", "ray"] = "threads"
    ray: RayConfig = field(default_factory=RayConfig)

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
        url, options = job_server(config.server_url, config.runner, config.ray)
        client = stack.enter_context(client_for(config.serve, url, timeout_s=config.request_timeout_s, **options))
        report = tag_and_index(documents, client, config.out, config.chunking, config.tagging,
                               config.max_failure_share, config.runner, config.ray,
                               {"timeout_s": config.request_timeout_s})
        tracker.summary({"documents": report["documents"], "chunks": report["chunks"],
                         "llm_calls": report["tagging"]["llm_calls"], "embedded": report["index"]["embedded"]})
    tagging = report["tagging"]
    print(f"orion tags: {report['documents']} documents, {report['chunks']} chunks; tagging {tagging['llm_calls']} "
          f"calls, {tagging['prompt_tokens']} + {tagging['completion_tokens']} tokens, {tagging['seconds']} s "
          f"({tagging['chunks_fallback']} chunk and {tagging['documents_fallback']} document fallbacks, "
          f"{tagging['failed']} failed, {tagging['chunks_waiting']} chunks waiting for their document); "
          f"{report['index']['embedded']} texts embedded -> {config.out}")
    return report


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
