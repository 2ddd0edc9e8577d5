"""What the recipes share (training/common.py): the final save across ranks, the final validation loss."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from overstory.training.common import final_eval_loss, save_final

ROOT = Path(__file__).resolve().parents[2]


class StandInTrainer:
    """A stand-in for a Hugging Face Trainer on one rank (not a Trainer): records the calls save_final makes."""

    def __init__(self, main: bool):
        self.main, self.calls = main, []

    def save_model(self, output_dir: str) -> None:
        self.calls.append(("save_model", output_dir))
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / f"weights-from-{'main' if self.main else 'other'}-rank").write_text("shard")

    def is_world_process_zero(self) -> bool:
        self.calls.append(("is_world_process_zero",))
        return self.main


class StandInTokenizer:
    """A stand-in tokenizer: records where it was saved."""

    def __init__(self):
        self.saved = []

    def save_pretrained(self, folder) -> None:
        self.saved.append(str(folder))


@pytest.mark.parametrize("main", [False, True], ids=["other-rank", "main-rank"])
def test_save_final_saves_the_model_on_every_rank_and_the_rest_on_the_main_one(tmp_path: Path, main: bool) -> None:
    trainer, tokenizer = StandInTrainer(main), StandInTokenizer()
    final = save_final(trainer, tokenizer, tmp_path, {"recipe": "x"}, {"steps": 3}, history=[{"step": 1}])
    assert final == tmp_path / "final"
    # every rank takes part in save_model (ZeRO-3 gathers the sharded weights only then)
    assert trainer.calls[0] == ("save_model", str(final))
    written = (final / "overstory.json").exists(), (tmp_path / "metrics.json").exists(), bool(tokenizer.saved)
    if main:
        assert written == (True, True, True)
        assert json.loads((final / "overstory.json").read_text()) == {"recipe": "x", "metrics": {"steps": 3}}
        assert json.loads((tmp_path / "metrics.json").read_text())["history"] == [{"step": 1}]
    else:
        assert written == (False, False, False)


class EvaluatingStandIn:
    """A stand-in for a Trainer after training (not a Trainer): its state's log and a counted ``evaluate``."""

    def __init__(self, log_history: list[dict], global_step: int):
        self.state = SimpleNamespace(log_history=log_history, global_step=global_step)
        self.passes = 0

    def evaluate(self) -> dict:
        self.passes += 1
        return {"eval_loss": 9.0}


def test_the_final_eval_loss_is_the_one_logged_at_the_last_step_else_a_new_pass() -> None:
    logged = EvaluatingStandIn([{"step": 50, "eval_loss": 2.0}, {"step": 60, "loss": 1.5},
                                {"step": 60, "eval_loss": 1.25}], global_step=60)
    assert final_eval_loss(logged) == 1.25 and logged.passes == 0
    stale = EvaluatingStandIn([{"step": 50, "eval_loss": 2.0}, {"step": 60, "loss": 1.5}], global_step=60)
    assert final_eval_loss(stale) == 9.0 and stale.passes == 1  # the last evaluation was of older weights
