"""Plain retrieve-then-generate over a QA dataset: the baseline every strategy is compared with.

    overstory eval rag --config configs/eval/rag.yaml

Loads a corpus, builds the chunk hierarchies, indexes the chosen levels, retrieves the top-k
chunks per question, asks the ``generator`` role for a short answer through the serving client,
and scores recall@k against the gold evidence, exact match and token F1. Writes
``metrics.json`` and ``predictions.jsonl`` to ``out``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from rich.progress import Progress

from overstory.core.config import ConfigError, to_dict
from overstory.core.records import Chunk, QAExample, write_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies, chunks_at_levels
from overstory.retrieval.answer import answer_messages, clean_answer
from overstory.retrieval.index import IndexKind, build_index
from overstory.retrieval.metrics import contains_match, exact_match, mean, recall_at_k, token_f1
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig
from overstory.serving.launch import stack_in_background


@dataclass(frozen=True)
class RetrievalConfig:
    index: IndexKind = "hybrid"
    levels: list[str] = field(default_factory=lambda: ["paragraph"])
    k: int = 5

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"retrieval.k must be at least 1, got {self.k}")


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 24
    temperature: float = 0.0
    # chunks placed in the prompt; the context is cut at this many characters per chunk
    context_chunks: int = 3
    max_chunk_chars: int = 1500
    concurrency: int = 2


@dataclass(frozen=True)
class RagEvalConfig:
    corpus: CorpusConfig = field(default_factory=lambda: CorpusConfig(kind="hotpotqa", path="data/hotpotqa"))
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    # questions to evaluate (0 = all); answerable ones only when skip_unanswerable
    limit_questions: int = 0
    skip_unanswerable: bool = True
    # an existing server's URL; empty starts the embedded stack described by `serve` in the background
    server_url: str = ""
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local())
    out: str = "runs/eval/rag"
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def select_questions(questions: Sequence[QAExample], limit: int, skip_unanswerable: bool) -> list[QAExample]:
    kept = [q for q in questions if q.answers or not skip_unanswerable]
    return kept[:limit] if limit else kept


def index_for(chunks: Sequence[Chunk], client: Client, retrieval: RetrievalConfig):
    """The configured index over the configured levels, embedding through the ``embedder`` role."""
    indexed = chunks_at_levels(chunks, retrieval.levels)
    return build_index(retrieval.index, indexed, embed=lambda texts: client.embed("embedder", texts))


def evaluate_rag(questions: Sequence[QAExample], index, client: Client, retrieval: RetrievalConfig,
                 generation: GenerationConfig, progress: Progress | None = None) -> tuple[dict, list[dict]]:
    """Retrieve from ``index``, answer with the generator and score each question;
    returns (metrics, per-question records)."""
    started = time.perf_counter()
    k = max(retrieval.k, generation.context_chunks)
    hits = index.search([q.question for q in questions], k)
    task = progress.add_task("answering", total=len(questions)) if progress else None

    def answer(pair: tuple[QAExample, list]) -> dict:
        question, question_hits = pair
        retrieved = [h.chunk for h in question_hits]
        reply = client.chat("generator", answer_messages(question.question, retrieved[: generation.context_chunks],
                                                         generation.max_chunk_chars),
                            max_tokens=generation.max_tokens, temperature=generation.temperature)
        prediction = clean_answer(reply.text)
        if progress is not None:
            progress.advance(task)
        return {
            "id": question.id, "question": question.question, "answers": question.answers,
            "prediction": prediction, "raw": reply.text,
            "retrieved": [c.id for c in retrieved[: retrieval.k]],
            f"recall@{retrieval.k}": recall_at_k(retrieved, question.evidence, retrieval.k),
            "exact_match": exact_match(prediction, question.answers),
            "token_f1": token_f1(prediction, question.answers),
            # lenient: the gold answer appears in the raw reply (small models answer in sentences)
            "contains_match": contains_match(reply.text, question.answers),
            "latency_s": reply.latency_s,
        }

    with ThreadPoolExecutor(max_workers=generation.concurrency) as pool:
        records = list(pool.map(answer, zip(questions, hits)))
    metrics = {
        "n_questions": len(records),
        "index": retrieval.index,
        "levels": list(retrieval.levels),
        "n_chunks_indexed": len(index.chunks),
        f"recall@{retrieval.k}": mean([r[f"recall@{retrieval.k}"] for r in records]),
        "exact_match": mean([r["exact_match"] for r in records]),
        "token_f1": mean([r["token_f1"] for r in records]),
        "contains_match": mean([r["contains_match"] for r in records]),
        "seconds": round(time.perf_counter() - started, 2),
    }
    return metrics, records


def run(config: RagEvalConfig) -> dict:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    documents, questions = load_corpus(config.corpus)
    questions = select_questions(questions, config.limit_questions, config.skip_unanswerable)
    if not questions:
        raise ConfigError(f"corpus {config.corpus.path} has no questions to evaluate")
    chunks = build_hierarchies(documents, config.hierarchy)
    with ExitStack() as stack, start_run(config.tracking, "eval rag", config) as run_, Progress() as progress:
        url = config.server_url or stack.enter_context(stack_in_background(config.serve))
        client = Client.from_url(url)
        index = index_for(chunks, client, config.retrieval)
        metrics, records = evaluate_rag(questions, index, client, config.retrieval, config.generation, progress)
        metrics["dataset"] = config.corpus.kind
        metrics["usage"] = client.stats.summary()
        run_.summary(metrics)
    write_jsonl(out / "predictions.jsonl", records)
    (out / "metrics.json").write_text(json.dumps({"config": to_dict(config), **metrics}, indent=2))
    print(json.dumps({k: v for k, v in metrics.items() if k != "usage"}, indent=2))
    return metrics
