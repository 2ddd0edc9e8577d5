"""`overstory bench serve`: the same model on each serving engine, side by side in one run.

    overstory bench serve --config configs/bench/serve.yaml            # in-process vs embedded server
    overstory bench serve --config configs/bench/serve-vllm.yaml       # embedded server vs vLLM

Engines: ``in_process`` (``Client.in_process``: no HTTP), ``embedded`` (the embedded server on loopback)
and ``vllm`` (vLLM's OpenAI server started through ``serving.launch.vllm_stack``). For each concurrency
level the same greedy requests (real SQuAD questions, new ones at each level) go to every engine; requests/s
and p50/p95 latency are reported with ratios against the first engine listed (the baseline). A bounded load
phase then runs ``serving.load_test.mixed_load`` against every HTTP engine: a fixed number of mixed requests
(chat, streamed chat, completions, embeddings, /v1/rerank when the scorer is a cross-encoder, malformed ones)
over raw HTTP, /health probed meanwhile and the server processes' resident memory sampled; failed valid
requests, malformed requests not answered 4xx, /health answers and memory growth are reported. For vLLM the
load goes to the stack's front door (one base URL for every role): the benchmarked chat role on vLLM, the
embedding role and a cross-encoder scorer on the embedded server behind the same door. Writes ``bench.json``
and ``bench.png``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from overstory.bench.load import mixed_load
from overstory.core.config import ConfigError, to_dict
from overstory.core.plots import plt, save_figure
from overstory.core.tracking import TrackingConfig, start_run
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig, resolve_api_key
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.in_process import in_process_client
from overstory.serving.launch import serve_in_background, vllm_stack
from overstory.serving.ports import free_port

ENGINES = ("in_process", "embedded", "vllm")


@dataclass(frozen=True)
class ServeBenchConfig:
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    role: str = "generator"
    engines: list[str] = field(default_factory=lambda: ["in_process", "embedded"])  # the first is the baseline
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 8])
    requests_per_level: int = 16
    max_tokens: int = 32
    questions: str = "data/squad/dev-v2.0-articles.json"  # SQuAD (or HotpotQA questions.json): 950 distinct questions
    out: str = "runs/bench/serve"
    # bounded load phase on every HTTP engine (bench/load.py): this many mixed requests at
    # load_concurrency (0: no load phase), stopped after load_time_limit_s seconds if not done by then
    load_requests: int = 0
    load_concurrency: int = 8
    load_time_limit_s: float = 1800.0
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if self.role not in self.serve.roles:
            raise ConfigError(f"role {self.role!r} is not among serve.roles ({', '.join(self.serve.roles)})")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ConfigError("concurrency must list levels >= 1")
        if self.requests_per_level < 1:
            raise ConfigError("requests_per_level must be >= 1")
        unknown = [e for e in self.engines if e not in ENGINES]
        if unknown or not self.engines or len(set(self.engines)) != len(self.engines):
            raise ConfigError(f"engines: a list of distinct names among {', '.join(ENGINES)}, got {self.engines}")
        if self.load_requests < 0 or self.load_concurrency < 1 or self.load_time_limit_s <= 0:
            raise ConfigError("load_requests must be >= 0, load_concurrency >= 1 and load_time_limit_s > 0")


def measure(client: Client, role: str, prompts: list[list[dict]], concurrency: int, max_tokens: int) -> dict:
    """Send every prompt with ``concurrency`` workers; requests/s and latency percentiles."""
    def one(messages: list[dict]) -> tuple[float, int]:
        result = client.chat(role, messages, max_tokens=max_tokens, temperature=0)
        return result.latency_s, result.usage["completion_tokens"]

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - started
    latencies = [r[0] for r in results]
    return {"requests": len(results), "wall_s": round(wall, 3), "requests_per_s": round(len(results) / wall, 3),
            "completion_tokens_per_s": round(sum(r[1] for r in results) / wall, 1),
            "p50_s": round(float(np.percentile(latencies, 50)), 4),
            "p95_s": round(float(np.percentile(latencies, 95)), 4)}


@dataclass
class Engine:
    """One engine under test: its client, and for an HTTP engine the base URL the load phase targets, the
    roles served there (role -> ``RoleConfig.kind``, the benchmarked role first) and the server processes
    whose memory is sampled."""

    client: Client
    url: str | None = None
    roles: dict[str, str] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)


def _role_kinds(serve: ServeConfig, first: str) -> dict[str, str]:
    # the benchmarked role first: the load test sends chat requests to the first chat role
    return {name: serve.roles[name].kind for name in [first, *(r for r in serve.roles if r != first)]}


@contextmanager
def engine_clients(config: ServeBenchConfig) -> Iterator[dict[str, Engine]]:
    """engine name -> ``Engine``, each engine started once, in the order of ``config.engines``."""
    engines: dict[str, Engine] = {}
    api_key = resolve_api_key(config.serve.api_key)
    with ExitStack() as stack:
        if {"in_process", "embedded"} & set(config.engines):
            engine = stack.enter_context(EmbeddedEngine(config.serve))
            if "in_process" in config.engines:
                engines["in_process"] = Engine(in_process_client(engine))
            if "embedded" in config.engines:
                url = stack.enter_context(serve_in_background(engine, port=0))
                # the server runs in this process: its memory is this process's. MemorySampler adds children, so
                # with vllm in the same run the (then idle) vLLM servers add to the level here, not to the growth
                engines["embedded"] = Engine(Client.from_url(url, api_key=api_key), url,
                                             _role_kinds(config.serve, config.role), [os.getpid()])
        if "vllm" in config.engines:
            role = replace(config.serve.roles[config.role], port=free_port())
            # the benchmarked chat role on vLLM; the roles the embedded server keeps in a vLLM stack (embedding,
            # compression, a cross-encoder scorer) come along so that the front door serves the whole load mix.
            # Other chat roles would each start a vLLM server of their own: left out.
            kept = {name: r for name, r in config.serve.roles.items() if r.kind != "chat" and name != config.role}
            # serve.vllm_args / vllm_env / vllm_python say how vLLM runs (see ServeConfig)
            vllm_config = replace(config.serve, engine="vllm", port=0, roles={config.role: role, **kept},
                                  log_dir=str(Path(config.out) / "logs"))
            served = stack.enter_context(vllm_stack(vllm_config))
            # memory: the vLLM servers; the front door and its embedded roles live in this process
            engines["vllm"] = Engine(Client.from_url(served.roles, timeout_s=600, api_key=api_key), served.url,
                                     _role_kinds(vllm_config, config.role), [p.pid for p, _ in served.processes])
        yield {name: engines[name] for name in config.engines}


def load_questions(path: str | Path) -> list[str]:
    """Question texts from HotpotQA's ``questions.json`` (a list of records) or an official SQuAD file."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and "data" in data:  # SQuAD: data -> paragraphs -> qas
        return [qa["question"] for article in data["data"] for paragraph in article["paragraphs"]
                for qa in paragraph["qas"]]
    return [q["question"] for q in data]


