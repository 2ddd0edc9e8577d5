"""Train/validation splits that never leak a document across the boundary."""

from __future__ import annotations

import hashlib
from typing import Protocol, TypeVar


class _HasDoc(Protocol):
    doc_id: str


R = TypeVar("R", bound=_HasDoc)


def document_bucket(doc_id: str) -> float:
    """A document's fixed place in [0, 1], from a hash of its id."""
    return int(hashlib.sha1(doc_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def split_by_document(records: list[R], val_fraction: float) -> tuple[list[R], list[R]]:
    """Deterministic split on a hash of the document id: every group of a document lands on one side."""
    docs = sorted({r.doc_id for r in records}, key=document_bucket)
    n_val = min(max(1, round(len(docs) * val_fraction)), len(docs) - 1) if len(docs) > 1 else 0
    if n_val == 0:
        raise ValueError(f"need groups from at least two documents to split by document, got {len(docs)}")
    val_docs = set(docs[:n_val])
    return [r for r in records if r.doc_id not in val_docs], [r for r in records if r.doc_id in val_docs]


def held_out_by_threshold(records: list[R], share: float) -> tuple[list[R], list[R]]:
    """(kept, held out): a document is held out when its bucket is below ``share``. Unlike ``split_by_document``,
    a document's side does not depend on which other documents are present, so a label file that grows (a resumed
    labelling job) keeps every held-out document held out."""
    held = [r for r in records if document_bucket(r.doc_id) < share]
    return [r for r in records if document_bucket(r.doc_id) >= share], held
