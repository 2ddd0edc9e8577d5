"""One resumable fan-out skeleton for the data jobs that call served models item by item.

A job names its output (a JSONL whose ids mark the items done), the settings that decide that output, and two
functions: ``work(item)`` (runs on the runner's workers: the model calls) and ``write(item, result)`` (runs on the
job's thread: appends and counts, through :meth:`Fanout.write`, :meth:`Fanout.fail` and :meth:`Fanout.count`).
The skeleton does the rest, the same way for every job:

- settings: what decides the output is recorded beside it (``<stem>.settings.json``), with the models that
  actually served it (:meth:`Fanout.record_served`); a rerun with other settings or another served model is
  refused, naming the keys that differ, instead of appending results made another way;
- todo: ids already in the output (or in another file of final outcomes, such as rejected traces) are skipped, so
  a killed run resumes; failed items are not, so a rerun retries them;
- order: results are appended as they complete, and a finished run rewrites the output in the items' order (the
  order ``todo`` was given them), so the same items give the same file whatever the concurrency, the runner or the
  resumes: the trainers that read it (a dataset in file order, shuffled by a seed) then train the same model;
- failures: an item whose work raises one of the job's failure types (a ``ClientError`` by default: a timeout, a
  server error, a refused request) is appended to ``<stem>.failures.jsonl`` with the reason and counted; once a
  later run writes it, it leaves that file, which therefore lists what is still missing;
- progress (a rich bar), counters by kind (``skipped``, ``failed`` and the job's own kinds), and the end:
  :meth:`Fanout.raise_if_failed` raises ``TooManyFailures`` (``overstory/core/failures.py``) when more than
  ``max_failure_share`` of the items this run attempted failed (default 0: any failure), which ``overstory`` turns
  into exit code 1 with the count.

The runner is a seam: ``RUNNERS`` maps a name (a job config's ``runner``) to a function that maps ``work`` over the
items and yields each item's result or exception as it completes, back to the job's thread, which alone writes.
``threads`` runs them on local threads; ``ray`` on Ray Data (``data_pipeline/ray_runner.py``), spreading the requests
over the servers of the config's ``ray.endpoints``. Work that calls served models is handed over as
:class:`ServedWork` (``build(client)`` makes the function of one item): the thread runner builds it around the
job's client, the Ray runner around a client built on each worker for each endpoint. Work that also calls servers
of its own (a pool of teachers, each at its own URL) names them in ``pool`` and is built as ``build(client, pool)``.
A job's Ray session (joined or started) lasts as long as its fan-out, however many runs it makes (a run per layer,
or documents then chunks).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from overstory.core.config import ConfigError, differing_keys, record_settings, to_dict
from overstory.core.failures import check_failure_share, raise_if_too_many
from overstory.core.progress import JobProgress
from overstory.core.records import FailureRecord, JsonlAppender, drop_records, read_jsonl, write_jsonl
from overstory.data_pipeline.ray_runner import RayConfig, endpoint_urls, import_ray, make_work, ray_map, ray_session
from overstory.serving.client import Client, ClientError
from overstory.serving.job_client import served_models

T = TypeVar("T")

# Config keys that change how a job runs, not what it writes: left out of the recorded settings. ``serve`` is left
# out because what served the output is recorded from the server itself (``served``), whatever the config says.
OPERATIONAL_KEYS = frozenset({"out", "limit", "concurrency", "server_url", "request_timeout_s",
                              "max_failure_share", "tracking", "serve", "runner", "ray"})
# A corpus may move or grow: a run over more documents of the same corpus adds their results.
CORPUS_OPERATIONAL_KEYS = frozenset({"path", "limit_docs"})



@dataclass(frozen=True)
class ServedWork(Generic[T]):
    """Work whose model calls go through a client: ``build(client)`` returns the function of one item. The runner
    decides which client: the job's own (threads), or one per endpoint built on each Ray worker from its URL (with
    ``http_options``, as ``Client.from_url`` takes them), so nothing live crosses process boundaries.

    ``pool``: named clients of servers of their own, which the runner does not spread over the endpoints (a traces
    teacher with its own ``server_url``); with a pool, ``build(client, pool)`` gets it, the job's clients on
    threads, clients rebuilt from the same URLs on each Ray worker.

    ``served_roles``: what each endpoint must serve, as (key recorded under ``served`` -> the role that reads it on
    the endpoint); empty: every recorded key is a role (``generator``, ``embedder``)."""

    build: Callable[..., Callable[[T], Any]]
    client: Client
    http_options: dict[str, Any] = field(default_factory=dict)
    pool: Mapping[str, Client] = field(default_factory=dict)
    served_roles: Mapping[str, str] = field(default_factory=dict)


Work = Callable[[T], Any] | ServedWork
Runner = Callable[[Work, Sequence[T], int, RayConfig], Iterator[tuple[T, Any, BaseException | None]]]


def thread_runner(work: Callable[[T], Any], items: Sequence[T], concurrency: int
                  ) -> Iterator[tuple[T, Any, BaseException | None]]:
    """``work`` over ``items`` on ``concurrency`` threads; yields (item, result, None) or (item, None, exception) as
    each completes (of those that complete together, the results first, in the items' order, so that a hard error
    does not drop a finished result). Items not yet started are cancelled when the caller stops early."""
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        pending: dict[Future, T] = {pool.submit(work, item): item for item in items}
        order = {future: i for i, future in enumerate(pending)}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: (f.exception() is not None, order[f])):
                item = pending.pop(future)
                error = future.exception()
                yield item, None if error is not None else future.result(), error
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def run_threads(work: Work, items: Sequence[T], concurrency: int, _: RayConfig
                ) -> Iterator[tuple[T, Any, BaseException | None]]:
    """The ``threads`` runner: :func:`thread_runner`, a ``ServedWork`` built around the job's clients."""
    if isinstance(work, ServedWork):
        work = make_work(work.build, work.client, work.pool)
    return thread_runner(work, items, concurrency)


