"""Rows of a Hugging Face hub dataset, for the loaders that read a dataset's hub layout.

A corpus path ``hub:<owner>/<name>`` means "load this dataset through ``datasets.load_dataset``"
(for users with a network, or with the dataset already in their HF cache). Offline, or when the
hub refuses, the error says what to pass instead: the dataset's official files on disk.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from overstory.data_pipeline.corpus_files import CorpusError

HUB_PREFIX = "hub:"


def hub_name(path: str | Path) -> str | None:
    """The dataset name of a ``hub:<owner>/<name>`` corpus path, or None for a path on disk.

    >>> hub_name("hub:allenai/qasper"), hub_name("data/qasper")
    ('allenai/qasper', None)
    """
    text = str(path)
    return text[len(HUB_PREFIX):] if text.startswith(HUB_PREFIX) else None


def hub_rows(name: str, split: str, local_hint: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(split, row)`` for every row of hub dataset ``name``: one split, or every split when ``split``
    is empty. ``local_hint`` tells the user which local files to pass when the hub cannot be reached."""
    import datasets

    try:
        loaded = datasets.load_dataset(name, split=split or None)
    except (OSError, RuntimeError, ValueError) as exc:  # offline (ConnectionError), not found, scripts refused
        raise CorpusError(f"could not load {name!r} from the Hugging Face hub: {exc}. Without the hub, "
                          f"pass the dataset's official files instead: {local_hint}") from exc
    parts = {split: loaded} if split else dict(loaded)
    for split_name, rows in parts.items():
        for row in rows:
            yield split_name, row
