"""STITCH under `accelerate launch` with two CPU processes, DeepSpeed ZeRO-2 over gloo (configs/accelerate/
cpu-2proc-zero2.yaml), run as users run it, in a subprocess: every rank routes a step the same way, the GRPO update
and the SFT injection are the distributed trainers' own, and a rerun resumes after the last step."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# the one-process STITCH test's helpers (two questions the SFT planner solves one of, the job's arguments), loaded by
# path: tests are not a package (--import-mode=importlib)
_spec = importlib.util.spec_from_file_location("stitch_tests", Path(__file__).with_name("test_stitch.py"))
stitch_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stitch_tests)


def launch(job: list[str]) -> str:
    """``overstory.cli`` under ``accelerate launch`` with ZeRO-2 on two CPU processes; returns its output."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs/accelerate/cpu-2proc-zero2.yaml"), "-m", "overstory.cli", *job]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout + done.stderr


def test_stitch_under_zero2_routes_alike_on_every_rank_updates_injects_sft_and_resumes(
        planner_labels: Path, planner_traces: Path, sft_planner: Path, tmp_path: Path) -> None:
    """Two questions, one the SFT planner solves (GRPO update) and one it does not (SFT injection,
    imitation_threshold=1), as in the one-process test (tests/training/test_stitch.py); one step, then a rerun
    with one more step."""
    out = tmp_path / "stitch"
    labels = stitch_tests._one_solvable_one_not(planner_labels, sft_planner / "final", tmp_path / "labels", 96, 72)
    args = stitch_tests._stitch_args(labels, sft_planner, planner_traces, out)
    launch([*args, "stitch.steps=1"])
    [step_1] = stitch_tests._log(out)
    # every rank's routing of the step, gathered: two digests, equal (the run stops when they differ)
    assert len(step_1["routing_by_rank"]) == 2 and len(set(step_1["routing_by_rank"])) == 1, step_1
    assert step_1["rl_buffer"] == 1 and step_1["grpo_updates"] == 1 and isinstance(step_1["reward"], float)
    assert step_1["grpo_grad_norm"] > 0 and step_1["grpo_weight_change"] > 0, step_1
    assert step_1["sft_injection"] and step_1["sft_examples"] == 1 and step_1["sft_optimizer_steps"] >= 1
    # each rank kept its own ZeRO shard of both optimizers' states (carried to the next update) and its RNG state
    assert {f"{kind}_rank{rank}.pt" for kind in ("grpo_optimizer", "sft_optimizer", "rng") for rank in (0, 1)} <= {
        p.name for p in (out / "last").iterdir()}
    before = load_file(sft_planner / "final" / "adapter_model.safetensors")
    after = load_file(out / "final" / "adapter_model.safetensors")
    assert set(before) == set(after) and any((before[k] != after[k]).any() for k in before)

    output = launch([*args, "stitch.steps=2"])
    assert "resuming STITCH after step 1" in output
    log = stitch_tests._log(out)
    assert [r["step"] for r in log] == [1, 2] and log[0] == step_1
    assert len(set(log[1]["routing_by_rank"])) == 1 and len(log[1]["routing_by_rank"]) == 2
    # step 2's SFT injection (the far-labelled question stays unsolved) continued the resumed Adam state on each
    # rank: its shard counts the optimizer steps of both injections, and the weights moved (at the new update's
    # learning rate, not the one where the last update's schedule ended: 0)
    assert log[1]["sft_injection"] and log[1]["sft_optimizer_steps"] == 1
    for rank in (0, 1):
        shard = torch.load(out / "last" / f"sft_optimizer_rank{rank}.pt", weights_only=False)
        assert [int(s["step"]) for s in shard["base_optimizer_state"]["state"].values()] == [2]
    step_2 = load_file(out / "last" / "adapter_model.safetensors")
    assert any((after[k] != step_2[k]).any() for k in after)
    assert json.loads((out / "metrics.json").read_text())["steps"] == 2
