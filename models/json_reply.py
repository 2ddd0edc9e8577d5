"""Tolerant reading of JSON objects in model replies, shared by the planner's and the scorer's parsers.

Small models wrap their JSON in prose, use single quotes, leave trailing commas or bare keys; grammar-
constrained decoding prevents most of it, and these helpers recover the rest before a reply counts
as a failure.
"""

from __future__ import annotations

import json
import re


def json_objects(text: str) -> list[str]:
    """The outermost balanced ``{...}`` spans of ``text``, in order.

    >>> json_objects('Sure: {"a": {"b": 1}} and {"c": 2}')
    ['{"a": {"b": 1}}', '{"c": 2}']
    """
    spans, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                spans.append(text[start: i + 1])
    return spans


def loads_tolerant(span: str) -> dict | None:
    """``span`` as a dict: as written, then with single quotes and trailing commas fixed, then with bare
    keys quoted; None when none of these parses to an object.

    >>> loads_tolerant("{'ranking': [1, 2,], score: 3}")
    {'ranking': [1, 2], 'score': 3}
    """
    double_quoted = re.sub(r",\s*([}\]])", r"\1", span.replace("'", '"'))  # single quotes, trailing commas
    quoted_keys = re.sub(r'([{,]\s*)([A-Za-z_][\w ]*?)\s*:', r'\1"\2":', double_quoted)  # {largest: "x"}
    for candidate in (span, double_quoted, quoted_keys):
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def as_int(value: object) -> int | None:
    """An id as a model writes it, as an int: 3, 3.0, "3" and "[3]" all read as 3; anything else is None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and (digits := value.strip().strip("[]").strip()).isdigit():
        return int(digits)
    return None
