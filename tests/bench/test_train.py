"""`overstory bench train` in a short mode: the set compressor, one process against two (DDP over gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.bench.train import TrainBenchConfig
from overstory.cli import main
from overstory.core.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_train_short(summaries: Path, tmp_path: Path) -> None:
    """The bench's two runs are also the check that DDP over gloo trains as one process does (accelerate's MULTI_CPU,
    each rank a shard of the same epochs): the same validation split scored alike before training, and a training loss
    that falls on two ranks. Not bit for bit, and not as far per epoch: each rank takes a batch of 8, so DDP makes
    half the steps."""
    recipes = (f"recipes={{compressor: {{job: compressor, config: {ROOT / 'configs/train/compressor.yaml'}, "
               f"overrides: [data={summaries}, train.epochs=2, train.batch_size=8]}}}}")
    launchers = f"launchers={{one: '', ddp: {ROOT / 'configs/accelerate/cpu-2proc.yaml'}}}"
    assert main(["bench", "train", "--config", str(ROOT / "configs/bench/train.yaml"), recipes, launchers,
                 f"out={tmp_path}", "tracking.backend=none"]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    one, ddp = result["results"]["compressor"]["one"], result["results"]["compressor"]["ddp"]
    assert (one["processes"], ddp["processes"]) == (1, 2)
    assert one["samples"] == ddp["samples"] > 0  # the same epochs over the same data, however it is split
    assert one["throughput_ratio"] == 1.0 and ddp["throughput_ratio"] == pytest.approx(
        ddp["samples_per_s"] / one["samples_per_s"], rel=1e-2)
    assert ddp["peak_rss_mib"] > one["peak_rss_mib"] > 100  # two Python processes hold two copies
    assert (tmp_path / "bench.png").stat().st_size > 5_000
    runs = {name: json.loads((tmp_path / "compressor" / name / "metrics.json").read_text()) for name in ("one", "ddp")}
    assert runs["ddp"]["distributed_type"] == "DistributedType.MULTI_CPU"
    before = runs["one"]["history"][0]["val_mse"]
    assert runs["ddp"]["history"][0]["val_mse"] == pytest.approx(before, rel=1e-6)
    assert runs["ddp"]["history"][-1]["train_loss"] < runs["ddp"]["history"][1]["train_loss"]


def test_missing_launcher_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="launchers.big: accelerate config nowhere.yaml not found"):
        load_config(TrainBenchConfig, overrides=["recipes={a: {job: compressor, config: x.yaml}}",
                                                 "launchers={big: nowhere.yaml}"])


def test_a_failing_run_is_recorded_and_the_bench_says_so(tmp_path: Path) -> None:
    """A recipe that fails (here: traces that do not exist) leaves its error in bench.json, and the command
    fails after writing it instead of losing the runs that worked."""
    recipes = (f"recipes={{sft: {{job: planner_sft, config: {ROOT / 'configs/train/planner_sft.yaml'}, "
               f"overrides: [traces={tmp_path / 'nowhere.jsonl'}]}}}}")
    with pytest.raises(RuntimeError, match=r"1 run\(s\) failed: sft with one"):
        main(["bench", "train", "--config", str(ROOT / "configs/bench/train.yaml"), recipes, "launchers={one: ''}",
              f"out={tmp_path}", "tracking.backend=none"])
    row = json.loads((tmp_path / "bench.json").read_text())["results"]["sft"]["one"]
    assert "nowhere.jsonl" in row["error"] and "samples_per_s" not in row
