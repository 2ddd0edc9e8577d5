"""The recipes under `accelerate launch` with two CPU processes: DeepSpeed ZeRO-2 over gloo (configs/accelerate/
cpu-2proc-zero2.yaml, run as users run it, in a subprocess). DDP over gloo (cpu-2proc.yaml) is checked by the training
bench's test, which launches the same job on one process and on two (tests/bench/test_train.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from overstory.models.compressor import load_compressor

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
pytestmark = pytest.mark.slow


def launch(accelerate_config: str, job: list[str]) -> str:
    """Run ``overstory.cli`` under ``accelerate launch`` with ``accelerate_config``; returns its output."""
    done = subprocess.run([*ACCELERATE, "--config_file", str(ROOT / accelerate_config), "-m", "overstory.cli", *job],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout + done.stderr


def compressor_job(summaries: Path, out: Path, epochs: int) -> list[str]:
    return ["train", "compressor", "--config", str(ROOT / "configs/train/compressor.yaml"), f"data={summaries}",
            f"out={out}", f"train.epochs={epochs}", "train.batch_size=8", "train.lr=1e-4",
            "tracking.backend=none"]


def history(out: Path) -> list[dict]:
    return json.loads((out / "metrics.json").read_text())["history"]


def test_zero2_over_gloo_shards_the_optimizer_and_resumes(summaries: Path, tmp_path: Path) -> None:
    out = tmp_path / "zero2"
    launch("configs/accelerate/cpu-2proc-zero2.yaml", compressor_job(summaries, out, 2))
    shards = sorted(p.name for p in (out / "last" / "pytorch_model").glob("zero_pp_rank_*_optim_states.pt"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert load_compressor(out / "best").config.embedding_dim == 384
    assert [h["epoch"] for h in history(out)] == [0, 1, 2]
    assert history(out)[2]["train_loss"] < history(out)[1]["train_loss"]

    output = launch("configs/accelerate/cpu-2proc-zero2.yaml", compressor_job(summaries, out, 3))
    assert "resuming from" in output and "after epoch 2" in output
    assert [h["epoch"] for h in history(out)] == [0, 1, 2, 3]


def test_planner_sft_lora_under_zero2(planner_traces: Path, tmp_path: Path) -> None:
    out = tmp_path / "sft"
    launch("configs/accelerate/cpu-2proc-zero2.yaml", [
        "train", "planner_sft", "--config", str(ROOT / "configs/train/planner_sft.yaml"), f"traces={planner_traces}",
        f"out={out}", "train.max_steps=2", "train.batch_size=2", "train.max_length=384", "train.save_steps=2",
        "tracking.backend=none"])
    checkpoint = out / "checkpoints" / "checkpoint-2"
    assert (checkpoint / "global_step2").is_dir() and {"rng_state_0.pth", "rng_state_1.pth"} <= {
        p.name for p in checkpoint.iterdir()}  # DeepSpeed's engine state, one RNG state per process
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
