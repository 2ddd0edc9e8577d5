"""`overstory bench serve`: the same model on each serving engine, side by side in one run.

    overstory bench serve --config configs/bench/serve.yaml            # in-process vs embedded server
    overstory bench serve --config configs/bench/serve-vllm.yaml       # embedded server vs vLLM

Engines: ``in_process`` (``Client.in_process``: no HTTP), ``embedded`` (the embedded server on loopback)
and ``vllm`` (vLLM's OpenAI server started through ``serving.launch.vllm_stack``). For each concurrency
level the same greedy requests (real HotpotQA questions) go to every engine; requests/s and p50/p95 latency
are reported with ratios against the first engine listed (the baseline). A bounded load phase then sends
a fixed number of requests to every HTTP engine and samples the server processes' resident memory:
failed requests and memory growth are reported. Writes ``bench.json`` and ``bench.png`` to ``out``.
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

from overstory.core.config import ConfigError, to_dict
from overstory.core.memory import MemorySampler
from overstory.core.plots import plt, save_figure
from overstory.core.tracking import TrackingConfig, start_run
from overstory.serving.client import Client, ClientError
from overstory.serving.config import ServeConfig
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.launch import free_port, serve_in_background, vllm_stack

ENGINES = ("in_process", "embedded", "vllm")


@dataclass(frozen=True)
class ServeBenchConfig:
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    role: str = "generator"
    engines: list[str] = field(default_factory=lambda: ["in_process", "embedded"])  # the first is the baseline
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 8])
    requests_per_level: int = 16
    max_tokens: int = 32
    questions: str = "data/hotpotqa/questions.json"
    out: str = "runs/bench/serve"
    # bounded load phase on every HTTP engine: this many requests at load_concurrency (0: no load phase)
    load_requests: int = 0
    load_concurrency: int = 8
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
        if self.load_requests < 0 or self.load_concurrency < 1:
            raise ConfigError("load_requests must be >= 0 and load_concurrency >= 1")


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


def load_phase(client: Client, role: str, prompts: list[list[dict]], requests: int, concurrency: int,
               max_tokens: int, pids: list[int]) -> dict:
    """``requests`` requests at ``concurrency``; failures counted (not raised), server memory sampled."""
    failures = []

    def one(i: int) -> None:
        try:
            client.chat(role, prompts[i % len(prompts)], max_tokens=max_tokens, temperature=0)
        except ClientError as exc:
            failures.append(f"{exc.status}: {exc.reason}")

    started = time.perf_counter()
    with MemorySampler(pids) as memory, ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, range(requests)))
    samples = memory.samples or [memory.rss_mib()]
    quarter = max(1, len(samples) // 4)
    return {"requests": requests, "concurrency": concurrency, "failed": len(failures), "errors": failures[:5],
            "wall_s": round(time.perf_counter() - started, 2),
            "rss_first_quarter_mib": round(float(np.mean(samples[:quarter])), 1),
            "rss_last_quarter_mib": round(float(np.mean(samples[-quarter:])), 1),
            "rss_peak_mib": round(max(samples), 1)}


@contextmanager
def engine_clients(config: ServeBenchConfig) -> Iterator[dict[str, tuple[Client, list[int]]]]:
    """engine name -> (client, server process ids for the memory samples), each engine started once."""
    clients: dict[str, tuple[Client, list[int]]] = {}
    with ExitStack() as stack:
        if {"in_process", "embedded"} & set(config.engines):
            engine = EmbeddedEngine(config.serve)
            if "in_process" in config.engines:
                clients["in_process"] = (Client.in_process(engine), [os.getpid()])
            if "embedded" in config.engines:
                url = stack.enter_context(serve_in_background(engine, port=0))
                clients["embedded"] = (Client.from_url(url), [os.getpid()])
        if "vllm" in config.engines:
            role = replace(config.serve.roles[config.role], port=free_port())
            # serve.vllm_args / vllm_env / vllm_python say how vLLM runs (see ServeConfig)
            vllm_config = replace(config.serve, engine="vllm", port=0, roles={config.role: role},
                                  log_dir=str(Path(config.out) / "logs"))
            roles, processes = stack.enter_context(vllm_stack(vllm_config))
            clients["vllm"] = (Client.from_url(roles, timeout_s=600), [p.pid for p, _ in processes])
        yield {name: clients[name] for name in config.engines}


def run(config: ServeBenchConfig) -> dict:
    questions = [q["question"] for q in json.loads(Path(config.questions).read_text())]
    prompts = [[{"role": "user", "content": questions[i % len(questions)]}] for i in range(config.requests_per_level)]
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    baseline = config.engines[0]
    rows, load = [], {}
    with start_run(config.tracking, "bench serve", config) as tracker, engine_clients(config) as clients:
        for client, _ in clients.values():  # warm-up: the first call pays one-off costs
            client.chat(config.role, prompts[0], max_tokens=4, temperature=0)
        for level in config.concurrency:
            measured = {name: measure(client, config.role, prompts, level, config.max_tokens)
                        for name, (client, _) in clients.items()}
            base = measured[baseline]
            ratios = {name: {"throughput": round(m["requests_per_s"] / base["requests_per_s"], 3),
                             "p50": round(m["p50_s"] / base["p50_s"], 3)} for name, m in measured.items()}
            rows.append({"concurrency": level, "engines": measured, "ratios": ratios})
            tracker.log({f"{name}_{key}": m[key] for name, m in measured.items()
                         for key in ("requests_per_s", "p50_s", "p95_s")}, step=level)
        if config.load_requests:
            for name, (client, pids) in clients.items():
                if name != "in_process":
                    load[name] = load_phase(client, config.role, prompts, config.load_requests,
                                            config.load_concurrency, config.max_tokens, pids)
            tracker.summary({f"load_{name}_{k}": v for name, r in load.items() for k, v in r.items() if k != "errors"})
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
    Console(width=120).print(table)
    for name, r in load.items():
        print(f"load {name}: {r['requests']} requests at concurrency {r['concurrency']} in {r['wall_s']} s, "
              f"{r['failed']} failed; server RSS {r['rss_first_quarter_mib']} MiB (first quarter) -> "
              f"{r['rss_last_quarter_mib']} MiB (last quarter), peak {r['rss_peak_mib']} MiB")


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
