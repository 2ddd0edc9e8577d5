"""Tracking backends write what they should: jsonl files, a wandb offline run, nothing for none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.core.tracking import TrackingConfig, start_run


def test_jsonl_backend(tmp_path: Path) -> None:
    with start_run(TrackingConfig(backend="jsonl", dir=str(tmp_path)), "data hierarchy", {"a": 1}) as run:
        run.log({"loss": 0.5}, step=1)
        run.log({"loss": 0.25}, step=2)
        run.summary({"best": 0.25})
    folder = tmp_path / run.id
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 0.5), (2, 0.25)]
    assert json.loads((folder / "config.json").read_text()) == {"job": "data hierarchy", "config": {"a": 1}}
    assert json.loads((folder / "summary.json").read_text()) == {"best": 0.25}
    assert run.id.startswith("data-hierarchy-")


def test_none_backend_writes_nothing(tmp_path: Path) -> None:
    with start_run(TrackingConfig(backend="none", dir=str(tmp_path)), "job") as run:
        run.log({"x": 1})
    assert list(tmp_path.iterdir()) == []


def test_wandb_offline_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with start_run(TrackingConfig(backend="wandb", dir=str(tmp_path)), "job", {"lr": 0.1}) as run:
        run.log({"loss": 1.0}, step=0)
        run.summary({"final": 1.0})
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and run.id in runs[0].name
    assert list(runs[0].glob("run-*.wandb")), "wandb wrote no run file"
