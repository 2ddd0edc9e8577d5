"""`overstory bench retrieval`: the retrieval endpoint's bounded load test (``bench/retrieval_load.py``) as a command.

    overstory bench retrieval --config configs/bench/retrieval-load.yaml
    overstory bench retrieval --config configs/bench/retrieval-load.yaml url=http://127.0.0.1:8000 retriever=""

It builds nothing: ``retriever`` names a folder that ``overstory index build`` (or ``Retriever.save``) wrote, served
here beside ``serve``'s roles the way ``overstory serve --retriever`` serves it (``overstory/serve.py``'s
``served_retriever`` over the engine's in-process client, the server's app on loopback; with ``engine: vllm`` on the
stack's front door), or ``url`` names a server already running. The plan (one-query and batched ``/v1/retrieve``,
Search-R1's ``/retrieve``, malformed requests; ``requests``, ``concurrency``, ``k``, ``seed``) goes out after
``warm_up`` requests of another seed that are not counted (thread pools and allocator arenas reach their working size).

Writes ``metrics.json`` (failed valid requests, each malformed case's statuses beside the one expected, latency p50/p95
per request kind, /health during the load, resident memory by quarter, requests/s) and ``load.png`` beside it, and
prints a table. Memory is the serving process's (this one, with the vLLM servers for ``engine: vllm``); for ``url`` it
is sampled only for the ``server_pids`` given, and otherwise recorded as not sampled. The job exits 1 (after writing
its files) when a valid request failed or a malformed one was not answered with a 4xx in OpenAI's error shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console
from rich.table import Table

from overstory.bench.load import DEFAULT_PROMPTS
from overstory.bench.retrieval_load import BATCH_SIZES, RETRIEVAL_MALFORMED, RETRIEVAL_WEIGHTS, retrieval_load
from overstory.bench.serve import load_questions
from overstory.core.config import ConfigError, to_dict
from overstory.core.failures import TooManyFailures
from overstory.core.plots import plt, save_figure
from overstory.core.tracking import TrackingConfig, start_run
from overstory.serve import served_retriever
from overstory.serving.config import ServeConfig, resolve_api_key
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.in_process import in_process_client
from overstory.serving.launch import serve_in_background, vllm_stack
from overstory.serving.server import create_app

MEMORY_KEYS = ("rss_samples", "rss_first_quarter_mib", "rss_last_quarter_mib", "rss_peak_mib", "rss_growth_mib",
               "rss_quarters_mib")


@dataclass(frozen=True)
class RetrievalBenchConfig:
    """`overstory bench retrieval`: what is loaded (a saved retriever served here, or a running server's URL), the
    plan of requests, and where the metrics go."""

    retriever: str = "runs/index/hotpotqa-naive"  # a saved retriever folder, served here (`overstory index build`)
    url: str = ""  # a running `overstory serve --retriever` (base URL, no /v1) to load instead of serving one here
    server_pids: list[int] = field(default_factory=list)  # url: the server's processes on this machine (memory)
    # the roles the served retriever calls (its embedder must be the one it was saved with); retriever_max_k and
    # retriever_max_queries bound the requests as `overstory serve` does; api_key (else $OVERSTORY_API_KEY) is sent
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    requests: int = 400
    concurrency: int = 8
    k: int = 3  # chunks per query in the valid requests that name k (Search-R1's topk)
    seed: int = 0
    warm_up: int = 40  # requests sent first (seed + 1) and not counted; 0: none
    weights: dict[str, float] = field(default_factory=lambda: dict(RETRIEVAL_WEIGHTS))  # request kinds in the mix
    questions: str = "data/hotpotqa/questions.json"  # the queries: HotpotQA questions.json or a SQuAD file
    time_limit_s: float = 1800.0  # the load stops by itself after this long (requests not started are not sent)
    out: str = "runs/bench/retrieval-load"
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if bool(self.retriever) == bool(self.url):
            raise ConfigError("retriever / url: name a saved retriever folder to serve here, or the url of a running "
                              f"server, not {'both' if self.url else 'neither'}")
        if self.server_pids and not self.url:
            raise ConfigError("server_pids: the processes of a server at url; a retriever served here is this process")
        if min(self.requests, self.concurrency, self.k) < 1 or self.warm_up < 0 or self.time_limit_s <= 0:
            raise ConfigError("requests, concurrency and k must be >= 1, warm_up >= 0 and time_limit_s > 0")
        if unknown := sorted(set(self.weights) - set(RETRIEVAL_WEIGHTS)):
            raise ConfigError(f"weights: unknown request kind(s) {', '.join(unknown)}; kinds are "
                              f"{', '.join(RETRIEVAL_WEIGHTS)}")
        if not any(w > 0 for w in self.weights.values()) or min(self.weights.values()) < 0:
            raise ConfigError("weights: give at least one kind a weight > 0, none below 0")
        if self.k > self.serve.retriever_max_k:
            raise ConfigError(f"k={self.k} is past serve.retriever_max_k={self.serve.retriever_max_k}: every valid "
                              "request would be refused")
        if self.serve.retriever_max_queries < BATCH_SIZES[1]:
            raise ConfigError(f"serve.retriever_max_queries must be >= {BATCH_SIZES[1]}, the largest batch sent")


class Target(NamedTuple):
    """What the load goes to: a base URL, the processes whose memory is sampled, and what it serves."""

    url: str
    pids: list[int]
    served: dict[str, Any]


@contextmanager
def serve_here(config: RetrievalBenchConfig) -> Iterator[Target]:
    """The saved retriever served in this process as ``overstory serve --retriever`` serves it: on the embedded
    engine's app (its roles called in-process), or on a vLLM stack's front door."""
    # the plan repeats its queries: each is embedded every time, as a benchmark of the retriever, not of the cache
    serve = dataclasses.replace(config.serve.without_embedding_cache(), retriever=config.retriever)
    with ExitStack() as owned:
        if serve.engine == "vllm":
            stack = owned.enter_context(vllm_stack(serve, retrieval=lambda client: owned.enter_context(
                served_retriever(serve, client))))
            service, url = stack.retriever, stack.url
            pids = [os.getpid(), *(process.pid for process, _ in stack.processes)]
        else:
            engine = owned.enter_context(EmbeddedEngine(serve))
            service = owned.enter_context(served_retriever(serve, in_process_client(engine)))
            url = owned.enter_context(serve_in_background(create_app(engine, service), port=serve.port,
                                                          host=serve.host))
            pids = [os.getpid()]
        yield Target(url, pids, {"retriever": config.retriever, "engine": serve.engine,
                                 "strategy": service.strategy, "documents": service.document_count()})


@contextmanager
def target(config: RetrievalBenchConfig) -> Iterator[Target]:
    """The server under load: a running one at ``url``, or the saved ``retriever`` served here."""
    if config.url:
        yield Target(config.url.rstrip("/").removesuffix("/v1"), list(config.server_pids), {"url": config.url})
    else:
        with serve_here(config) as here:
            yield here


def unsampled_memory(report: dict) -> dict:
    """``report`` with its memory figures as None: with no process to sample, the sampler's zeros are no figure."""
    return {**report, **dict.fromkeys(MEMORY_KEYS), "memory": "not sampled: give server_pids for a server at url"}


def run(config: RetrievalBenchConfig) -> dict:
    """Warm up, send the plan, write metrics.json and load.png, print the table; exit 1 on a failed request."""
    queries = load_questions(config.questions) if config.questions else list(DEFAULT_PROMPTS)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    api_key = resolve_api_key(config.serve.api_key)
    options = {"k": config.k, "api_key": api_key, "time_limit_s": config.time_limit_s, "weights": config.weights,
               "queries": queries}
    with start_run(config.tracking, "bench retrieval", config) as tracker, target(config) as under_load:
        warm = None
        if config.warm_up:
            warm = retrieval_load(under_load.url, config.warm_up, config.concurrency, under_load.pids,
                                  seed=config.seed + 1, **options)
        report = retrieval_load(under_load.url, config.requests, config.concurrency, under_load.pids,
                                seed=config.seed, **options)
        if not under_load.pids:
            report = unsampled_memory(report)
        tracker.summary({key: value for key, value in report.items() if isinstance(value, int | float)})
    metrics = {"config": to_dict(config), "target": under_load.served,
               "warm_up": warm and {"sent": warm["sent"], "failed_valid": warm["failed_valid"]},
               "malformed_expected": {name: expect for name, expect, *_ in RETRIEVAL_MALFORMED}, **report}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    plot_load(metrics, out / "load.png")
    print_load(metrics)
    raise_if_failed(metrics)
    return metrics


def raise_if_failed(metrics: dict) -> None:
    """``TooManyFailures`` when a valid request failed or a malformed one was not a 4xx in the error shape."""
    counts = {key: metrics[key] for key in ("failed_valid", "malformed_not_4xx", "malformed_bad_error_body")}
    if any(counts.values()):
        raise TooManyFailures(f"the retrieval endpoint failed the load test: {counts} (metrics.json lists the first "
                              "failures)", counts)


def print_load(metrics: dict) -> None:
    """Per request kind: sent, ok, failed, latency p50/p95; then the malformed statuses and the run's figures."""
    target_line = metrics["target"].get("url") or (f"the {metrics['target']['strategy']} retriever of "
                                                   f"{metrics['target']['retriever']} "
                                                   f"({metrics['target']['documents']} documents)")
    table = Table(title=f"retrieval load on {target_line}: {metrics['sent']} of {metrics['requests']} requests at "
                        f"concurrency {metrics['concurrency']}")
    for column in ("kind", "sent", "ok", "failed", "p50 s", "p95 s"):
        table.add_column(column, justify="right")
    for kind, row in metrics["by_kind"].items():
        table.add_row(kind, str(row["sent"]), str(row["ok"]), str(row["failed"]),
                      *(f"{row[key]:.3f}" if row[key] is not None else "-" for key in ("p50_s", "p95_s")))
    console = Console(width=120)
    console.print(table)
    expected = metrics["malformed_expected"]
    wrong = {name: got for name, got in metrics["malformed_statuses"].items() if got != [expected[name]]}
    memory = (f"RSS {metrics['rss_first_quarter_mib']} -> {metrics['rss_last_quarter_mib']} MiB (growth "
              f"{metrics['rss_growth_mib']} MiB, quarter means {metrics['rss_quarters_mib']})"
              if metrics["rss_quarters_mib"] is not None else metrics["memory"])
    console.print(f"{metrics['requests_per_s']} requests/s; {metrics['failed_valid']} valid requests failed; "
                  f"{metrics['malformed_not_4xx']} malformed not 4xx, {metrics['malformed_bad_error_body']} without "
                  f"the error body; malformed statuses other than expected: {wrong or 'none'}; /health answered "
                  f"{metrics['health']['answered']} of {metrics['health']['probes']}; {memory}"
                  f"{'; TIME LIMIT reached' if metrics['time_limited'] else ''}", highlight=False)
    for failure in metrics["failures"]:
        console.print(f"  failed: #{failure['index']} {failure['case']} -> {failure['status']}: {failure['problem']}",
                      highlight=False, markup=False)


def plot_load(metrics: dict, path: str | Path) -> Path:
    """Latency p50/p95 per request kind, and the resident memory's quarter means (flat: no leak)."""
    fig, (ax_lat, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    kinds = list(metrics["by_kind"])
    positions = range(len(kinds))
    for offset, key in ((-0.2, "p50_s"), (0.2, "p95_s")):
        ax_lat.bar([p + offset for p in positions], [metrics["by_kind"][k][key] or 0 for k in kinds], width=0.4,
                   label=key.removesuffix("_s"))
    ax_lat.set_xticks(list(positions), kinds, rotation=20)
    ax_lat.set_ylabel("seconds")
    ax_lat.set_title(f"latency per request kind ({metrics['requests_per_s']} requests/s)")
    ax_lat.legend(fontsize=8)
    quarters = metrics["rss_quarters_mib"]
    if quarters:
        ax_mem.plot(range(1, len(quarters) + 1), quarters, "o-")
        ax_mem.set_xticks(range(1, len(quarters) + 1))
        ax_mem.set_ylim(0, max(quarters) * 1.1)  # from zero: a few MiB of warm-up is not drawn as a climb
    else:
        ax_mem.text(0.5, 0.5, metrics.get("memory", "no samples"), ha="center", va="center", wrap=True)
    ax_mem.set_xlabel("quarter of the run")
    ax_mem.set_ylabel("resident memory, MiB")
    ax_mem.set_title(f"server memory by quarter (growth {metrics['rss_growth_mib']} MiB)")
    return save_figure(fig, path)
