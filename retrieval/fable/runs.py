"""Runs of numbered items for FABLE's forest builder: sentences into semantic chunks, leaves into sections.

The generator answers with the numbers where runs begin (``parse_starts``); its runs are then repaired, never
trusted blindly: a run over the size limit is re-packed (``split_long_runs``), and runs too small to be worth a node
are merged into a neighbour (``merge_short_runs``): a 135M model begins a "chunk" at every sentence and a "section" at
every leaf, which gives leaves of a dozen tokens and one section per leaf. An unusable reply gets a deterministic
split instead (``fallback_runs`` for chunks, ``balanced_runs`` for groups).
"""

from __future__ import annotations

from collections.abc import Sequence

from overstory.retrieval.arag import pack
from overstory.retrieval.fable.replies import parse_ids


def parse_starts(text: str, key: str, n: int) -> tuple[list[int], int] | None:
    """Where runs begin among ``n`` numbered items: (sorted starts, always with 0; how many listed numbers were out
    of range), or None when the reply is unusable: no list, or no number in range (an empty chunking).

    >>> parse_starts('{"chunk_starts": [3, 0, 7, 3]}', "chunk_starts", 5)
    ([0, 3], 1)
    >>> parse_starts('{"chunk_starts": []}', "chunk_starts", 5) is None
    True
    """
    parsed = parse_ids(text, key, n)
    if parsed is None or not parsed[0]:
        return None
    return sorted({0, *parsed[0]}), parsed[1]


def runs_from_starts(starts: Sequence[int], n: int) -> list[range]:
    """Consecutive runs of ``n`` items, one from each start to the next.

    >>> runs_from_starts([0, 2], 5)
    [range(0, 2), range(2, 5)]
    """
    return [range(a, b) for a, b in zip(starts, [*starts[1:], n])]


def split_long_runs(runs: Sequence[range], weights: Sequence[int], limit: int, size: int) -> tuple[list[range], int]:
    """Runs whose weights sum past ``limit`` re-packed into runs of at most ``size`` (``pack``); (runs, how many
    were split).

    >>> split_long_runs([range(0, 3), range(3, 4)], [50, 50, 50, 10], 120, 100)
    ([range(0, 2), range(2, 3), range(3, 4)], 1)
    """
    out, split = [], 0
    for run in runs:
        if sum(weights[i] for i in run) <= limit:
            out.append(run)
            continue
        split += 1
        out += [range(run.start + r.start, run.start + r.stop) for r in pack([weights[i] for i in run], size)]
    return out, split


def fallback_runs(weights: Sequence[int], groups: Sequence[str], size: int) -> list[range]:
    """The deterministic chunking: consecutive items of one group (a paragraph's sentences) packed up to ``size``.

    >>> fallback_runs([50, 50, 50, 10], ["p0", "p0", "p0", "p1"], 100)
    [range(0, 2), range(2, 3), range(3, 4)]
    """
    runs, start = [], 0
    for end in range(1, len(weights) + 1):
        if end == len(weights) or groups[end] != groups[start]:
            runs += [range(start + r.start, start + r.stop) for r in pack(weights[start:end], size)]
            start = end
    return runs


def merge_short_runs(runs: Sequence[range], weights: Sequence[int], limit: int, min_weight: int = 0,
                     max_runs: int = 0) -> tuple[list[range], int]:
    """Merge adjacent runs while one weighs less than ``min_weight`` (the lightest such run joins its lighter
    neighbour) or, with ``max_runs``, while there are more runs than that (the adjacent pair of least weight joins);
    a merge never makes a run heavier than ``limit``. The model's boundaries stay wherever they leave runs of a
    useful size. (runs, how many merges).

    >>> merge_short_runs([range(0, 1), range(1, 2), range(2, 3), range(3, 4)], [10, 50, 60, 100], 120, min_weight=40)
    ([range(0, 2), range(2, 3), range(3, 4)], 1)
    >>> merge_short_runs([range(i, i + 1) for i in range(5)], [1] * 5, 2, max_runs=3)
    ([range(0, 2), range(2, 4), range(4, 5)], 2)
    >>> merge_short_runs([range(0, 1), range(1, 2)], [10, 200], 120, min_weight=40)  # no merge fits the limit
    ([range(0, 1), range(1, 2)], 0)
    """
    out = list(runs)
    weight = [sum(weights[i] for i in run) for run in out]
    merges = 0
    while len(out) > 1:
        pairs = [i for i in range(len(out) - 1) if weight[i] + weight[i + 1] <= limit]
        light = sorted((w, i) for i, w in enumerate(weight) if w < min_weight)
        light = [i for _, i in light if i in pairs or i - 1 in pairs]
        if light:
            pairs = [p for p in (light[0] - 1, light[0]) if p in pairs]
        elif not (max_runs and len(out) > max_runs):
            break
        if not pairs:
            break
        i = min(pairs, key=lambda p: (weight[p] + weight[p + 1], p))
        out[i:i + 2] = [range(out[i].start, out[i + 1].stop)]
        weight[i:i + 2] = [weight[i] + weight[i + 1]]
        merges += 1
    return out, merges


def balanced_runs(n: int, max_runs: int, size: int) -> list[range]:
    """``n`` items in consecutive runs of near-equal length, as many as a balanced tree wants: one per ``max_runs``
    items (so each run needs no further level when it can), at most ``max_runs`` of them unless runs of ``size``
    items need more, and at least two: one run would only repeat its parent.

    >>> balanced_runs(20, 8, 512)
    [range(0, 6), range(6, 13), range(13, 20)]
    >>> [len(r) for r in balanced_runs(100, 8, 512)]
    [12, 13, 12, 13, 12, 13, 12, 13]
    >>> balanced_runs(1, 8, 512)
    [range(0, 1)]
    """
    count = max(min(max_runs, -(-n // max_runs)), -(-n // size), min(2, n))
    bounds = [i * n // count for i in range(count + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]
