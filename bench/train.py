"""`overstory bench train`: each recipe under each launcher, side by side in one run.

    overstory bench train --config configs/bench/train.yaml

Every recipe runs as users run it, in a subprocess: ``python -m overstory.cli train ...`` for one process,
``accelerate launch --config_file <yaml> -m overstory.cli train ...`` for the others (DDP over gloo, DeepSpeed
ZeRO-2 over gloo on CPU; the GPU configs on a GPU node). Reported per run: training samples per second
(from the recipe's own metrics.json: samples seen over the seconds spent training, start-up excluded), wall
seconds including start-up, and the peak resident memory of the whole process tree; ratios against the
first launcher. The recipes that count their tokens (the SFT ones) add tokens/s, overall and between the first and
last logged steps, and given ``peak_tflops`` MFU of the latter (``configs/bench/train-gpu.yaml``). A run that
fails is recorded with its error and the others still run; the command then exits non-zero after writing
``bench.json`` and ``bench.png`` to ``out``.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from accelerate.commands.config.config_args import ClusterConfig
from rich.console import Console
from rich.table import Table

from overstory.core.config import ConfigError, load_config, to_dict
from overstory.core.memory import MemorySampler
from overstory.core.plots import plt, save_figure
from overstory.core.tracking import TrackingConfig, start_run


@dataclass(frozen=True)
class BenchRecipe:
    job: str  # a train job name: compressor, text_compressor, planner_sft, ...
    config: str
    overrides: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TrainBenchConfig:
    recipes: dict[str, BenchRecipe] = field(default_factory=dict)
    # launcher name -> accelerate config ("" runs one plain process); the first is the baseline
    launchers: dict[str, str] = field(default_factory=lambda: {
        "1 process": "", "2 proc DDP": "configs/accelerate/cpu-2proc.yaml",
        "2 proc ZeRO-2": "configs/accelerate/cpu-2proc-zero2.yaml"})
    out: str = "runs/bench/train"
    timeout_s: int = 1800
    # one device's dense peak in TFLOP/s for the recipes' precision (e.g. 989 for an H100 or H200 in bf16): the
    # recipes that count their tokens (the SFT ones) then report MFU; 0 leaves MFU out
    peak_tflops: float = 0.0
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if not self.recipes or not self.launchers:
            raise ConfigError("recipes and launchers must each name at least one entry")
        for name, path in self.launchers.items():
            if path and not Path(path).is_file():
                raise ConfigError(f"launchers.{name}: accelerate config {path} not found")


def recipe_config_class(job: str) -> type:
    """The config class of the training recipe ``job``, read off its ``run(config: ...)`` signature (the bench
    sits beside the recipes and must not import the CLI's job table above it)."""
    return typing.get_type_hints(importlib.import_module(f"overstory.training.{job}").run)["config"]


def samples_seen(job_config, metrics: dict, world_size: int) -> int:
    """Training samples processed, from the recipe's metrics: epochs over the data, or optimizer steps."""
    if "steps" in metrics:  # Trainer-based recipes: per-device batch x accumulation x processes per step
        train = job_config.train
        return metrics["steps"] * train.batch_size * getattr(train, "grad_accum", 1) * world_size
    return metrics["n_train"] * metrics["epochs"]  # the set compressor shards one pass over the data per epoch


def flops_per_token(params: int, trainable: int) -> int:
    """Model FLOPs to train on one token: 2 per parameter forward, 2 backward through the activations, and 2 more
    for each trainable parameter's gradient: 6N for full fine-tuning, about 4N under LoRA. The attention scores'
    FLOPs are left out, as in the usual 6N convention, so MFU here is a slight underestimate at long sequences.
    (The Trainer's own ``total_flos`` counts 6N for every non-embedding parameter, trainable or not: under LoRA
    that overstates the work by half, which is why it is not used here.)

    >>> flops_per_token(100, 100), flops_per_token(100, 1)
    (600, 402)
    """
    return 4 * params + 2 * trainable


def steady_tokens_per_s(history: list[dict]) -> float | None:
    """Tokens/s between the first and the last logged training step (the Trainer's cumulative
    ``num_input_tokens_seen`` and ``train_runtime`` in each step's log): the first interval's warm-up (CUDA
    context, kernel selection) and whatever follows the last step (the final checkpoint, which for a full 1.7B
    model with its optimizer state is 20 GB to write) are left out. None with fewer than two logged steps.

    >>> steady_tokens_per_s([{"loss": 2.0, "num_input_tokens_seen": 1000, "train_runtime": 3.0},
    ...                      {"loss": 1.5, "num_input_tokens_seen": 5000, "train_runtime": 5.0},
    ...                      {"train_loss": 1.7, "num_input_tokens_seen": 5000, "train_runtime": 25.0}])
    2000.0
    """
    steps = [h for h in history if "loss" in h and "num_input_tokens_seen" in h and "train_runtime" in h]
    if len(steps) < 2 or steps[-1]["train_runtime"] <= steps[0]["train_runtime"]:
        return None
    return ((steps[-1]["num_input_tokens_seen"] - steps[0]["num_input_tokens_seen"])
            / (steps[-1]["train_runtime"] - steps[0]["train_runtime"]))


def token_throughput(metrics: dict, processes: int, peak_tflops: float) -> dict:
    """Tokens/s over the whole run (``tokens_per_s_overall``, start-up and checkpoints included) and between the
    first and last logged steps (``tokens_per_s``, see ``steady_tokens_per_s``; the overall figure when fewer
    than two steps were logged), and given a device's peak, MFU of the latter (model FLOPs per second over the
    peak of all ``processes`` devices), from a recipe's metrics that count tokens; empty for one that does not.

    >>> token_throughput({"tokens_seen": 4000, "seconds": 2.0, "params": 1e9, "trainable_params": 1e9}, 2, 1000)
    {'tokens_per_s_overall': 2000.0, 'tokens_per_s': 2000.0, 'mfu': 0.006}
    """
    if "tokens_seen" not in metrics:
        return {}
    overall = metrics["tokens_seen"] / max(metrics["seconds"], 1e-6)
    steady = steady_tokens_per_s(metrics.get("history", []))
    result = {"tokens_per_s_overall": round(overall, 1), "tokens_per_s": round(steady or overall, 1)}
    if peak_tflops:
        achieved = result["tokens_per_s"] * flops_per_token(metrics["params"], metrics["trainable_params"])
        result["mfu"] = round(achieved / (peak_tflops * 1e12 * processes), 4)
    return result


def run_one(recipe: BenchRecipe, launcher: str, out: Path, timeout_s: int, peak_tflops: float = 0.0) -> dict:
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, not a resumed one
    job = ["-m", "overstory.cli", "train", recipe.job, "--config", recipe.config, *recipe.overrides, f"out={out}",
           "tracking.backend=none"]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", launcher, *job] if launcher \
        else [sys.executable, *job]
    world_size = ClusterConfig.from_yaml_file(launcher).num_processes if launcher else 1
    log = out.parent / f"{out.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with log.open("w") as log_file:
        # PYTHONSAFEPATH: `-m` would put the working directory first on sys.path, and from the repository root its
        # overstory/ folder (cli and core only) would shadow a non-editable install of the whole package
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONSAFEPATH": "1"})
        with MemorySampler([process.pid], every_s=0.25) as memory:
            try:
                code = process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                raise
    wall = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {code}; last lines of {log}:\n"
                           + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
    metrics = json.loads((out / "metrics.json").read_text())
    job_config = load_config(recipe_config_class(recipe.job), recipe.config, recipe.overrides)
    samples = samples_seen(job_config, metrics, world_size)
    return {"processes": world_size, "samples": samples, "train_seconds": metrics["seconds"],
            "wall_seconds": round(wall, 1),
            "samples_per_s": round(samples / max(metrics["seconds"], 1e-6), 2),
            "peak_rss_mib": round(max(memory.samples), 1), **token_throughput(metrics, world_size, peak_tflops)}


def run(config: TrainBenchConfig) -> dict:
    out = Path(config.out)
    baseline = next(iter(config.launchers))
    results: dict[str, dict[str, dict]] = {}
    with start_run(config.tracking, "bench train", config) as tracker:
        for recipe_name, recipe in config.recipes.items():
            results[recipe_name] = {}
            for launcher_name, launcher in config.launchers.items():
                print(f"{recipe_name} with {launcher_name} ...", flush=True)
                slug = launcher_name.replace(" ", "_")
                try:
                    row = run_one(recipe, launcher, out / recipe_name / slug, config.timeout_s, config.peak_tflops)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the other runs still get measured
                    print(f"{recipe_name} with {launcher_name} FAILED: {exc}", flush=True)
                    results[recipe_name][launcher_name] = {"error": str(exc)}
                    continue
                results[recipe_name][launcher_name] = row
                tracker.log({f"{recipe_name}/{slug}/{k}": v for k, v in row.items()})
            base = results[recipe_name][baseline]
            for row in results[recipe_name].values():
                if "error" not in row and "error" not in base:
                    row["throughput_ratio"] = round(row["samples_per_s"] / base["samples_per_s"], 3)
                    row["memory_ratio"] = round(row["peak_rss_mib"] / base["peak_rss_mib"], 3)
    result = {"config": to_dict(config), "baseline": baseline, "results": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    plot_train_bench(results, out / "bench.png")
    _print(results, baseline)
    failed = [f"{recipe} with {launcher}" for recipe, rows in results.items() for launcher, r in rows.items()
              if "error" in r]
    if failed:
        raise RuntimeError(f"{len(failed)} run(s) failed: {', '.join(failed)} (errors in {out / 'bench.json'})")
    return result


def _print(results: dict[str, dict[str, dict]], baseline: str) -> None:
    table = Table(title=f"training throughput and peak memory; ratios against {baseline}")
    for column in ("recipe", "launcher", "samples/s", "tokens/s (steps)", "MFU", "train s", "wall s", "peak RSS MiB",
                   "samples/s ratio", "memory ratio"):
        table.add_column(column, justify="right")
    for recipe, rows in results.items():
        for launcher, r in rows.items():
            if "error" in r:
                table.add_row(recipe, launcher, "failed", *["-"] * 7)
                continue
            table.add_row(recipe, launcher, f"{r['samples_per_s']:.2f}",
                          f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "-",
                          f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-", f"{r['train_seconds']:.1f}",
                          f"{r['wall_seconds']:.1f}", f"{r['peak_rss_mib']:.0f}",
                          f"{r.get('throughput_ratio', float('nan')):.3f}",
                          f"{r.get('memory_ratio', float('nan')):.3f}")
    Console(width=150).print(table)


def plot_train_bench(results: Mapping[str, Mapping[str, Mapping]], path: str | Path) -> Path:
    """Samples/s and peak memory per recipe, one bar per launcher."""
    recipes = list(results)
    launchers = list(next(iter(results.values())))
    width = 0.8 / len(launchers)
    fig, (ax_speed, ax_memory) = plt.subplots(1, 2, figsize=(11, 4))
    for i, launcher in enumerate(launchers):
        xs = [r + (i - (len(launchers) - 1) / 2) * width for r in range(len(recipes))]
        ax_speed.bar(xs, [results[r][launcher].get("samples_per_s", 0) for r in recipes], width, label=launcher)
        ax_memory.bar(xs, [results[r][launcher].get("peak_rss_mib", 0) / 1024 for r in recipes], width,
                      label=launcher)
    for ax, title in ((ax_speed, "training samples / s"), (ax_memory, "peak resident memory (GiB, all processes)")):
        ax.set_xticks(range(len(recipes)), recipes)
        ax.set_title(title)
        ax.legend(fontsize=8)
    return save_figure(fig, path)
