"""SmartChunk retrieval over a real SQuAD article: level ranges, bottom-up compressed embeddings, answers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from overstory.core.config import ConfigError, build
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.models.compressor import SetCompressor, SetCompressorConfig, save_checkpoint
from overstory.models.registry import MINILM, SMOLLM2
from overstory.retrieval.metrics import mean, recall_at_k
from overstory.retrieval.smartchunk import FALLBACK_RANGE, SmartChunkConfig, SmartChunkRetriever
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.in_process import in_process_client

ROOT = Path(__file__).resolve().parents[2]


def test_the_fallback_range_is_one_setting_checked_by_name() -> None:
    """The runtime's range for an unreadable plan is the shared default (eval planner reads the same), and a range
    that is not level_min..level_max is refused naming the key."""
    assert SmartChunkConfig().fallback_range == FALLBACK_RANGE == ("sentence", "paragraph")
    loaded = build(SmartChunkConfig, {"fallback_range": ["sentence", "section"]}, prefix="smartchunk")
    assert loaded.fallback_range == ("sentence", "section")
    with pytest.raises(ConfigError, match="smartchunk.fallback_range: level_min 'document' is larger"):
        SmartChunkConfig(fallback_range=("document", "sentence"))
    with pytest.raises(ConfigError, match="smartchunk.fallback_range: unknown level"):
        SmartChunkConfig(fallback_range=("sentences", "paragraph"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    documents, questions = load_corpus(CorpusConfig("squad", str(ROOT / "data/squad/dev-v2.0-articles.json"),
                                                    limit_docs=1))
    chunks = build_hierarchies(documents, HierarchyConfig())
    folder = save_checkpoint(SetCompressor(SetCompressorConfig(encoder=MINILM)),
                             tmp_path_factory.mktemp("ckpt") / "compressor", {})
    with EmbeddedEngine(ServeConfig(port=0, roles={
            "generator": RoleConfig(model=SMOLLM2), "embedder": RoleConfig(model=MINILM, kind="embedding"),
            "compressor": RoleConfig(model=str(folder), kind="compression")})) as engine:
        answerable = [q for q in questions if q.evidence][:60]
        yield chunks, answerable, in_process_client(engine)


def test_ranges_restrict_levels(setup) -> None:
    chunks, questions, client = setup
    retriever = SmartChunkRetriever(chunks, client)
    for level_min, level_max, allowed in (("sentence", "sentence", {"sentence"}),
                                          ("paragraph", "section", {"paragraph", "subsection", "section"})):
        hits = retriever.retrieve([q.question for q in questions[:5]], level_min, level_max, k=5)
        assert all(h.chunk.level in allowed for row in hits for h in row)
        assert all(len(row) == 5 for row in hits)


def test_upper_levels_are_compressed_from_children(setup) -> None:
    chunks, _, client = setup
    retriever = SmartChunkRetriever(chunks, client)
    by_id = {c.id: c for c in chunks}
    paragraph = next(c for c in chunks if c.level == "paragraph")
    # an untrained compressor is the mean of the children's embeddings
    children = np.stack([retriever.embeddings[k] for k in paragraph.children])
    np.testing.assert_allclose(retriever.embeddings[paragraph.id], children.mean(0), atol=1e-5)
    direct = SmartChunkRetriever(chunks, client, upper="direct")
    sentence = by_id[paragraph.children[0]]
    np.testing.assert_allclose(direct.embeddings[sentence.id], retriever.embeddings[sentence.id], atol=1e-6)
    assert not np.allclose(direct.embeddings[paragraph.id], retriever.embeddings[paragraph.id], atol=1e-3)


def test_paragraph_recall_and_answer(setup) -> None:
    chunks, questions, client = setup
    recalls = {}
    for upper in ("compressor", "direct"):
        retriever = SmartChunkRetriever(chunks, client, upper=upper)
        hits = retriever.retrieve([q.question for q in questions], "paragraph", "paragraph", k=5)
        recalls[upper] = mean([recall_at_k([h.chunk for h in row], q.evidence, 5) for q, row in zip(questions, hits)])
    # measured on the first 60 answerable Normans questions: direct 0.850, untrained compressor (mean) 0.817
    assert recalls["direct"] > 0.8 and recalls["compressor"] > 0.6, recalls
    reply, used = SmartChunkRetriever(chunks, client).answer(questions[0].question, "paragraph", "subsection", k=3)
    assert reply.text and len(used) == 3 and {c.level for c in used} <= {"paragraph", "subsection"}
