"""`overstory bench serve`: the embedded server's throughput and latency next to in-process calls.

    overstory bench serve --config configs/bench/serve.yaml

One engine is loaded once. For each concurrency level the same greedy requests (real HotpotQA
questions) run first in-process (``Client.in_process``) and then over HTTP against the embedded
server on loopback; the ratio of the two is the serving overhead (HTTP, JSON, FastAPI, threads).
Writes ``bench.json`` and ``bench.png`` to ``out``.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from evaluation.plots import plot_serve_bench
from overstory.config import ConfigError, to_dict
from overstory.tracking import TrackingConfig, start_run
from serving.client import Client
from serving.config import ServeConfig
from serving.engine import EmbeddedEngine
from serving.launch import serve_in_background


@dataclass(frozen=True)
class ServeBenchConfig:
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    role: str = "generator"
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 8])
    requests_per_level: int = 16
    max_tokens: int = 32
    questions: str = "data/hotpotqa/questions.json"
    out: str = "runs/bench/serve"
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if self.role not in self.serve.roles:
            raise ConfigError(f"role {self.role!r} is not among serve.roles ({', '.join(self.serve.roles)})")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ConfigError("concurrency must list levels >= 1")
        if self.requests_per_level < 1:
            raise ConfigError("requests_per_level must be >= 1")


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


def run(config: ServeBenchConfig) -> dict:
    questions = [q["question"] for q in json.loads(Path(config.questions).read_text())]
    prompts = [[{"role": "user", "content": questions[i % len(questions)]}] for i in range(config.requests_per_level)]
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = EmbeddedEngine(config.serve)
    in_process = Client.in_process(engine)
    in_process.chat(config.role, prompts[0], max_tokens=4)  # warm-up: first call pays one-off costs
    rows = []
    with start_run(config.tracking, "bench serve", config) as tracker, serve_in_background(engine, port=0) as url:
        http = Client.from_url(url)
        for level in config.concurrency:
            local = measure(in_process, config.role, prompts, level, config.max_tokens)
            remote = measure(http, config.role, prompts, level, config.max_tokens)
            row = {"concurrency": level, "in_process": local, "http": remote,
                   "throughput_ratio": round(remote["requests_per_s"] / local["requests_per_s"], 3),
                   "p50_ratio": round(remote["p50_s"] / local["p50_s"], 3)}
            rows.append(row)
            tracker.log({"http_rps": remote["requests_per_s"], "in_process_rps": local["requests_per_s"],
                         "throughput_ratio": row["throughput_ratio"], "p50_ratio": row["p50_ratio"]}, step=level)
    result = {"config": to_dict(config), "results": rows}
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    plot_serve_bench(rows, out / "bench.png")
    _print(rows, config)
    return result


def _print(rows: list[dict], config: ServeBenchConfig) -> None:
    table = Table(title=f"{config.role} ({config.serve.roles[config.role].model}), {config.requests_per_level} "
                        f"requests x {config.max_tokens} max tokens per level")
    for column in ("conc.", "local req/s", "HTTP req/s", "req/s ratio", "local p50/p95 s", "HTTP p50/p95 s",
                   "p50 ratio"):
        table.add_column(column, justify="right")
    for r in rows:
        local, remote = r["in_process"], r["http"]
        table.add_row(str(r["concurrency"]), f"{local['requests_per_s']:.2f}", f"{remote['requests_per_s']:.2f}",
                      f"{r['throughput_ratio']:.3f}", f"{local['p50_s']:.2f}/{local['p95_s']:.2f}",
                      f"{remote['p50_s']:.2f}/{remote['p95_s']:.2f}", f"{r['p50_ratio']:.3f}")
    Console(width=110).print(table)
    print("local = in-process calls on the same engine; overhead of HTTP: req/s ratio = HTTP / local "
          "(below 1 costs throughput), p50 ratio = HTTP / local median latency (above 1 adds latency)")