def run_ray(work: Work, items: Sequence[T], concurrency: int, settings: RayConfig
            ) -> Iterator[tuple[T, Any, BaseException | None]]:
    """The ``ray`` runner: ``concurrency`` Ray Data actors, the items spread over the endpoints
    (``data_pipeline/ray_runner.py``). Only ``ServedWork`` can run there: its client is rebuilt on the workers."""
    if not isinstance(work, ServedWork):
        raise ConfigError("runner: ray runs a job's model calls on Ray workers, and this job's work does not say "
                          "which client it calls through (ServedWork); use runner: threads")
    return ray_map(work.build, work.client, items, concurrency, settings, work.http_options, work.pool)


RUNNERS: dict[str, Runner] = {"threads": run_threads, "ray": run_ray}


def job_server(server_url: str, runner: str, ray: RayConfig) -> tuple[str, dict[str, Any]]:
    """The server of a job's own client (what it asks which models serve it, and what the thread runner calls), and
    that client's ``Client.from_url`` options: ``server_url``; else, on Ray with endpoints, the first of them (a
    fleet needs no stack of the job's own), with the key the workers send it (``ray.api_key_env``'s, none when
    unset), so the driver and the workers are let in or refused alike; else "" (the job starts its stack). Without
    options, ``client_for`` sends the stack's key (``serve.api_key``, else ``$OVERSTORY_API_KEY``).

    >>> job_server("", "ray", RayConfig(endpoints=["http://a:8000", "http://b:8000"], api_key_env="NO_SUCH_KEY"))
    ('http://a:8000', {'api_key': None})
    >>> job_server("", "threads", RayConfig(endpoints=["http://a:8000"]))
    ('', {})
    """
    if server_url or runner != "ray" or not ray.endpoints:
        return server_url, {}
    return ray.endpoints[0], {"api_key": ray.api_key()}


def job_settings(config: Any, drop: Collection[str] = ()) -> dict[str, Any]:
    """What decides a data job's output: its config as a dict without the operational keys (and ``drop``), and
    without the corpus's path and size.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Job:
    ...     out: str
    ...     k: int = 5
    ...     concurrency: int = 2
    >>> job_settings(Job(out="x.jsonl"))
    {'k': 5}
    """
    settings = {k: v for k, v in to_dict(config).items() if k not in OPERATIONAL_KEYS and k not in drop}
    if isinstance(settings.get("corpus"), dict):
        settings["corpus"] = {k: v for k, v in settings["corpus"].items() if k not in CORPUS_OPERATIONAL_KEYS}
    return settings


def settings_path(out: str | Path) -> Path:
    """Where the settings of the output ``out`` (a JSONL) are recorded: ``<stem>.settings.json`` beside it."""
    out = Path(out)
    return out.with_name(out.stem + ".settings.json")


def failures_path(out: str | Path) -> Path:
    """Where the failed items of the output ``out`` are listed: ``<stem>.failures.jsonl`` beside it."""
    out = Path(out)
    return out.with_name(out.stem + ".failures.jsonl")


