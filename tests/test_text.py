"""The shared sentence splitter (overstory.core.text) gives every thread the cut a single thread gets."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from overstory.core.text import split_sentences

TEXTS = [f"Paper {i} is about retrieval. It has {i} tables. The method, e.g. a tree, works. Results: see Table {i}."
         for i in range(200)]


def test_threads_cut_the_same_sentences_as_one_thread() -> None:
    """pysbd's Segmenter keeps the text it is cutting on itself: shared by Orion-RAG's 4 pruning threads, it numbered
    a two-sentence passage as one sentence in the suite's own Orion test. Each thread now has its own."""
    alone = [split_sentences(text, 0, len(text)) for text in TEXTS]
    assert all(len(spans) == 4 for spans in alone)
    with ThreadPoolExecutor(max_workers=8) as pool:
        threaded = list(pool.map(lambda text: split_sentences(text, 0, len(text)), TEXTS * 3))
    assert threaded == alone * 3
