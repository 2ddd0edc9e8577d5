"""A capacity plan from measured costs: each pipeline step's calls, tokens and seconds per unit, projected to scale.

    overstory bench capacity --config configs/capacity.yaml

Each step of ``configs/capacity.yaml`` names the metrics file one of its runs wrote, the kind of that file, and the
unit its costs are counted per (``document``, ``question``, ``training_step``: any key of ``targets``). From the
file come the units the run covered and what it spent (LLM calls, prompt and completion tokens, seconds; training
tokens for a training step), so per unit = spent / units. At scale (``targets``), per step:

- LLM calls and tokens = per unit x target;
- GPU-hours on the fleet, the teacher on vLLM: (tokens in / prefill tokens/s + tokens out / decode tokens/s) / 3600,
  at the per-GPU throughputs of ``fleet`` (their source is quoted with them); a training step:
  training tokens / training tokens/s / 3600; the fleet's wall hours are the GPU-hours over ``fleet.gpus`` (the
  requests spread evenly, one server per GPU);
- the CPU box's hours at the rate measured there: seconds per unit x target / 3600, for comparison.

A step whose metrics file is missing is listed as not measured, with the command that writes it; every measured row
names its file and the file's date. Writes ``capacity.json``, ``capacity.md`` and ``capacity.png`` (GPU-hours per
step) to ``out``.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from overstory.core.config import ConfigError
from overstory.core.plots import plt, save_figure

Kind = Literal["eval_pipeline", "lattice_tree", "fable_forest", "orion_tags", "lattice_traces", "teacher_job",
               "training"]


@dataclass(frozen=True)
class StepConfig:
    kind: Kind
    metrics: str  # the file the step's run wrote
    unit: str  # a key of targets
    model: str = ""  # the model that served (or trained) in the measured run
    strategy: str = ""  # eval_pipeline: which strategy's row
    units: int = 0  # teacher_job: how many units the job covered (its record does not say)
    command: str = ""  # the command that runs the step at the targets' scale
    measure: str = ""  # the command that writes `metrics`


@dataclass(frozen=True)
class FleetConfig:
    gpu: str = "NVIDIA H100 80GB"
    gpus: int = 8
    prefill_tokens_per_s: float = 0.0  # per GPU, the teacher on vLLM
    decode_tokens_per_s: float = 0.0
    source: str = ""  # where the two figures come from (or why they are an assumption)
    training_tokens_per_s: float = 0.0  # per GPU, for training steps
    training_source: str = ""

    def __post_init__(self) -> None:
        for key in ("gpus", "prefill_tokens_per_s", "decode_tokens_per_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"fleet.{key} must be positive")
        if not self.source.strip():
            raise ConfigError("fleet.source must say where the throughput figures come from")


@dataclass(frozen=True)
class CapacityConfig:
    fleet: FleetConfig
    steps: dict[str, StepConfig]
    # units at scale, by unit name: every step's unit is one of these keys
    targets: dict[str, int] = field(default_factory=lambda: {"document": 100_000, "question": 1_000_000})
    out: str = "runs/capacity"

    def __post_init__(self) -> None:
        if not self.steps:
            raise ConfigError("steps must name at least one step")
        for unit, count in self.targets.items():
            if count < 1:
                raise ConfigError(f"targets.{unit} must be positive")
        for name, step in self.steps.items():
            if step.unit not in self.targets:
                raise ConfigError(f"steps.{name}.unit: {step.unit!r} is not a key of targets ({sorted(self.targets)})")
            if step.kind == "eval_pipeline" and not step.strategy:
                raise ConfigError(f"steps.{name}.strategy: an eval_pipeline step names the strategy it reads")
            if step.kind == "teacher_job" and step.units < 1:
                raise ConfigError(f"steps.{name}.units: a teacher_job step says how many {step.unit}s the job covered")
            if not step.measure:
                raise ConfigError(f"steps.{name}.measure: give the command that writes {step.metrics}")


@dataclass(frozen=True)
class Measured:
    """What one run spent over ``units`` units (totals, not per unit)."""
    units: float
    llm_calls: float = 0.0
    tokens_in: float = 0.0
    tokens_out: float = 0.0
    seconds: float = 0.0
    train_tokens: float = 0.0
    note: str = ""


def dig(data: dict, dotted: str, path: Path) -> float:
    """``data``'s value at ``a.b.c``; a missing key names the file and the key."""
    value = data
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ConfigError(f"{path}: no key {dotted!r} (is this the file the step's kind reads?)")
        value = value[part]
    return float(value)


def read_eval_pipeline(path: Path, step: StepConfig) -> Measured:
    """``eval pipeline`` metrics.json: the strategy's per-question means (answer side; the judge is not counted)."""
    report = json.loads(path.read_text())
    if step.strategy not in report.get("strategies", {}):
        raise ConfigError(f"{path}: no strategy {step.strategy!r} (it has {sorted(report.get('strategies', {}))})")
    row, n = report["strategies"][step.strategy], dig(report, "n_questions", path)
    concurrency = report.get("config", {}).get("concurrency", 1) or 1
    return Measured(units=n, llm_calls=row["llm_calls"] * n, tokens_in=row["llm_input_tokens"] * n,
                    tokens_out=row["llm_output_tokens"] * n, seconds=row["seconds"] * n / concurrency,
                    note=f"seconds: latency per question x questions / concurrency {concurrency}")


