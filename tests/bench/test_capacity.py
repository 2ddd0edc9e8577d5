"""The capacity plan (bench/capacity.py) on recorded metrics files written here, shaped as the jobs write them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from overstory.bench.capacity import CapacityConfig, plan, run
from overstory.core.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
FLEET = {"gpu": "H100", "gpus": 2, "prefill_tokens_per_s": 1000, "decode_tokens_per_s": 100, "source": "test figure",
         "training_tokens_per_s": 500, "training_source": "test figure"}


def eval_metrics(path: Path) -> Path:
    """An ``eval pipeline`` metrics.json: 30 questions, 4 at a time; naive spends 2 calls, 500 / 10 tokens, 4 s each."""
    row = {"n_questions": 30, "llm_calls": 2.0, "llm_input_tokens": 500.0, "llm_output_tokens": 10.0,
           "seconds": 4.0, "generator_tokens": 500.0, "failures": {}, "repairs": {}}
    path.write_text(json.dumps({"config": {"concurrency": 4}, "dataset": "qasper", "n_questions": 30,
                                "strategies": {"naive": row}}))
    return path


def teacher_job(path: Path) -> Path:
    """``scripts/teacher_runs.sh``'s jobs/<job>.json for a job over 10 documents."""
    path.write_text(json.dumps({"job": "fable-qasper_dev", "finished": True, "invocations": 1, "wall_s": 500.0,
                                "llm_calls": 40, "failed_llm_calls": 0, "tokens_in": 20000, "tokens_out": 3000,
                                "teacher_tokens_per_s": 6.0, "embedder": {}, "engines": ["embedded"],
                                "threads": [2], "models": ["builtin:qwen2.5-coder-1.5b-instruct"],
                                "failed_invocations": 0}))
    return path


def fable_build(path: Path) -> Path:
    """``data fable-forest``'s build.json: 5 documents, 2 of them built by this run."""
    path.write_text(json.dumps({"documents": 5, "built": 2, "skipped_done": 3, "failed": 0, "nodes": {"leaf": 9},
                                "cost": {"llm_calls": 8, "request_failures": 0, "prompt_tokens": 4000,
                                         "completion_tokens": 600, "embedding_requests": 2, "seconds": 60.0}}))
    return path


def sft_metrics(path: Path) -> Path:
    """A training recipe's metrics.json: 10 steps, 5,000 tokens, 20 s."""
    path.write_text(json.dumps({"steps": 10, "seconds": 20.0, "tokens_seen": 5000, "train_loss": 1.0}))
    return path


def config(tmp_path: Path, steps: dict, **extra) -> CapacityConfig:
    raw = {"targets": {"document": 100_000, "question": 1_000_000, "training_step": 200}, "fleet": FLEET,
           "steps": steps, "out": str(tmp_path / "out"), **extra}
    path = tmp_path / "capacity.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(CapacityConfig, path)


def step(kind: str, metrics: Path, unit: str, **extra) -> dict:
    return {"kind": kind, "metrics": str(metrics), "unit": unit, "measure": f"make {kind}", **extra}


def test_a_question_step_projects_by_hand(tmp_path: Path) -> None:
    """2 calls a question x 1e6 questions; GPU-hours = (5e8 / 1000 + 1e7 / 100) / 3600 over 2 GPUs; the CPU box's
    hours from 4 s a question, 4 at a time."""
    cfg = config(tmp_path, {"eval": step("eval_pipeline", eval_metrics(tmp_path / "m.json"), "question",
                                         strategy="naive")})
    row = plan(cfg)["steps"]["eval"]
    assert row["measured"] and row["units_measured"] == 30
    assert row["llm_calls"] == pytest.approx(2_000_000)
    assert (row["tokens_in"], row["tokens_out"]) == (pytest.approx(5e8), pytest.approx(1e7))
    assert row["gpu_hours"] == pytest.approx((5e8 / 1000 + 1e7 / 100) / 3600)
    assert row["fleet_hours"] == pytest.approx(row["gpu_hours"] / 2)
    assert row["cpu_box_hours"] == pytest.approx(4 * 1e6 / 4 / 3600)


