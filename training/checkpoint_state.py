"""A recipe's resumable state on disk, replaced whole or not at all, and the settings check of a resume.

A recipe that resumes keeps what a rerun needs in one folder (``out/last``): weights, optimizers, a JSON state
(step, counters, history, the settings it was made with). Written file after file into the folder a rerun
reads, a kill between two writes leaves a folder that mixes two steps (the adapter of step n beside the state
of step n-1: a rerun applies step n twice), and a kill inside a write leaves a truncated file. So a step's files
go into ``<folder>.tmp`` (the JSON state last), and the finished folder is swapped into place with two renames
(``folder -> <folder>.old``, ``<folder>.tmp -> folder``); ``read_state`` first completes or undoes a swap that
a kill interrupted, so the folder a rerun reads is always one whole step.

A resume with other settings would continue one run with another's: ``check_settings`` refuses it, naming the
keys that differ (``core.config.differing_keys``, the check the resumable data jobs use).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from overstory.core.config import ConfigError, differing_keys


def staging_path(folder: str | Path) -> Path:
    """Where ``start_step`` stages the next step of ``folder`` (processes that write a part of it need the path)."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".tmp")


def _previous(folder: Path) -> Path:
    return folder.with_name(folder.name + ".old")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a file through a temporary one and a rename: a reader sees the old content or the new, never a part.

    >>> import tempfile
    >>> target = Path(tempfile.mkdtemp()) / "state.json"
    >>> atomic_write_text(target, '{"step": 1}'); target.read_text(), sorted(p.name for p in target.parent.iterdir())
    ('{"step": 1}', ['state.json'])
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".tmp")
    with staging.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(staging, path)


def recover(folder: str | Path) -> None:
    """Finish or undo what a kill interrupted: an unfinished ``<folder>.tmp`` is dropped; a swap cut between its two
    renames puts the previous folder back; a swap cut before its clean-up loses only the old copy."""
    folder = Path(folder)
    shutil.rmtree(staging_path(folder), ignore_errors=True)
    previous = _previous(folder)
    if previous.exists():
        if folder.exists():
            shutil.rmtree(previous)
        else:
            os.replace(previous, folder)


def start_step(folder: str | Path) -> Path:
    """An empty ``<folder>.tmp`` to write a step's files into (weights, optimizers), before ``commit``."""
    staging = staging_path(Path(folder))
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def commit(folder: str | Path, state: Mapping, state_file: str) -> None:
    """Write the JSON ``state`` into ``<folder>.tmp`` (last: the staging folder is whole once it is there), then
    swap the staging folder into place of ``folder``."""
    folder = Path(folder)
    staging, previous = staging_path(folder), _previous(folder)
    atomic_write_text(staging / state_file, json.dumps(state, indent=2))
    if folder.exists():
        os.replace(folder, previous)
    os.replace(staging, folder)
    shutil.rmtree(previous, ignore_errors=True)


def read_state(folder: str | Path, state_file: str) -> dict | None:
    """The JSON state of the last whole step in ``folder`` (after ``recover``), or None when there is none."""
    folder = Path(folder)
    recover(folder)
    path = folder / state_file
    return json.loads(path.read_text()) if path.exists() else None


def check_settings(state: Mapping, settings: Mapping, folder: str | Path) -> None:
    """Refuse to resume the run in ``folder`` with settings other than those it recorded in its state."""
    if "settings" not in state:
        raise ConfigError(f"{folder} holds a training state without a record of its settings; "
                          f"choose another out= (or delete {folder}) to start afresh")
    changed = differing_keys(state["settings"], json.loads(json.dumps(settings)))
    if changed:
        raise ConfigError(f"{folder} was trained with other settings ({', '.join(changed)} differ); rerun with the "
                          f"settings it was made with, or choose another out= to start afresh")
