"""LATTICE++: the tree search's leaf ranking fused with BM25 and dense retrieval by min-max normalised weights.

The paper fuses LATTICE 0.6, BM25 0.2 and dense 0.2. Each source's scores are min-max normalised over the
documents that source returned, then summed with the weights. Conventions (the paper leaves them open):

* a document a source did not return scores 0 from that source, the same as the source's worst returned
  document: it was ranked no higher than anything the source kept;
* a source whose returned scores are all equal cannot rank them, so each of its documents scores 1 (present
  beats absent) and nothing is divided by zero;
* ties in the fused score are broken by document id, so a fusion is reproducible.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

LATTICE_PP_WEIGHTS = {"lattice": 0.6, "bm25": 0.2, "dense": 0.2}


def min_max(scores: Mapping[str, float]) -> dict[str, float]:
    """Scores mapped onto [0, 1] by the source's own minimum and maximum (all equal: every one is 1).

    >>> min_max({"a": 3.0, "b": 1.0, "c": 2.0})
    {'a': 1.0, 'b': 0.0, 'c': 0.5}
    >>> min_max({"a": 7.0, "b": 7.0})
    {'a': 1.0, 'b': 1.0}
    """
    if not scores:
        return {}
    low, high = min(scores.values()), max(scores.values())
    if high == low:
        return dict.fromkeys(scores, 1.0)
    return {doc: (value - low) / (high - low) for doc, value in scores.items()}


def weighted_fusion(sources: Mapping[str, Mapping[str, float]], weights: Mapping[str, float],
                    top_k: int | None = None) -> list[tuple[str, float]]:
    """(document, fused score) best first: the weighted sum of each source's min-max normalised scores.

    ``sources`` and ``weights`` share their names; a source without a weight (or a weight without a source)
    is a configuration error, never silently dropped.

    >>> weighted_fusion({"lattice": {"a": 0.9, "b": 0.1}, "bm25": {"b": 12.0, "c": 3.0}},
    ...                 {"lattice": 0.6, "bm25": 0.4})
    [('a', 0.6), ('b', 0.4), ('c', 0.0)]
    """
    if set(sources) != set(weights):
        raise ValueError(f"fusion sources {sorted(sources)} and weights {sorted(weights)} must name the same sources")
    fused: dict[str, float] = {}
    for name, scores in sources.items():  # a document absent from a source gets nothing from it (its 0)
        for doc, value in min_max(scores).items():
            fused[doc] = fused.get(doc, 0.0) + weights[name] * value
    ranked = sorted(((doc, round(score, 12)) for doc, score in fused.items()), key=lambda item: (-item[1], item[0]))
    return ranked[:top_k] if top_k is not None else ranked


def lattice_pp(lattice: Sequence[tuple[str, float]], bm25: Sequence[tuple[str, float]],
               dense: Sequence[tuple[str, float]], weights: Mapping[str, float] = LATTICE_PP_WEIGHTS,
               top_k: int | None = None) -> list[tuple[str, float]]:
    """LATTICE++ from three rankings of ``(leaf id, score)``: the search's path relevance, BM25 and dense."""
    return weighted_fusion({"lattice": dict(lattice), "bm25": dict(bm25), "dense": dict(dense)}, weights, top_k)