class SettingsRecord:
    """The settings recorded beside a resumable output, checked before anything is appended to it
    (``core.config.record_settings``), with the models that served the output under ``served``."""

    REMEDY = "choose another out= or delete it to start again"

    def __init__(self, out: Path, settings: dict[str, Any], path: Path):
        self.out, self.path = out, path
        self.settings = json.loads(json.dumps(settings))  # the JSON view: tuples compare equal to stored lists
        has_results = self.out.exists() and self.out.stat().st_size > 0
        self.recorded: dict[str, Any] | None = json.loads(path.read_text()) if has_results and path.exists() else None
        # the served models recorded before are kept as they are: they are checked apart, in add_served
        self.served: dict[str, str] = dict(self.recorded.get("served", {})) if self.recorded else {}
        self._write(self.served, results=self.out if has_results else None)

    def add_served(self, served: dict[str, str]) -> None:
        """Add the models that serve this run, refusing models that differ from those recorded, by earlier runs or
        by this one (each of a fleet's endpoints must serve what the first did)."""
        known = self.served
        changed = differing_keys({k: known.get(k) for k in served if k in known},
                                 {k: v for k, v in served.items() if k in known})
        if changed:
            raise ConfigError(f"{self.out} was made with other settings ({', '.join(f'served.{k}' for k in changed)} "
                              f"differ from {self.path}); {self.REMEDY}")
        self.served = {**known, **served}
        self._write(self.served)

    def _write(self, served: dict[str, str], results: Path | None = None) -> None:
        """Record the settings with ``served``; when ``results`` is given, first refuse settings other than those
        recorded beside it."""
        record_settings(self.path, {**self.settings, **({"served": served} if served else {})}, results=results,
                        remedy=self.REMEDY)


