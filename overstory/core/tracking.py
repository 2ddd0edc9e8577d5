"""Experiment tracking for every job: wandb (offline unless WANDB_MODE says otherwise), jsonl, or none.

Jobs call ``start_run(config.tracking, job=..., config=...)`` and get a ``Run`` with
``log(metrics, step)``, ``summary(metrics)`` and ``finish()``. The jsonl backend writes
``<dir>/<run_id>/metrics.jsonl`` plus ``config.json`` and ``summary.json``; wandb writes its own
offline run folder under ``dir`` that ``wandb sync`` can upload later.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from overstory.core.config import ConfigError, to_dict


@dataclass(frozen=True)
class TrackingConfig:
    backend: Literal["wandb", "jsonl", "none"] = "wandb"
    project: str = "overstory"
    dir: str = "runs/tracking"
    # wandb mode when WANDB_MODE is unset; "offline" keeps runs local until `wandb sync`.
    mode: Literal["offline", "online", "disabled"] = "offline"
    run_name: str = ""

    def __post_init__(self) -> None:
        if not self.project:
            raise ConfigError("tracking.project must not be empty")


class Run:
    """A tracking run; the base class is the ``none`` backend (records nothing)."""

    def __init__(self, run_id: str):
        self.id = run_id

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        pass

    def summary(self, metrics: dict[str, Any]) -> None:
        pass

    def finish(self) -> None:
        pass

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


class JsonlRun(Run):
    def __init__(self, run_id: str, folder: Path, config: dict[str, Any]):
        super().__init__(run_id)
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self._fh = (folder / "metrics.jsonl").open("a")
        self._summary: dict[str, Any] = {}

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self._fh.write(json.dumps({"step": step, "time": time.time(), **metrics}, default=str) + "\n")
        self._fh.flush()

    def summary(self, metrics: dict[str, Any]) -> None:
        self._summary.update(metrics)
        (self.folder / "summary.json").write_text(json.dumps(self._summary, indent=2, default=str))

    def finish(self) -> None:
        if not self._fh.closed:
            self._fh.close()


class WandbRun(Run):
    def __init__(self, run, folder: Path):
        super().__init__(run.id)
        self._run = run
        self.folder = folder

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self._run.log(metrics, step=step)

    def summary(self, metrics: dict[str, Any]) -> None:
        self._run.summary.update(metrics)

    def finish(self) -> None:
        self._run.finish()


def start_run(cfg: TrackingConfig, job: str, config: Any = None) -> Run:
    """Open a run for ``job``; ``config`` (a dataclass or dict) is recorded with it."""
    config_dict = to_dict(config) if config is not None else {}
    run_id = f"{job.replace(' ', '-')}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    if cfg.backend == "none":
        return Run(run_id)
    folder = Path(cfg.dir)
    if cfg.backend == "jsonl":
        return JsonlRun(run_id, folder / run_id, {"job": job, "config": config_dict})
    import wandb

    folder.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=cfg.project,
        name=cfg.run_name or run_id,
        job_type=job,
        config=config_dict,
        dir=str(folder),
        mode=os.environ.get("WANDB_MODE", cfg.mode),
        reinit="finish_previous",
    )
    return WandbRun(run, folder)
