"""The BM25 sentence floor: the trivial baseline an answering strategy has to beat, with no LLM call.

Per question, BM25 ranks the paragraphs of the question's own document (an index per document, so the term
statistics are that document's: a paper's own vocabulary decides, not the corpus's; the paragraphs are indexed
without the document's title, which every one of them would share and which would otherwise lift the shortest
paragraph, a stray "1.1.1em", to the top); the top paragraph is the
evidence, and its sentence that shares the most content words with the question (stemmed, stop words left out, as
the BM25 index tokenises; the first such sentence among equals) is the answer, verbatim.

It needs document scope (QASPER's papers, NarrativeQA's stories, SQuAD's articles): a question posed over the open
corpus (HotpotQA, ``scope=corpus``) is refused with a ConfigError rather than searched, since the floor is defined
over one document's paragraphs. ``overstory eval pipeline --strategies bm25_floor`` runs it as a baseline row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import bm25s
import Stemmer

from overstory.core.config import ConfigError
from overstory.core.records import Chunk
from overstory.retrieval.index import BM25Index
from overstory.retrieval.strategy import StrategyAnswer
from overstory.serving.client import Client

_STEMMER = Stemmer.Stemmer("english")


def content_words(text: str) -> set[str]:
    """The text's words as BM25 sees them: lower-cased, stemmed, bm25s's English stop words left out.

    >>> sorted(content_words("Which datasets do the models use?"))
    ['dataset', 'do', 'model', 'use', 'which']
    """
    return set(bm25s.tokenize([text], stopwords="en", stemmer=_STEMMER, return_ids=False, show_progress=False)[0])


def best_sentence(question: str, sentences: Sequence[Chunk]) -> Chunk:
    """The sentence sharing the most content words with the question; the first of equals."""
    asked = content_words(question)
    return max(sentences, key=lambda s: len(asked & content_words(s.text)))  # max keeps the first of equals


class BM25FloorStrategy:
    """BM25 over the question's document's paragraphs; the top paragraph's best sentence is the answer."""

    name = "bm25_floor"

    def __init__(self, indexes: dict[str, BM25Index], paragraphs: dict[str, Chunk], sentences: dict[str, list[Chunk]]):
        self.indexes, self.paragraphs, self.sentences = indexes, paragraphs, sentences

    @classmethod
    def build(cls, chunks: Sequence[Chunk]) -> BM25FloorStrategy:
        """One BM25 index per document over its paragraph chunks (their text alone), and each paragraph's
        sentences."""
        by_id = {c.id: c for c in chunks}
        paragraphs: dict[str, list[Chunk]] = {}
        for chunk in chunks:
            if chunk.level == "paragraph":
                paragraphs.setdefault(chunk.doc_id, []).append(chunk)
        if not paragraphs:
            raise ConfigError("bm25_floor: the corpus has no paragraph chunks to rank")
        sentences = {p.id: [by_id[c] for c in p.children if by_id[c].level == "sentence"]
                     for found in paragraphs.values() for p in found}
        indexes = {doc_id: BM25Index.build([replace(p, title="") for p in found])
                   for doc_id, found in paragraphs.items()}
        return cls(indexes, {p.id: p for found in paragraphs.values() for p in found}, sentences)

    def answer(self, question: str, client: Client, scope: Sequence[str] | None = None) -> StrategyAnswer:
        """The top paragraph of the one document ``scope`` names and its best sentence; ``client`` is not used."""
        if scope is None or len(scope) != 1:
            raise ConfigError("bm25_floor answers within the question's own document (BM25 over its paragraphs); "
                              f"it was given {'the open corpus' if scope is None else f'{len(scope)} documents'}: "
                              "use a document-scoped dataset (qasper, squad, narrativeqa) with scope=auto")
        index = self.indexes.get(scope[0])
        if index is None:
            raise ConfigError(f"bm25_floor: document {scope[0]} has no paragraph in the corpus it was built over")
        top = self.paragraphs[index.search([question], 1)[0][0].chunk.id]
        sentence = best_sentence(question, self.sentences[top.id] or [top])
        return StrategyAnswer(sentence.text, sentence.text, [top],
                              details={"paragraph": top.id, "sentence": sentence.id})
