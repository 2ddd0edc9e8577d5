"""How FABLE's prompts list what the model picks from (``numbered``) and how its replies are read: numbers under a
key (``parse_ids``: selections, chunk and group starts) and a title with a summary (``parse_summary``). Shared by the
builder (``builder``, ``runs``) and the strategy's selection calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from overstory.models.json_reply import as_int, json_objects, loads_tolerant


def numbered(texts: Sequence[str]) -> str:
    """One line per text, each after its number in brackets: how every prompt lists what the model picks from."""
    return "\n".join(f"[{i}] {text}" for i, text in enumerate(texts))


def _reply_list(text: str, key: str) -> list[Any] | None:
    """The list under ``key`` in the last JSON object of the reply that has one (a bare number is a list of one)."""
    for obj in map(loads_tolerant, reversed(json_objects(text))):
        if obj is not None and key in obj:
            value = obj[key]
            return value if isinstance(value, list) else [value]
    return None


def parse_ids(text: str, key: str, n: int) -> tuple[list[int], int] | None:
    """(the numbers 0..n-1 the reply lists under ``key``, in its order and once each; how many listed items were
    not such a number: hallucinated ids), or None when the reply holds no such list.

    >>> parse_ids('Sure: {"ids": [2, "0", 9, 2, "x"]}', "ids", 3), parse_ids("no json", "ids", 3)
    (([2, 0], 2), None)
    """
    items = _reply_list(text, key)
    if items is None:
        return None
    numbers = [as_int(item) for item in items]
    valid = [i for i in numbers if i is not None and 0 <= i < n]
    return list(dict.fromkeys(valid)), len(numbers) - len(valid)


def parse_summary(text: str) -> tuple[str, str] | None:
    """(title, summary) from the last reply object with both non-empty, else None.

    >>> parse_summary('{"title": " Rivers ", "summary": "Two rivers."}'), parse_summary('{"title": "", "summary": "x"}')
    (('Rivers', 'Two rivers.'), None)
    """
    for obj in map(loads_tolerant, reversed(json_objects(text))):
        if obj is None:
            continue
        title, summary = " ".join(str(obj.get("title", "")).split()), " ".join(str(obj.get("summary", "")).split())
        if title and summary:
            return title, summary
    return None