class Fanout:
    """One resumable run over a job's items (see the module docstring): ``todo``, ``record_served``, ``run``,
    ``finish`` (the counters), ``raise_if_failed``. ``failure_types`` are the exceptions that fail one item; any
    other exception stops the job."""

    def __init__(self, job: str, out: str | Path, settings: dict[str, Any], *, concurrency: int = 1,
                 max_failure_share: float = 0.0, failure_types: tuple[type[BaseException], ...] = (ClientError,),
                 runner: str = "threads", ray: RayConfig | None = None, beside: str | Path | None = None):
        """``out`` is the JSONL whose ids mark the items done; the settings and failures files are named after
        ``beside`` (default ``out``: a job whose main output is another file keeps them next to that one).
        ``runner`` names an entry of ``RUNNERS``; ``ray`` is the Ray runner's settings (address, endpoints)."""
        check_failure_share(max_failure_share)
        if runner not in RUNNERS:
            raise ConfigError(f"runner: {runner!r} is not one of {sorted(RUNNERS)}")
        if runner == "ray":
            import_ray()  # without Ray installed, say which extra to install before any work starts
        self.job, self.concurrency, self.max_failure_share = job, concurrency, max_failure_share
        self.failure_types, self.runner, self.ray = failure_types, runner, ray or RayConfig()
        self.served: dict[str, str] = {}
        self.record = SettingsRecord(Path(out), settings, settings_path(beside or out))
        self.out = JsonlAppender(out)
        self.failures = JsonlAppender(failures_path(beside or out))
        self.counts: Counter[str] = Counter()
        self.attempted = 0
        self.failed_ids: list[str] = []  # this run's failed items, for jobs that count failures by kind
        self.also_done: list[Collection[str]] = []  # ids of final outcomes kept elsewhere (see ``todo``)
        self.item_order: dict[str, int] = {}  # every item's id, in the order ``todo`` was given them (see ``finish``)
        self.session = ExitStack()  # the Ray session of the runs, joined at the first and left at ``__exit__``
        self.in_session = False

    def todo(self, items: Iterable[T], key: Callable[[T], str], *also_done: Collection[str]) -> list[T]:
        """The items whose id is neither in the output nor in ``also_done`` (ids of final outcomes kept elsewhere);
        the rest are counted as ``skipped``. Failed items of earlier runs are in the todo: a rerun retries them."""
        items = list(items)
        self.also_done += also_done
        for item in items:
            self.item_order.setdefault(key(item), len(self.item_order))
        todo = [item for item in items if key(item) not in self.out and not any(key(item) in d for d in also_done)]
        self.counts["skipped"] += len(items) - len(todo)
        return todo

    def record_served(self, served: dict[str, str]) -> None:
        """Record the models that serve this run (role -> model, from the server); refuses other ones."""
        self.record.add_served(served)
        self.served.update(served)

    def run(self, items: Sequence[T], key: Callable[[T], str], work: Work,
            write: Callable[[T, Any], None], description: str) -> None:
        """``work`` over ``items`` on the runner; each result goes to ``write`` on this thread, each failure of
        the failure types to the failures file; any other exception stops the run."""
        if self.runner == "ray" and isinstance(work, ServedWork) and items:
            self.check_endpoints(work)
            if not self.in_session:
                self.session.enter_context(ray_session(self.ray.address))
                self.in_session = True
        with JobProgress() as progress:
            task = progress.add_task(description, total=len(items))
            for item, result, error in RUNNERS[self.runner](work, items, self.concurrency, self.ray):
                if error is None:
                    write(item, result)
                elif isinstance(error, self.failure_types):
                    self.fail(key(item), error)
                else:
                    raise error
                progress.advance(task)

    def check_endpoints(self, work: ServedWork) -> None:
        """Refuse endpoints that serve other models than those recorded for the output (each record names what
        answered it); an endpoint that does not answer is let through: its items fail, counted, and a rerun
        retries them."""
        roles = dict(work.served_roles) or {key: key for key in self.served}
        for url in endpoint_urls(self.ray, work.client):
            client = Client.from_url(url, **self.ray.http_options(work.http_options))
            try:
                served = served_models(client, list(roles.values()))
                self.record_served({key: served[role] for key, role in roles.items() if role in served})
            except ClientError:
                continue
            finally:
                client.close()

    def write(self, record: Any, kind: str = "done") -> None:
        """Append one finished item's record to the output and count it under ``kind``."""
        self.out.write(record)
        self.count(kind)

    def count(self, kind: str) -> None:
        """Count one finished item under ``kind`` (an outcome the job keeps elsewhere, such as a rejected trace)."""
        self.counts[kind] += 1
        self.attempted += 1

    def fail(self, item_id: str, error: BaseException | str | FailureRecord) -> None:
        """Record a failed item (retried by a rerun): its id, the reason, and the raw output when the error is or
        holds a ``FailureRecord`` (``error.record``)."""
        self.attempted += 1
        record = error if isinstance(error, FailureRecord) else getattr(error, "record", None)
        if not isinstance(record, FailureRecord):
            record = FailureRecord(item_id, self.job, str(error), "", 1)
        self.failures.write(record)
        self.counts["failed"] += 1
        self.failed_ids.append(item_id)

    def finish(self) -> dict[str, int]:
        """Close the files, put the output in the items' order, drop the failures that have since been written (to
        the output, or as a final outcome kept elsewhere), and return the counters (``failed``, ``skipped`` and
        ``resolved`` always among them)."""
        self.out.close()
        self.failures.close()
        _in_item_order(self.out.path, self.item_order)
        self.counts["resolved"] = drop_records(self.failures.path, set(self.out.done).union(*self.also_done))
        _keep_last_per_id(self.failures.path)
        return {"failed": 0, "skipped": 0, **self.counts}

    def raise_if_failed(self) -> None:
        """TooManyFailures when more than ``max_failure_share`` of the items attempted this run failed."""
        raise_if_too_many(self.job, {"failed": 0, "skipped": 0, **self.counts}, self.attempted,
                          self.max_failure_share, str(self.failures.path))

    def __enter__(self) -> Fanout:
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the files (again, after ``finish``; or without its checks, when an error stopped the run), and
        leave the runs' Ray session."""
        self.out.close()
        self.failures.close()
        self.session.close()


def _in_item_order(path: Path, item_order: dict[str, int]) -> None:
    """Rewrite the output (atomically, and only when it is out of order) with its records in the items' order;
    records of items this run was not given (an earlier run's, over more items) follow, by id."""
    if not path.exists():
        return
    records = list(read_jsonl(path))
    last = len(item_order)

    def position(record: dict) -> tuple[int, str]:
        record_id = str(record.get("id"))
        return item_order.get(record_id, last), record_id

    ordered = sorted(records, key=position)  # stable: records of one id keep their order
    if ordered != records:
        write_jsonl(path, ordered)


def _keep_last_per_id(path: Path) -> None:
    """Rewrite the failures file with one record per item, its latest (an item that failed again on a rerun)."""
    if not path.exists():
        return
    records = list(read_jsonl(path))
    latest = {str(r["id"]): r for r in records}
    if len(latest) < len(records):
        write_jsonl(path, latest.values())
