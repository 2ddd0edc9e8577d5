"""Sentence spans of a text: the one sentence splitter of the project (pysbd), shared by the hierarchy builder
(``data_pipeline.hierarchy``: sentence chunks that tile their paragraph) and Orion-RAG's pruner
(``retrieval.orion.query``: a passage's numbered sentences), so both cut a text the same way.
"""

from __future__ import annotations

import threading

_local = threading.local()


def _segmenter():
    """This thread's pysbd segmenter: a Segmenter keeps the text it is cutting on itself, so threads sharing one cut
    each other's texts (Orion-RAG's pruner, 4 threads, numbered a passage as one sentence now and then)."""
    segmenter = getattr(_local, "segmenter", None)
    if segmenter is None:
        import pysbd

        segmenter = _local.segmenter = pysbd.Segmenter(language="en", clean=False)
    return segmenter


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
