"""A retrieval objective for the set compressor, beside the SmartChunk paper's MSE to the summary embedding.

The paper trains the compressor to reproduce the embedding of an LLM summary (MSE to e_gt). What the index needs
is that a question lands near the upper-level chunks that hold its evidence. The contrastive objective says so
directly: for an upper-level chunk whose span covers a training question's evidence (the overlap rule recall@k
uses, ``retrieval.metrics.covers``), the chunk's compressed embedding should score that question above the other
chunks of the batch (InfoNCE with in-batch negatives, cosine similarity over a temperature). A chunk of the batch
that also covers the question (a section and its own subsection) is not a negative: it is masked out.

``question_positives`` joins the compressor's records (summary records, or child groups made without summaries),
their chunks and a corpus's questions once; ``PositiveSampler``
draws one covered question per chunk for each batch (a chunk covers several); ``contrastive_loss`` is the loss.
``DocumentBatches`` makes each batch one document's chunks (``train.batching: document``), so the negatives are the
other chunks of the question's own document, the ones a document-scoped search (QASPER, SQuAD) ranks it against;
shuffled batches mostly hold chunks of other documents, which a question tells apart by topic alone.
Questions are embedded with the compressor's own sentence encoder, normalised, as the index embeds queries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from overstory.core.records import Chunk, QAExample
from overstory.retrieval.metrics import covers
from overstory.training.compressor_records import Record


@dataclass(frozen=True)
class QuestionPositives:
    """Question embeddings (normalised, one row per question) and, per record, the indices of the questions whose
    evidence its chunk covers."""

    embeddings: torch.Tensor
    by_record: list[list[int]]

    @property
    def covered_records(self) -> int:
        return sum(bool(q) for q in self.by_record)

    @property
    def uncovered_questions(self) -> int:
        """Questions with evidence in these records' documents that no record's chunk covers: never a positive (an
        upper-level chunk was not summarised, or the evidence lies outside every upper-level chunk), counted rather than
        dropped silently."""
        return len(self.embeddings) - len({i for ids in self.by_record for i in ids})

    def coverage(self, split: str) -> dict[str, int]:
        """The counts a run reports for ``split``: chunks covering a question, questions, questions uncovered."""
        return {f"{split}_chunks_covering": self.covered_records, f"{split}_questions": len(self.embeddings),
                f"{split}_questions_uncovered": self.uncovered_questions}


def question_positives(records: Sequence[Record], chunks: dict[str, Chunk], questions: Sequence[QAExample],
                       encode) -> QuestionPositives:
    """Positives of every record among ``questions`` (only those with evidence in the records' documents are
    embedded); ``encode(texts)`` returns their normalised embeddings as an array."""
    docs = {r.doc_id for r in records}
    kept = [q for q in questions if q.evidence and {s.doc_id for s in q.evidence} & docs]
    by_record = [[i for i, q in enumerate(kept) if any(covers(chunks[r.id], s) for s in q.evidence)]
                 for r in records]
    embeddings = torch.as_tensor(encode([q.question for q in kept]), dtype=torch.float32) if kept else \
        torch.zeros(0, len(records[0].child_embeddings[0]) if records else 0)
    return QuestionPositives(embeddings, by_record)


class DocumentBatches(torch.utils.data.Sampler):
    """Batches of record indices, each from one document: its records in a random order, cut into pieces of at most
    ``batch_size``; the documents in a random order every epoch (``shuffle``, seeded), or as given. The number of
    batches is fixed (the sum over documents of ceil(records / batch_size)), so schedules can count on it.

    >>> [sorted(b) for b in DocumentBatches(["a", "b", "a", "a"], batch_size=2, shuffle=False)]
    [[0, 2], [3], [1]]
    """

    def __init__(self, doc_ids: Sequence[str], batch_size: int, shuffle: bool = True, seed: int = 0):
        by_doc: dict[str, list[int]] = {}
        for index, doc_id in enumerate(doc_ids):
            by_doc.setdefault(doc_id, []).append(index)
        self.documents, self.batch_size, self.shuffle = list(by_doc.values()), batch_size, shuffle
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        order = torch.randperm(len(self.documents), generator=self.generator).tolist() if self.shuffle else \
            range(len(self.documents))
        for d in order:
            indices = self.documents[d]
            if self.shuffle:
                indices = [indices[i] for i in torch.randperm(len(indices), generator=self.generator).tolist()]
            for start in range(0, len(indices), self.batch_size):
                yield indices[start:start + self.batch_size]

    def __len__(self) -> int:
        return sum(-(-len(indices) // self.batch_size) for indices in self.documents)


class PositiveSampler:
    """Per batch of record indices: one covered question per record (-1 for none, drawn with the sampler's seeded
    generator, or the first when ``deterministic``, for validation), its embedding, and which other records of
    the batch cover that question too (``also_covers[i, j]``), so that they are not counted as negatives."""

    def __init__(self, positives: QuestionPositives, seed: int = 0, deterministic: bool = False):
        self.positives, self.deterministic = positives, deterministic
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        chosen = []
        for index in indices:
            options = self.positives.by_record[index]
            if not options:
                chosen.append(-1)
            elif self.deterministic:
                chosen.append(options[0])
            else:
                chosen.append(options[int(torch.randint(len(options), (1,), generator=self.generator))])
        dim = self.positives.embeddings.shape[1]
        question = torch.stack([self.positives.embeddings[q] if q >= 0 else torch.zeros(dim) for q in chosen])
        also = torch.tensor([[i != j and q >= 0 and q in self.positives.by_record[other]
                              for j, other in enumerate(indices)] for i, q in enumerate(chosen)], dtype=torch.bool)
        return {"question": question, "has_question": torch.tensor([q >= 0 for q in chosen]), "also_covers": also}


def contrastive_loss(compressed: torch.Tensor, question: torch.Tensor, has_question: torch.Tensor,
                     also_covers: torch.Tensor, temperature: float) -> torch.Tensor:
    """InfoNCE over the batch: row i's question against every record's compressed embedding, its own record the
    positive, records that also cover it masked out; the mean over rows with a question (0 when none has one,
    keeping the graph so that backward still runs).

    >>> q = torch.eye(3)
    >>> loss = contrastive_loss(q.clone(), q, torch.tensor([True, True, False]), torch.zeros(3, 3, dtype=torch.bool),
    ...                         temperature=0.1)
    >>> round(float(loss), 4)  # each question is closest to its own record
    0.0001
    """
    if not bool(has_question.any()):
        return compressed.sum() * 0.0
    logits = F.normalize(question, dim=-1) @ F.normalize(compressed, dim=-1).T / temperature
    logits = logits.masked_fill(also_covers.to(logits.device), float("-inf"))
    targets = torch.arange(len(compressed), device=compressed.device)
    rows = has_question.to(compressed.device)
    return F.cross_entropy(logits[rows], targets[rows])
