"""``runner: ray``: the fan-out's items on Ray Data, their model calls spread over several OpenAI-compatible servers.

The shape is Ray Data's own for LLM requests to hosted endpoints (``ray.data.llm``'s HTTP request processor): the
items become a dataset, a stateful UDF (one per actor of a pool of ``concurrency`` actors) builds its HTTP clients
once, from URLs, on the worker, and answers every row; a row whose request fails comes back as a row carrying its
error instead of failing the dataset. Here the UDF runs the job's own work function, rebuilt on the worker around a
client for each endpoint (``build(client)``: nothing live is pickled), and item ``i`` goes to endpoint
``i % len(endpoints)``. One row per block, so every item is a task of its own: the actors share the items as they
free up, and each result streams back to the driver as soon as it is done, where the fan-out writes it (the output,
its resumability by id and the failure records stay the driver's, exactly as with the thread runner).

Work may also call servers of its own that are not spread (a traces teacher with its own ``server_url``): its
``pool`` of named clients is rebuilt on each worker from their URLs, once (with the same options and key as the
endpoints' clients), and handed to ``build`` beside the endpoint's client.

Settings (a job config's ``ray:`` section, used when ``runner: ray``): ``address`` ("" starts a local Ray for the
job; ``auto`` joins the cluster this node belongs to, started with ``ray start --head``; ``ray://host:10001`` a
remote one through Ray Client), ``endpoints`` (base URLs; empty: the job's own server) and ``api_key_env`` (the
environment variable, on the node that runs the command, whose value the workers send as ``Authorization: Bearer``
to every endpoint and to the pool's servers, and the job's own client too when it is the first endpoint:
``fanout.job_server``; servers started with an API key refuse requests without it).
"""

from __future__ import annotations

import os
import pickle
import re
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from overstory.core.config import ConfigError
from overstory.serving.client import Client, RoleStats, UsageStats

T = TypeVar("T")

INSTALL_HINT = "runner: ray needs Ray Data: pip install 'overstory[ray]' (the `ray` extra, ray[data])"
_ADDRESS = re.compile(r"^(|auto|ray://[^/\s]+|[^/\s:]+:\d+)$")