def read_build(path: Path, section: str, units_key: str, done_key: str = "") -> Measured:
    """A data job's build.json: what this run spent under ``section`` over the units it did itself."""
    report = json.loads(path.read_text())
    units = dig(report, units_key, path) - (dig(report, done_key, path) if done_key else 0)
    return Measured(units=units, llm_calls=dig(report, f"{section}.llm_calls", path),
                    tokens_in=dig(report, f"{section}.prompt_tokens", path),
                    tokens_out=dig(report, f"{section}.completion_tokens", path),
                    seconds=dig(report, f"{section}.seconds", path))


def read_traces(path: Path) -> Measured:
    """``data lattice-traces``' ``<out>.queries.jsonl``: one summary per question searched, summed."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    slates = path.with_name(path.name.replace(".queries.jsonl", ".jsonl"))
    n_slates = sum(1 for line in slates.read_text().splitlines() if line.strip()) if slates.is_file() else 0
    return Measured(units=len(rows), llm_calls=sum(r["llm_calls"] for r in rows),
                    tokens_in=sum(r["input_tokens"] for r in rows), tokens_out=sum(r["output_tokens"] for r in rows),
                    seconds=sum(r["seconds"] for r in rows),
                    note=f"{n_slates / max(len(rows), 1):.1f} slates per question; seconds summed over questions "
                         f"searched several at a time (an upper bound)")


def read_teacher_job(path: Path, step: StepConfig) -> Measured:
    """``scripts/teacher_runs.sh``'s ``jobs/<job>.json``: the stack's counters and the wall time, start-up included."""
    record = json.loads(path.read_text())
    return Measured(units=step.units, llm_calls=record["llm_calls"], tokens_in=record["tokens_in"],
                    tokens_out=record["tokens_out"], seconds=record["wall_s"],
                    note=f"wall time incl. start-up; {record.get('failed_llm_calls', 0)} failed calls")


def read_training(path: Path) -> Measured:
    """A recipe's metrics.json: its steps, seconds and (SFT recipes) non-padding tokens seen."""
    report = json.loads(path.read_text())
    tokens = report.get("tokens_seen", 0)
    return Measured(units=dig(report, "steps", path), seconds=dig(report, "seconds", path), train_tokens=tokens,
                    note="" if tokens else "the recipe does not count its tokens: no GPU-hours")


def measure(step: StepConfig, path: Path) -> Measured:
    """The run's totals from ``path``, read as ``step.kind`` says."""
    readers = {
        "eval_pipeline": lambda: read_eval_pipeline(path, step),
        "lattice_tree": lambda: read_build(path, "summaries", "stats.leaves"),
        "fable_forest": lambda: read_build(path, "cost", "built"),
        "orion_tags": lambda: read_build(path, "tagging", "documents", "tagging.documents_skipped_done"),
        "lattice_traces": lambda: read_traces(path),
        "teacher_job": lambda: read_teacher_job(path, step),
        "training": lambda: read_training(path),
    }
    return readers[step.kind]()


def project(measured: Measured, target: int, fleet: FleetConfig) -> dict:
    """Per unit and at ``target`` units: calls, tokens, GPU-hours on the fleet, the CPU box's hours."""
    if measured.units <= 0:
        raise ConfigError("the run covered no units: nothing to project from")
    scale = target / measured.units
    tokens_in, tokens_out = measured.tokens_in * scale, measured.tokens_out * scale
    gpu_seconds = tokens_in / fleet.prefill_tokens_per_s + tokens_out / fleet.decode_tokens_per_s
    if measured.train_tokens:
        gpu_seconds += (measured.train_tokens * scale / fleet.training_tokens_per_s
                        if fleet.training_tokens_per_s > 0 else float("nan"))
    elif not (measured.llm_calls or measured.tokens_in):
        gpu_seconds = float("nan")  # a step with neither LLM calls nor counted training tokens
    gpu_hours = gpu_seconds / 3600
    return {"units_measured": measured.units,
            "per_unit": {"llm_calls": measured.llm_calls / measured.units,
                         "tokens_in": measured.tokens_in / measured.units,
                         "tokens_out": measured.tokens_out / measured.units,
                         "train_tokens": measured.train_tokens / measured.units,
                         "seconds": measured.seconds / measured.units},
            "target": target, "llm_calls": measured.llm_calls * scale, "tokens_in": tokens_in,
            "tokens_out": tokens_out, "train_tokens": measured.train_tokens * scale,
            "gpu_hours": None if gpu_hours != gpu_hours else gpu_hours,
            "fleet_hours": None if gpu_hours != gpu_hours else gpu_hours / fleet.gpus,
            "cpu_box_hours": measured.seconds * scale / 3600, "note": measured.note}