def level_prompts(questions: list[str], level_index: int, n: int) -> list[list[dict]]:
    """``n`` chat prompts for one concurrency level, questions the other levels do not send (while the pool
    lasts), so that no engine answers a prompt it may have cached (vLLM's prefix cache)."""
    start = (level_index + 1) * n  # the first n are left for the warm-up
    return [[{"role": "user", "content": questions[(start + i) % len(questions)]}] for i in range(n)]


def run(config: ServeBenchConfig) -> dict:
    config = replace(config, serve=config.serve.without_embedding_cache())  # the load plan repeats its texts
    questions = load_questions(config.questions)
    warm_up = [{"role": "user", "content": questions[0]}]
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    baseline = config.engines[0]
    rows, load = [], {}
    with start_run(config.tracking, "bench serve", config) as tracker, engine_clients(config) as engines:
        for engine in engines.values():  # warm-up: the first call pays one-off costs
            engine.client.chat(config.role, warm_up, max_tokens=4, temperature=0)
        for index, level in enumerate(config.concurrency):
            prompts = level_prompts(questions, index, config.requests_per_level)
            measured = {name: measure(engine.client, config.role, prompts, level, config.max_tokens)
                        for name, engine in engines.items()}
            base = measured[baseline]
            ratios = {name: {"throughput": round(m["requests_per_s"] / base["requests_per_s"], 3),
                             "p50": round(m["p50_s"] / base["p50_s"], 3)} for name, m in measured.items()}
            rows.append({"concurrency": level, "engines": measured, "ratios": ratios})
            tracker.log({f"{name}_{key}": m[key] for name, m in measured.items()
                         for key in ("requests_per_s", "p50_s", "p95_s")}, step=level)
        if config.load_requests:
            for name, engine in engines.items():
                if engine.url is None:  # in_process: no HTTP server to load
                    continue
                load[name] = mixed_load(engine.url, engine.roles, config.load_requests, config.load_concurrency,
                                        engine.pids, config.max_tokens, api_key=resolve_api_key(config.serve.api_key),
                                        time_limit_s=config.load_time_limit_s, prompts=questions)
            # the scalar figures; per-kind counts, failures and statuses are in bench.json
            tracker.summary({f"load_{name}_{k}": v for name, r in load.items() for k, v in r.items()
                             if isinstance(v, int | float)})
    result = {"config": to_dict(config), "baseline": baseline, "results": rows, "load": load}
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    plot_serve_bench(rows, out / "bench.png")
    _print(rows, load, config)
    return result