@dataclass(frozen=True)
class RayConfig:
    # "" = a local Ray started for the job; "auto" = the cluster of `ray start`; "ray://head:10001"; "head:6379"
    address: str = ""
    # OpenAI-compatible base URLs (several vLLM servers, or stacks on several nodes); empty = the job's own server
    endpoints: list[str] = field(default_factory=list)
    # the environment variable holding the endpoints' API key (the one `overstory serve` reads); unset or empty:
    # no key is sent. The key itself is never part of a config, so it is neither recorded nor tracked.
    api_key_env: str = "OVERSTORY_API_KEY"

    def __post_init__(self) -> None:
        if not _ADDRESS.match(self.address):
            raise ConfigError(f"ray.address: {self.address!r} is not '', 'auto', 'ray://host:port' or 'host:port'")
        for i, url in enumerate(self.endpoints):
            if not re.match(r"^https?://\S+$", url):
                raise ConfigError(f"ray.endpoints[{i}]: {url!r} is not an http(s):// base URL")
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", self.api_key_env):
            raise ConfigError(f"ray.api_key_env: {self.api_key_env!r} is not an environment variable's name")

    def api_key(self) -> str | None:
        """The key the job sends on Ray: ``api_key_env``'s value on this node; None (no key) when unset or blank."""
        return os.environ.get(self.api_key_env, "").strip() or None

    def http_options(self, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``options`` (``Client.from_url``'s) for the clients of a job on Ray (the endpoints', the pool's), with
        the API key read from ``api_key_env`` unless ``options`` already name one."""
        key = self.api_key()
        return {**({"api_key": key} if key else {}), **(options or {})}


def import_ray() -> Any:
    """The ``ray`` module with Ray Data, or an ImportError that names the extra to install."""
    try:
        import ray
        import ray.data  # noqa: F401  (Ray Data is an extra of ray: ray[data])
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT}: {exc}") from exc
    return ray


def endpoint_urls(settings: RayConfig, client: Client) -> list[Any]:
    """The servers the items are spread over: the configured endpoints, else the job's own server (a URL, or a
    role -> URL mapping for a vLLM stack)."""
    if settings.endpoints:
        return list(settings.endpoints)
    return [client_url(client, "ray.endpoints")]


def client_url(client: Client, key: str) -> Any:
    """The server of ``client`` (a URL, or a role -> URL mapping), from which a worker builds its own client; an
    in-process client has none, which ``key`` (the setting to give instead) is named for."""
    urls = getattr(client.backend, "urls", None)
    if urls is None:
        raise ConfigError(f"{key}: the job's client is in-process; runner: ray needs servers over HTTP "
                          "(ray.endpoints, or server_url)")
    return urls


def make_work(build: Callable[..., Callable[[T], Any]], client: Client, pool: Mapping[str, Client]
              ) -> Callable[[T], Any]:
    """The function of one item: ``build(client)``, or ``build(client, pool)`` for work with a pool of servers of
    its own (the one rule, for the thread runner and the Ray workers alike)."""
    return build(client, pool) if pool else build(client)


@contextmanager
def ray_session(address: str) -> Iterator[None]:
    """Ray for the block: joined (or, for address "", started), and shut down at its end when started here; a
    process already connected keeps its connection. A job holds one for all its fan-out runs."""
    ray = import_ray()
    started = _connect(ray, address)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


class EndpointWorker:
    """Ray Data's stateful UDF: one per actor, holding a client and the job's work for each endpoint, built here on
    the worker from the URLs (with the pool's clients, from theirs); each row runs one item and returns its result
    or its error, and the calls it made through the endpoint's client."""

    def __init__(self, build: Callable[..., Callable[[Any], Any]], endpoints: list[Any],
                 http_options: dict[str, Any], pool_urls: dict[str, Any]):
        self.clients = [Client.from_url(url, **http_options) for url in endpoints]
        self.pool = {name: Client.from_url(url, **http_options) for name, url in pool_urls.items()}
        self.works = [make_work(build, client, self.pool) for client in self.clients]

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        """Run each row's item on its endpoint (an actor runs one batch at a time, so swapping in fresh
        accounting before the item counts exactly that item's calls)."""
        rows: dict[str, list] = {"index": [], "result": [], "error": [], "stats": []}
        for index, endpoint, item in zip(batch["index"], batch["endpoint"], batch["item"]):
            client = self.clients[int(endpoint)]
            client.stats = UsageStats()
            for own in self.pool.values():
                own.stats = UsageStats()
            result, error = None, None
            try:
                result = self.works[int(endpoint)](loads(item))
            except Exception as exc:  # every error goes back to the driver, which decides: a failure, or a stop
                error = _portable_error(exc)
            rows["index"].append(int(index))
            rows["result"].append(dumps(result))
            rows["error"].append(dumps(error))
            rows["stats"].append(dumps({"endpoint": client.stats.roles,
                                        **{name: own.stats.roles for name, own in self.pool.items()}}))
        return rows


def ray_map(build: Callable[..., Callable[[T], Any]], client: Client, items: Sequence[T], concurrency: int,
            settings: RayConfig, http_options: dict[str, Any] | None = None,
            pool: Mapping[str, Client] | None = None) -> Iterator[tuple[T, Any, BaseException | None]]:
    """``make_work(build, ...)``'s work over ``items`` on Ray Data (see the module docstring); yields (item, result,
    None) or (item, None, error) as each completes, each item once, and adds the workers' calls to ``client.stats``
    (those through the pool's servers to the pool's clients)."""
    if not items:
        return
    pool = pool or {}
    with ray_session(settings.address):
        ray = import_ray()
        ray.data.DataContext.get_current().enable_progress_bars = False  # the fan-out shows its own progress
        endpoints = endpoint_urls(settings, client)
        dataset = ray.data.from_items(
            [{"index": i, "endpoint": i % len(endpoints), "item": dumps(item)} for i, item in enumerate(items)],
            override_num_blocks=len(items))
        results = dataset.map_batches(
            EndpointWorker, batch_size=1, concurrency=min(concurrency, len(items)),
            fn_constructor_kwargs={"build": build, "endpoints": endpoints,
                                   "http_options": settings.http_options(http_options),
                                   "pool_urls": {name: client_url(own, f"pool {name}") for name, own in pool.items()}})
        seen: set[int] = set()
        for row in results.iter_rows():
            index = int(row["index"])
            if index in seen:  # a retried task's row that already came back
                continue
            seen.add(index)
            stats = loads(row["stats"])
            client.stats.absorb(_stats(stats.pop("endpoint")))
            for name, roles in stats.items():
                pool[name].stats.absorb(_stats(roles))
            error = loads(row["error"])
            yield items[index], (None if error else loads(row["result"])), (_rebuilt_error(error) if error else None)


def _connect(ray: Any, address: str) -> bool:
    """Join (or, for address "", start) Ray unless this process is already connected; True when started here."""
    if ray.is_initialized():
        return False
    ray.init(address=address or None, **({} if address else {"include_dashboard": False}), log_to_driver=False)
    return True


def dumps(value: Any) -> bytes:
    """``value`` pickled: items, results, errors and accounting travel as bytes columns (the records are
    dataclasses; the work function itself travels with Ray's own cloudpickle, as the UDF's constructor argument)."""
    return pickle.dumps(value)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def _portable_error(exc: Exception) -> tuple[type, tuple, dict, str]:
    """An exception as its class, args, attributes and traceback: exceptions whose ``__init__`` takes other
    arguments than their ``args`` (``ClientError``) do not survive pickling as themselves."""
    return type(exc), exc.args, dict(vars(exc)), "".join(traceback.format_exception(exc))


def _rebuilt_error(error: tuple[type, tuple, dict, str]) -> BaseException:
    """The worker's exception again, of its own class and with its attributes (a ``ClientError``'s status, a
    ``SummaryFailed``'s failure record), with the worker's traceback as a note."""
    cls, args, attributes, trace = error
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(attributes)
    exc.add_note(f"raised on a Ray worker:\n{trace}")
    return exc


def _stats(roles: dict[str, RoleStats]) -> UsageStats:
    stats = UsageStats()
    stats.roles = roles
    return stats
