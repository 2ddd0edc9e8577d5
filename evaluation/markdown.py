"""A Markdown table from a header and rows of cells: the layout every generated table of the results page uses."""

from __future__ import annotations


def grid(header: list[str], rows: list[list[str]]) -> str:
    """The table, one line per row, ending in a newline.

    >>> print(grid(["a", "b"], [["1", "2"]]), end="")
    | a | b |
    | --- | --- |
    | 1 | 2 |
    """
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"
