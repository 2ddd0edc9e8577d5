"""training/checkpoint_state.py: a step's folder is swapped in whole, whatever write a kill interrupts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from overstory.core.config import ConfigError
from overstory.training import checkpoint_state


def _save(folder: Path, step: int, weights: str, fail_before_commit: bool = False) -> None:
    """One step's save as a recipe does it: weights and an optimizer into the staging folder, then the state."""
    staging = checkpoint_state.start_step(folder)
    (staging / "weights.txt").write_text(weights)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    torch.save(optimizer.state_dict(), staging / "main_optimizer.pt")
    if fail_before_commit:
        raise KeyboardInterrupt("killed between the weights and the state")
    checkpoint_state.commit(folder, {"step": step, "settings": {"lr": 0.1}}, "state.json")


def test_a_kill_before_the_state_is_written_leaves_the_previous_step(tmp_path: Path) -> None:
    last = tmp_path / "last"
    assert checkpoint_state.read_state(last, "state.json") is None
    _save(last, 1, "step-1 weights")
    with pytest.raises(KeyboardInterrupt):
        _save(last, 2, "step-2 weights", fail_before_commit=True)
    assert (last / "weights.txt").read_text() == "step-1 weights"  # the new weights never reached the folder
    assert checkpoint_state.read_state(last, "state.json")["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]  # the unfinished staging folder is dropped
    _save(last, 2, "step-2 weights")
    assert checkpoint_state.read_state(last, "state.json")["step"] == 2
    assert (last / "weights.txt").read_text() == "step-2 weights" and (last / "main_optimizer.pt").exists()


def test_a_truncated_state_file_in_the_staging_folder_is_never_read(tmp_path: Path) -> None:
    last = tmp_path / "last"
    _save(last, 1, "step-1 weights")
    staging = checkpoint_state.start_step(last)
    (staging / "state.json").write_text('{"step": 2, "hist')  # a kill inside the state's write
    assert checkpoint_state.read_state(last, "state.json") == {"step": 1, "settings": {"lr": 0.1}}


def test_a_kill_between_the_two_renames_puts_the_previous_step_back(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    last = tmp_path / "last"
    _save(last, 1, "step-1 weights")
    real_replace = os.replace

    def killed_on_the_second_folder_rename(source, target):
        if Path(target).name == "last":  # last.tmp -> last, after last -> last.old
            raise KeyboardInterrupt("killed between the renames")
        real_replace(source, target)

    monkeypatch.setattr(checkpoint_state.os, "replace", killed_on_the_second_folder_rename)
    with pytest.raises(KeyboardInterrupt):
        _save(last, 2, "step-2 weights")
    monkeypatch.undo()
    assert not last.exists() and (tmp_path / "last.old").exists()  # what the kill left
    assert checkpoint_state.read_state(last, "state.json")["step"] == 1
    assert (last / "weights.txt").read_text() == "step-1 weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]


def test_a_resume_with_other_settings_is_refused_naming_the_keys(tmp_path: Path) -> None:
    state = {"step": 3, "settings": {"lr": 0.1, "stitch": {"hint": "adaptive"}}}
    checkpoint_state.check_settings(state, {"lr": 0.1, "stitch": {"hint": "adaptive"}}, tmp_path)
    with pytest.raises(ConfigError, match=r"other settings \(lr, stitch.hint differ\)"):
        checkpoint_state.check_settings(state, {"lr": 0.2, "stitch": {"hint": "fixed"}}, tmp_path)
    with pytest.raises(ConfigError, match="without a record of its settings"):
        checkpoint_state.check_settings({"step": 3}, {"lr": 0.1}, tmp_path)
