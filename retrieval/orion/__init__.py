"""Orion-RAG (arXiv 2601.04764, "Orion-RAG: Path-Aligned Hybrid Retrieval for Graphless Data") as a retrieval strategy.

Modules: tags (the tag records, their files, a chunk's semantic path), tagger (the index side: windows and tags),
query (rewriting, fusion, pruning and the answer prompt as pure functions) and strategy (``OrionStrategy``).

Index (``tagger``). Each document is cut into sliding windows of characters (``tagger.window_spans``:
``chunk_chars`` 500 by default; the paper found 2,000 better for generation on Wikipedia text, a setting). The
``generator`` tags each document with up to ``max_master_tags`` master tags, read from its title and start, and each
chunk with exactly three paragraph tags of 1-4 words (gist, subjects, domain), through json_schema structured
outputs (``tagger.Tagger``). A reply that stays unusable after ``max_attempts`` gets deterministic tags made of
the text's own words (``source="fallback"``) and a failure record with the raw reply, so no chunk is lost. A
chunk's semantic path joins both layers (``tags.semantic_path``: "Master tag, master tag > gist > subjects >
domain"). Three indexes cover the chunks: dense over the paths (``tag``), dense over the texts (``semantic``) and
BM25 over the texts (``sparse``).

Query. The generator rewrites the question into at most ``rewrite_max`` sub-queries of at most
``rewrite_max_words`` words (the question itself always searches too); each sub-query ranks the chunks in the three
indexes, fused by weighted reciprocal rank fusion (``query.weighted_rrf``, weights 0.25 / 0.25 / 0.5) into its top
``top_k``; one generator call per (chunk, sub-query) keeps the chunk's sentences that could help that sub-query
(numbered; a reply that keeps none drops the chunk from the prompt); the generator answers from the pruned evidence
grouped per sub-query.

Files. ``overstory data orion-tags`` (data_pipeline/orion_tags.py) writes, in its ``out`` folder, masters.jsonl
(``DocumentTags``), chunks.jsonl (``ChunkTags``: each chunk's text and document offsets with its tags, so the
strategy needs nothing else) and vectors.npz (the embeddings of paths and texts: a cache, whatever it lacks is
embedded at build). ``overstory data orion-tags-edit`` changes one document's master tags and re-indexes that
document alone (``strategy.OrionStrategy.reindex_document``). The tagging itself lives here, below data_pipeline
(tests/test_layers.py), as LATTICE's keyword summaries do.

Configs: ``OrionConfig`` for the strategy (the evaluation harness builds it); the tagging job's is
configs/data/orion_tags.yaml.
"""
