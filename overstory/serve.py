"""``overstory serve``: the served roles (``serving/launch.py``), plus a persisted retriever when ``retriever`` names
one, at ``/v1/retrieve``, ``/v1/documents`` and Search-R1's ``/retrieve`` (``serving/retrieval_routes.py``).

    overstory serve --config configs/serve/local.yaml --retriever runs/index/hotpotqa-naive

The retriever is a folder that ``overstory.retrieval.api.Retriever.save`` wrote; it is loaded over the roles this stack
serves (its embedder must be the model it was saved with, or the load is refused naming both), and its index calls the
embedded roles in-process, through the server's own handlers; with ``engine: vllm`` it is served on the stack's front
door and calls the chat roles on the vLLM servers over HTTP (``launch.StackBackend``). Serving sits below retrieval, so
the bridge lives here: ``ServedRetriever`` gives the routes a ``Retriever`` in their terms, with retrieval's errors as
the server's (an unknown document -> 404, an existing one -> 409, other bad input -> 400). Updates run one at a time and
are saved back into the folder before they are acknowledged, so a restart serves what the last answer said; a query
running meanwhile reads the old or the new index (``Retriever``'s one-assignment swap).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

from overstory.core.config import ConfigError
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.retrieval.api import (
    DocumentExistsError,
    IndexMismatchError,
    Models,
    Retrieved,
    Retriever,
    UnknownDocumentError,
    documents_from,
)
from overstory.serving import launch
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig
from overstory.serving.errors import BadRequest, Conflict, NotFound
from overstory.serving.retrieval_routes import Indexed, QueryResult

__all__ = ["ServeConfig", "ServedRetriever", "run", "served_retriever"]

log = logging.getLogger(__name__)
QUERY_WORKERS = 8  # queries of one batch retrieved at once (the engine batches their model calls)


def query_result(found: Retrieved) -> QueryResult:
    """A ``Retrieved`` in the routes' terms."""
    return QueryResult([dataclasses.asdict(hit) for hit in found.evidence], found.cost.roles, found.cost.seconds,
                       found.failure, found.failure_detail)


class ServedRetriever:
    """A ``Retriever`` saved in ``folder`` as the routes' ``RetrievalService``; ``close`` stops its query pool."""

    def __init__(self, retriever: Retriever, folder: str, max_k: int, max_queries: int):
        self.retriever, self.folder = retriever, folder
        self.strategy, self.max_k, self.max_queries = retriever.strategy_name, max_k, max_queries
        self.hierarchy = HierarchyConfig(**retriever.settings)  # added documents are split as the saved ones were
        if not retriever.settings:
            log.warning("%s records no hierarchy settings; added documents are split with the defaults", folder)
        self._updates = threading.Lock()  # one update (index, then save) at a time
        self._pool = ThreadPoolExecutor(QUERY_WORKERS, thread_name_prefix="overstory-retrieve")

    def retrieve(self, queries: Sequence[str], k: int | None) -> list[QueryResult]:
        """Each query's evidence; a batch's queries run side by side on the query pool."""
        if len(queries) == 1:
            return [self._one(queries[0], k)]
        return list(self._pool.map(lambda query: self._one(query, k), queries))

    def _one(self, query: str, k: int | None) -> QueryResult:
        try:
            return query_result(self.retriever.retrieve(query, k))
        except ValueError as exc:  # what the API refuses in a question or k
            raise BadRequest(str(exc)) from exc

    def add(self, documents: list[dict[str, Any]], replace: bool) -> Indexed:
        """Split ``documents`` with the saved hierarchy settings, index them in place, save."""
        try:
            parsed = documents_from(documents)
        except ConfigError as exc:
            raise BadRequest(str(exc), param="documents") from exc
        chunks = build_hierarchies(parsed, self.hierarchy)
        with self._updates:
            held = self.retriever.doc_ids
            try:
                cost = self.retriever.add_documents(parsed, chunks, replace=replace)
            except DocumentExistsError as exc:
                raise Conflict(str(exc)) from exc
            except (ConfigError, ValueError) as exc:
                raise BadRequest(str(exc), param="documents") from exc
            self.retriever.save(self.folder)
        return Indexed([d.id for d in parsed if d.id not in held], [d.id for d in parsed if d.id in held],
                       cost.roles, cost.seconds, cost.fallbacks)

    def remove(self, doc_id: str) -> None:
        """Drop ``doc_id`` from the index in place, save."""
        with self._updates:
            try:
                self.retriever.remove_documents([doc_id])
            except UnknownDocumentError as exc:
                raise NotFound(str(exc)) from exc
            except (ConfigError, ValueError) as exc:  # the last document: an index is never left empty
                raise BadRequest(str(exc)) from exc
            self.retriever.save(self.folder)

    def document_count(self) -> int:
        return len(self.retriever.doc_ids)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@contextmanager
def served_retriever(config: ServeConfig, client: Client) -> Iterator[ServedRetriever]:
    """The retriever of ``config.retriever`` loaded over the roles ``client`` reaches (the launcher's client of the
    stack it serves); a folder saved with another embedding model, or holding no saved retriever, is a ConfigError
    saying so."""
    try:
        retriever = Retriever.load(config.retriever, Models(client))
    except (IndexMismatchError, FileNotFoundError) as exc:
        raise ConfigError(f"retriever={config.retriever}: {exc}") from exc
    service = ServedRetriever(retriever, config.retriever, config.retriever_max_k, config.retriever_max_queries)
    try:
        yield service
    finally:
        service.close()


def run(config: ServeConfig) -> None:
    """``overstory serve``: the roles of ``config``, and its retriever when it names one, until Ctrl-C or SIGTERM."""
    if not config.retriever:
        return launch.run(config)
    with ExitStack() as owned:
        launch.run(config, retrieval=lambda client: owned.enter_context(served_retriever(config, client)))