def file_date(path: Path) -> str:
    """The day ``path`` was last written (local time), the date a row's figures were measured."""
    return datetime.datetime.fromtimestamp(path.stat().st_mtime).date().isoformat()


def plan(config: CapacityConfig) -> dict:
    """Every step of ``config``: its projection with its source file and date, or not measured with how to measure."""
    rows = {}
    for name, step in config.steps.items():
        path = Path(step.metrics)
        row = {"unit": step.unit, "kind": step.kind, "model": step.model, "strategy": step.strategy,
               "source": step.metrics, "command": step.command, "measure": step.measure}
        if not path.is_file():
            rows[name] = {**row, "measured": False}
            continue
        projection = project(measure(step, path), config.targets[step.unit], config.fleet)
        rows[name] = {**row, "measured": True, "date": file_date(path), **projection}
    return {"targets": config.targets, "fleet": asdict(config.fleet), "steps": rows,
            "formula": "GPU-hours = (tokens in / prefill tok/s + tokens out / decode tok/s) / 3600 per GPU; "
                       "training: training tokens / training tok/s / 3600; fleet hours = GPU-hours / GPUs; "
                       "CPU-box hours = measured seconds per unit x target / 3600"}


def number(value: float | None, digits: int = 0) -> str:
    """A figure for the table: thousands separated, '-' for none."""
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if abs(value) >= 1 or value == 0 else f"{value:.{max(digits, 2)}g}"


def markdown(report: dict) -> str:
    """The plan as markdown: the fleet and formula, one row per step, then the not-measured steps and commands."""
    fleet = report["fleet"]
    lines = [f"Fleet: {fleet['gpus']} x {fleet['gpu']}; the teacher on vLLM at {number(fleet['prefill_tokens_per_s'])} "
             f"prompt and {number(fleet['decode_tokens_per_s'])} generation tokens/s per GPU ({fleet['source']}); "
             f"training at {number(fleet['training_tokens_per_s'])} tokens/s per GPU ({fleet['training_source']}).",
             "", f"Formula: {report['formula']}.", "",
             "| step | model | unit | measured units | calls / unit | tokens in / out per unit | target | "
             "calls at scale | tokens in / out at scale | GPU-hours | fleet hours | CPU-box hours | source (date) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in report["steps"].items():
        label = f"{name} ({row['strategy']})" if row["strategy"] else name
        if not row["measured"]:
            lines.append(f"| {label} | {row['model']} | {row['unit']} | not measured | | | "
                         f"{number(report['targets'][row['unit']])} | | | | | | `{row['source']}` missing |")
            continue
        per = row["per_unit"]
        tokens = (f"{number(per['tokens_in'], 1)} / {number(per['tokens_out'], 1)}" if not per["train_tokens"]
                  else f"{number(per['train_tokens'], 1)} training")
        at_scale = (f"{number(row['tokens_in'])} / {number(row['tokens_out'])}" if not row["train_tokens"]
                    else f"{number(row['train_tokens'])} training")
        lines.append(f"| {label} | {row['model']} | {row['unit']} | {number(row['units_measured'])} | "
                     f"{number(per['llm_calls'], 2)} | {tokens} | {number(row['target'])} | "
                     f"{number(row['llm_calls'])} | {at_scale} | {number(row['gpu_hours'], 1)} | "
                     f"{number(row['fleet_hours'], 2)} | {number(row['cpu_box_hours'])} | "
                     f"`{row['source']}` ({row['date']}) |")
    notes = [f"- {name}: {row['note']}" for name, row in report["steps"].items() if row.get("note")]
    missing = [f"- {name}: `{row['measure']}`" for name, row in report["steps"].items() if not row["measured"]]
    commands = [f"- {name}: `{row['command']}`" for name, row in report["steps"].items() if row["command"]]
    for title, block in (("Notes", notes), ("Not measured: the command that measures each", missing),
                         ("At scale: the command per step", commands)):
        if block:
            lines += ["", f"{title}:", "", *block]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> Path:
    """A horizontal bar of GPU-hours per measured step (steps without a GPU figure are left out of the chart)."""
    rows = [(name, row["gpu_hours"]) for name, row in report["steps"].items()
            if row["measured"] and row["gpu_hours"] is not None]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    ax.barh([name for name, _ in rows], [hours for _, hours in rows])
    ax.set_xlabel(f"GPU-hours ({report['fleet']['gpu']})")
    ax.set_title("Capacity plan: GPU-hours per step at the targets")
    return save_figure(fig, path)


def run(config: CapacityConfig) -> dict:
    """Compute the plan and write capacity.json, capacity.md and capacity.png to ``config.out``."""
    report = plan(config)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "capacity.md").write_text(markdown(report))
    plot(report, out / "capacity.png")
    print(markdown(report))
    print(f"-> {out / 'capacity.json'}, capacity.md, capacity.png")
    return report
