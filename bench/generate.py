"""`overstory bench generate`: batched generation of one chat model under several settings, side by side.

    overstory bench generate --config configs/bench/generate.yaml        # CPU: float32 against bfloat16
    overstory bench generate --config configs/bench/generate-gpu.yaml    # one GPU: float32 against bfloat16

Each variant is the embedded engine's chat role with some settings changed (``dtype``, ``device``,
``max_batch_size``, ...: any ``RoleConfig`` field); it is loaded alone, warmed up, and sent the same greedy
requests (real SQuAD questions, new ones at each level) at each concurrency level through the in-process client,
so the engine's batcher groups concurrent requests into one ``generate`` call as it does when serving. Reported
per (variant, level): completion tokens/s, requests/s, p50/p95 latency, and the mean rows per ``generate`` call
the batcher actually formed; ratios against the first variant at the same level; with ``plain_generate``, also
transformers ``generate`` alone on the same model and prompts, from the main thread and from a worker thread, the
baseline for the engine's own overhead.
Writes ``bench.json`` and ``bench.png`` (tokens/s against concurrency) to ``out``. ``bench serve`` compares
engines (HTTP against in-process, vLLM) for one setting; this compares settings of the embedded engine.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from overstory.bench.serve import level_prompts, load_questions, measure
from overstory.core.config import ConfigError, to_dict
from overstory.core.plots import plt, save_figure
from overstory.core.tracking import TrackingConfig, start_run
from overstory.models.registry import SMOLLM2
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.in_process import in_process_client

ROLE = "generator"


@dataclass(frozen=True)
class GenerateBenchConfig:
    model: str = SMOLLM2
    # RoleConfig fields every variant starts from (device, max_batch_size, max_batch_tokens, ...)
    role: dict[str, Any] = field(default_factory=dict)
    # variant name -> the RoleConfig fields it changes; the first is the baseline
    variants: dict[str, dict[str, Any]] = field(default_factory=lambda: {
        "float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"}})
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    requests_per_level: int = 32  # raised to the level where the level is larger, so every level fills
    max_tokens: int = 64
    questions: str = "data/squad/dev-v2.0-articles.json"
    out: str = "runs/bench/generate"
    # also time plain transformers `generate` on each variant's loaded model, the level's prompts in one left-padded
    # batch (no batcher, no prefix sharing, no per-row stopping): what the engine's path around `generate` costs
    plain_generate: bool = False
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if not self.variants:
            raise ConfigError("variants must name at least one variant")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ConfigError("concurrency must list levels >= 1")
        if self.requests_per_level < 1 or self.max_tokens < 1:
            raise ConfigError("requests_per_level and max_tokens must be >= 1")
        for name in self.variants:
            self.role_config(name)  # a bad field or value names its variant now, not after the first variant ran

    def role_config(self, variant: str) -> RoleConfig:
        known = {f.name for f in fields(RoleConfig)} - {"model", "kind"}
        settings = {**self.role, **self.variants[variant]}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(f"variants.{variant} (or role): unknown RoleConfig fields {unknown}; known: "
                              f"{', '.join(sorted(known))}")
        try:
            return RoleConfig(model=self.model, **settings)
        except (ConfigError, TypeError) as exc:
            raise ConfigError(f"variants.{variant}: {exc}") from exc


def mean_batch_rows(calls: list[tuple[int, int]]) -> float:
    """Mean rows per ``generate`` call, from the batcher's ``recent_batches`` records (rows, shared prefix).

    >>> mean_batch_rows([(8, 24), (8, 24), (2, 0)])
    6.0
    """
    return round(sum(rows for rows, _ in calls) / len(calls), 2) if calls else 0.0


def run_variant(config: GenerateBenchConfig, variant: str, questions: list[str]) -> dict[int, dict]:
    """Concurrency level -> measurement for one variant, its model loaded for this variant alone."""
    serve = ServeConfig(port=0, roles={ROLE: config.role_config(variant)})
    measured = {}
    with EmbeddedEngine(serve) as engine:
        client = in_process_client(engine)
        client.chat(ROLE, [{"role": "user", "content": questions[0]}], max_tokens=4, temperature=0)  # warm-up
        for index, level in enumerate(config.concurrency):
            prompts = level_prompts(questions, index, max(config.requests_per_level, level))
            calls = engine.batcher(ROLE).recent_batches
            calls.clear()  # this level's generate calls only (it keeps the last 256)
            result = measure(client, ROLE, prompts, level, config.max_tokens)
            measured[level] = {**result, "rows_per_generate": mean_batch_rows(list(calls))}
            if config.plain_generate:
                batcher, prompts_at_level = engine.batcher(ROLE), prompts[:level]
                measured[level]["plain_generate_tokens_per_s"] = plain_generate_rate(
                    batcher, prompts_at_level, config.max_tokens)
                # the same call from a thread of its own, as the batcher's worker runs generate: tells a cost of
                # the engine's path from one of running off the main thread
                with ThreadPoolExecutor(max_workers=1) as worker:
                    measured[level]["plain_generate_thread_tokens_per_s"] = worker.submit(
                        plain_generate_rate, batcher, prompts_at_level, config.max_tokens).result()
    return measured


def plain_generate_rate(batcher, prompts: list[list[dict]], max_tokens: int) -> float:
    """Completion tokens/s of one greedy transformers ``generate`` call over ``prompts`` (chat-templated, left
    padded) on the batcher's model, the batcher idle; tokens after a row's end of sequence are not counted."""
    model, tokenizer = batcher.model, batcher.tokenizer
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left").to(model.device)
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)  # warm-up
        _synchronize(model.device)
        started = time.perf_counter()
        output = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
        _synchronize(model.device)
    wall = time.perf_counter() - started
    new = output[:, inputs["input_ids"].shape[1]:].tolist()
    eos = tokenizer.eos_token_id
    tokens = sum(row.index(eos) + 1 if eos in row else len(row) for row in new)
    return round(tokens / wall, 1)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(config: GenerateBenchConfig) -> dict:
    questions = load_questions(config.questions)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    baseline = next(iter(config.variants))
    with start_run(config.tracking, "bench generate", config) as tracker:
        by_variant = {}
        for variant in config.variants:
            by_variant[variant] = run_variant(config, variant, questions)
            tracker.log({f"{variant}_tokens_per_s_c{level}": m["completion_tokens_per_s"]
                         for level, m in by_variant[variant].items()})
    rows = []
    for level in config.concurrency:
        base = by_variant[baseline][level]["completion_tokens_per_s"]
        rows.append({"concurrency": level, "variants": {
            name: {**measured[level], "tokens_per_s_ratio": round(measured[level]["completion_tokens_per_s"] / base, 3)
                   if base else None} for name, measured in by_variant.items()}})
    result = {"config": to_dict(config), "baseline": baseline, "results": rows}
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    plot_generate_bench(rows, out / "bench.png", title=f"{config.model}, {config.max_tokens} max tokens")
    _print(rows, config, baseline)
    return result


def _print(rows: list[dict], config: GenerateBenchConfig, baseline: str) -> None:
    table = Table(title=f"batched generation, {config.model}, up to {config.max_tokens} tokens per request; "
                        f"ratios against {baseline}")
    plain = config.plain_generate
    for column in ("conc.", "variant", "tokens/s", "req/s", "p50 s", "p95 s", "rows/generate", "tokens/s ratio",
                   *(["plain generate tokens/s (main / worker thread)"] if plain else [])):
        table.add_column(column, justify="right")
    for row in rows:
        for name, m in row["variants"].items():
            ratio = "-" if m["tokens_per_s_ratio"] is None else f"{m['tokens_per_s_ratio']:.3f}"
            table.add_row(str(row["concurrency"]), name, f"{m['completion_tokens_per_s']:.1f}",
                          f"{m['requests_per_s']:.2f}", f"{m['p50_s']:.2f}", f"{m['p95_s']:.2f}",
                          f"{m['rows_per_generate']:.1f}", ratio,
                          *([f"{m['plain_generate_tokens_per_s']:.1f} / {m['plain_generate_thread_tokens_per_s']:.1f}"]
                            if plain else []))
    Console(width=120).print(table)


def plot_generate_bench(rows: list[dict], path: str | Path, title: str) -> Path:
    """Completion tokens/s against concurrency, one line per variant."""
    levels = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant in rows[0]["variants"]:
        ax.plot(levels, [r["variants"][variant]["completion_tokens_per_s"] for r in rows], "o-", label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(level) for level in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("completion tokens / s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