def _print(rows: list[dict], load: dict, config: ServeBenchConfig) -> None:
    baseline = config.engines[0]
    table = Table(title=f"{config.role} ({config.serve.roles[config.role].model}), {config.requests_per_level} "
                        f"requests x {config.max_tokens} max tokens per level; ratios against {baseline}")
    for column in ("conc.", "engine", "req/s", "p50 s", "p95 s", "tokens/s", "req/s ratio", "p50 ratio"):
        table.add_column(column, justify="right")
    for r in rows:
        for name, m in r["engines"].items():
            table.add_row(str(r["concurrency"]), name, f"{m['requests_per_s']:.2f}", f"{m['p50_s']:.2f}",
                          f"{m['p95_s']:.2f}", f"{m['completion_tokens_per_s']:.1f}",
                          f"{r['ratios'][name]['throughput']:.3f}", f"{r['ratios'][name]['p50']:.3f}")
    console = Console(width=120)
    console.print(table)
    if load:
        _print_load(console, load)


def _print_load(console: Console, load: dict[str, dict]) -> None:
    table = Table(title="bounded mixed load: per request kind (valid: 2xx and a well-formed body; malformed: 4xx "
                        "with OpenAI's error body)")
    for column in ("engine", "kind", "sent", "ok", "failed", "p50 s", "p95 s"):
        table.add_column(column, justify="right")
    for name, r in load.items():
        for kind, k in r["by_kind"].items():
            table.add_row(name, kind, str(k["sent"]), str(k["ok"]), str(k["failed"]),
                          f"{k['p50_s']:.3f}" if k["p50_s"] is not None else "-",
                          f"{k['p95_s']:.3f}" if k["p95_s"] is not None else "-")
    console.print(table)
    for name, r in load.items():
        health = r["health"]
        cut = f" (TIME LIMIT: {r['requests'] - r['sent']} not sent)" if r["time_limited"] else ""
        console.print(
            f"load {name}: {r['sent']} of {r['requests']} requests at concurrency {r['concurrency']} in "
            f"{r['wall_s']} s ({r['requests_per_s']} req/s){cut}; {r['failed_valid']} valid requests failed, "
            f"{r['malformed_not_4xx']} malformed not answered 4xx, {r['malformed_bad_error_body']} 4xx without "
            f"OpenAI's error body; /health answered {health['answered']} of {health['probes']} probes (slowest "
            f"{health['max_latency_s']} s); server RSS {r['rss_first_quarter_mib']} MiB (first quarter) -> "
            f"{r['rss_last_quarter_mib']} MiB (last quarter), growth {r['rss_growth_mib']} MiB, peak "
            f"{r['rss_peak_mib']} MiB, quarter means {r['rss_quarters_mib']}", highlight=False)
        for failure in r["failures"]:
            console.print(f"  failed: #{failure['index']} {failure['case']} -> {failure['status']}: "
                          f"{failure['problem']}; {failure['body_head'][:120]!r}", highlight=False, markup=False)


def plot_serve_bench(rows: Sequence[Mapping], path: str | Path) -> Path:
    """Requests/s and p50/p95 latency against concurrency, one line per serving engine."""
    levels = [r["concurrency"] for r in rows]
    fig, (ax_rps, ax_lat) = plt.subplots(1, 2, figsize=(11, 4))
    for engine, style in zip(rows[0]["engines"], ("o-", "s--", "^-.")):
        ax_rps.plot(levels, [r["engines"][engine]["requests_per_s"] for r in rows], style, label=engine)
        ax_lat.plot(levels, [r["engines"][engine]["p50_s"] for r in rows], style, label=f"{engine} p50")
        ax_lat.plot(levels, [r["engines"][engine]["p95_s"] for r in rows], style, alpha=0.5, label=f"{engine} p95")
    for ax, title, unit in ((ax_rps, "throughput", "requests / s"), (ax_lat, "latency", "seconds")):
        ax.set_xticks(levels)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend(fontsize=8)
    return save_figure(fig, path)
