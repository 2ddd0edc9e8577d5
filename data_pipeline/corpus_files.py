"""The pieces every corpus loader shares: the error it raises, its return type, and strict JSON/JSONL reading.

Kept below ``corpora.py`` and the dataset modules (``qasper.py``, ``narrativeqa.py``, ``hub.py``) so that
``corpora.py`` can import the dataset loaders while they use these helpers, without an import circle.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from overstory.core.records import Document, QAExample

Loaded = tuple[list[Document], list[QAExample]]
# the splits of the kinds that have them, as their official files name them
SPLITS: dict[str, tuple[str, ...]] = {"qasper": ("train", "dev", "test"), "narrativeqa": ("train", "valid", "test")}


class CorpusError(ValueError):
    """A corpus file is missing or malformed; the message names the file and the problem."""


def read_json(path: Path) -> Any:
    """The JSON value in ``path``; a missing, malformed or non-UTF-8 file raises ``CorpusError`` naming it."""
    if not path.is_file():
        raise CorpusError(f"corpus file not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{path} is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{path} is not UTF-8 text: {exc}") from exc


def require(record: Any, keys: tuple[str, ...], where: str) -> None:
    """Raise ``CorpusError`` at ``where`` unless ``record`` is an object holding every one of ``keys``."""
    if not isinstance(record, dict):
        raise CorpusError(f"{where}: expected an object, got {type(record).__name__}")
    missing = [k for k in keys if k not in record]
    if missing:
        raise CorpusError(f"{where}: missing field(s) {', '.join(missing)}")


def read_json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, record)`` for each non-blank line of a JSONL file; a missing file or a malformed line
    raises ``CorpusError`` naming the file and the line."""
    if not path.is_file():
        raise CorpusError(f"corpus file not found: {path}")
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{path}:{n}: malformed JSON: {exc}") from exc