def test_data_jobs_and_training_steps_project_per_unit(tmp_path: Path) -> None:
    """A teacher job's record over 10 documents, a resumed FABLE build (2 documents built this run) and an SFT run."""
    cfg = config(tmp_path, {
        "job": step("teacher_job", teacher_job(tmp_path / "job.json"), "document", units=10),
        "fable": step("fable_forest", fable_build(tmp_path / "build.json"), "document"),
        "sft": step("training", sft_metrics(tmp_path / "sft.json"), "training_step")})
    rows = plan(cfg)["steps"]
    assert rows["job"]["llm_calls"] == pytest.approx(4 * 100_000)
    assert rows["job"]["cpu_box_hours"] == pytest.approx(50 * 100_000 / 3600)
    assert rows["fable"]["per_unit"]["llm_calls"] == 4 and rows["fable"]["tokens_in"] == pytest.approx(2000 * 100_000)
    assert rows["sft"]["train_tokens"] == pytest.approx(500 * 200)
    assert rows["sft"]["gpu_hours"] == pytest.approx(500 * 200 / 500 / 3600)


def test_a_missing_file_is_listed_as_not_measured_with_its_command(tmp_path: Path) -> None:
    cfg = config(tmp_path, {"eval": step("eval_pipeline", eval_metrics(tmp_path / "m.json"), "question",
                                         strategy="naive"),
                            "traces": step("lattice_traces", tmp_path / "absent.queries.jsonl", "question",
                                           measure="bash scripts/teacher_runs.sh")})
    report = run(cfg)
    assert report["steps"]["traces"]["measured"] is False
    table = (Path(cfg.out) / "capacity.md").read_text()
    assert "| traces |  | question | not measured |" in table
    assert "- traces: `bash scripts/teacher_runs.sh`" in table
    assert f"`{tmp_path / 'm.json'}` (" in table  # a measured row names its source and date
    assert json.loads((Path(cfg.out) / "capacity.json").read_text())["steps"]["eval"]["measured"] is True
    assert (Path(cfg.out) / "capacity.png").stat().st_size > 0


def test_bad_config_names_the_key(tmp_path: Path) -> None:
    metrics = eval_metrics(tmp_path / "m.json")
    with pytest.raises(ConfigError, match=r"steps\.eval\.metric"):
        config(tmp_path, {"eval": {**step("eval_pipeline", metrics, "question", strategy="naive"), "metric": "x"}})
    with pytest.raises(ConfigError, match=r"steps\.eval\.unit: 'slate' is not a key of targets"):
        config(tmp_path, {"eval": step("eval_pipeline", metrics, "slate", strategy="naive")})
    with pytest.raises(ConfigError, match=r"steps\.eval\.strategy"):
        config(tmp_path, {"eval": step("eval_pipeline", metrics, "question")})


def test_a_file_of_another_shape_is_named(tmp_path: Path) -> None:
    """A step pointed at a file its kind does not read fails naming the file and the missing key."""
    cfg = config(tmp_path, {"fable": step("fable_forest", sft_metrics(tmp_path / "sft.json"), "document")})
    with pytest.raises(ConfigError, match=r"sft\.json: no key 'built'"):
        plan(cfg)


def test_the_job_writes_the_plan(tmp_path: Path) -> None:
    """``overstory bench capacity`` on a config with one measured step: exit 0, the table printed and written; a bad
    value exits 2 naming the key."""
    cfg_path = tmp_path / "capacity.yaml"
    cfg_path.write_text(yaml.safe_dump({"fleet": FLEET, "steps": {"eval": step(
        "eval_pipeline", eval_metrics(tmp_path / "m.json"), "question", strategy="naive")}}))
    done = subprocess.run([sys.executable, "-m", "overstory.cli", "bench", "capacity", "--config", str(cfg_path),
                           f"out={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "| eval (naive) |" in done.stdout and (tmp_path / "out" / "capacity.md").is_file()
    bad = subprocess.run([sys.executable, "-m", "overstory.cli", "bench", "capacity", "--config", str(cfg_path),
                          "fleet.gpus=0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "fleet.gpus must be positive" in bad.stderr
