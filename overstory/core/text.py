"""Sentence spans of a text: the one sentence splitter of the project (pysbd), shared by the hierarchy builder
(``data_pipeline.hierarchy``: sentence chunks that tile their paragraph) and Orion-RAG's pruner
(``retrieval.orion.query``: a passage's numbered sentences), so both cut a text the same way.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def _segmenter():
    import pysbd

    return pysbd.Segmenter(language="en", clean=False)


def split_sentences(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """pysbd sentences of text[start:end] as spans that tile the range: each sentence is located
    after the previous one and runs up to the next, so no character is lost even where pysbd
    alters a sentence (that one is merged into its predecessor).

    >>> text = "Paris is in France. It is large."
    >>> [text[a:b] for a, b in split_sentences(text, 0, len(text))]
    ['Paris is in France. ', 'It is large.']
    """
    piece = text[start:end]
    starts, cursor = [], 0
    for sentence in _segmenter().segment(piece):
        at = piece.find(sentence.strip(), cursor) if sentence.strip() else -1
        if at >= 0:
            starts.append(at)
            cursor = at + len(sentence.strip())
    starts[:1] = [0]
    return [(start + a, start + b) for a, b in zip(starts, [*starts[1:], len(piece)])]
