"""`overstory eval compressor`: four ways to embed the upper levels of a hierarchy, on held-out documents.

    overstory eval compressor --config configs/eval/compressor.yaml --checkpoint DIR --data FILE --out DIR

Methods, for every upper-level chunk of the held-out documents: the training split's validation documents, by
the same hash (``held_out: validation``, for a ``data`` file the compressor was trained on), or every document of
``data`` (``held_out: all``, for summaries of documents kept out of training, e.g. the QASPER dev papers):
- ``compressor``: the trained compressor ``checkpoint`` (either design);
- ``mean_pool``: the mean of the children's embeddings;
- ``direct_encode``: the encoder on the chunk's text (truncated as the encoder truncates);
- ``summarize``: an LLM summary, then the encoder (the expensive target e_gt), regenerated here so
  its cost is measured in the same run.
``extra_checkpoints`` (name -> folder) adds one row per further compressor, so design (a), the set
compressor, and design (b), the fine-tuned text encoder, are compared on the same chunks in one run;
a set compressor reads the children's embeddings, a text compressor their texts.

For each method: cosine to e_gt, recall@k on the real questions whose evidence lies in the held-out
documents (retrieving among the upper-level chunks embedded that way), wall-clock seconds and LLM
tokens spent. The children's embeddings are not counted as cost: they are the lower levels of the
index, embedded anyway. Writes ``metrics.json`` and ``recall_vs_cost.png``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from rich.progress import Progress

from overstory.core.config import ConfigError, to_dict
from overstory.core.records import SummaryRecord, read_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import load_hierarchies, stored_hierarchy_path
from overstory.data_pipeline.splits import split_by_document
from overstory.data_pipeline.summaries import SummariesConfig, SummaryFailed, summarise
from overstory.evaluation.plots import plot_recall_vs_cost
from overstory.models.text_compressor import checkpoint_kind
from overstory.retrieval.index import DenseIndex, chunk_text_for_index
from overstory.retrieval.metrics import bootstrap_interval, mean, recall_at_k
from overstory.serving.client import Client
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.launch import serve_in_background

BASELINES = ("compressor", "mean_pool", "direct_encode", "summarize")


@dataclass(frozen=True)
class EvalCompressorConfig:
    checkpoint: str
    data: str
    corpus: CorpusConfig
    out: str
    # further compressors to compare, each a method row of its own: {name: checkpoint folder}
    extra_checkpoints: dict[str, str] = field(default_factory=dict)
    # validation: the hash split's validation documents of `data` (val_fraction must match the training run's
    # train.val_fraction); all: every document of `data`, summaries of documents the compressor never saw
    held_out: Literal["validation", "all"] = "validation"
    val_fraction: float = 0.2
    k: int = 5
    max_summary_tokens: int = 128
    max_input_chars: int = 12000  # as the summaries job's: chunks are cut at this many characters before summarising
    concurrency: int = 2
    # a running stack with the generator and embedder roles (e.g. the quickstart's); empty: start one from serve
    server_url: str = ""
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        taken = set(self.extra_checkpoints) & set(BASELINES)
        if taken:
            raise ConfigError(f"extra_checkpoints: {', '.join(sorted(taken))} is a method name already; pick another")


def _timed(fn: Callable[[], np.ndarray]) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def held_out_records(records: list[SummaryRecord], config: EvalCompressorConfig) -> list[SummaryRecord]:
    """The summary records evaluated: the validation documents of the training split, or all of them."""
    held_out = split_by_document(records, config.val_fraction)[1] if config.held_out == "validation" else records
    if not held_out:
        raise ValueError(f"no held-out upper-level chunks in {config.data} (held_out: {config.held_out})")
    return held_out


def run(config: EvalCompressorConfig) -> dict:
    checkpoints = {"compressor": config.checkpoint, **config.extra_checkpoints}
    kinds = {name: checkpoint_kind(folder) for name, folder in checkpoints.items()}  # fails before models load
    records = list(read_jsonl(config.data, SummaryRecord))
    held_out = held_out_records(records, config)
    questions = load_corpus(config.corpus)[1]  # the questions and their evidence; the chunks come from the data job
    kept = stored_hierarchy_path(config.data)
    if not kept.exists():
        raise ValueError(f"{kept} not found: `overstory data summaries` stores the hierarchy it summarised there; "
                         f"rerun it (it resumes) to write the hierarchy beside {config.data}")
    chunks = {c.id: c for c in load_hierarchies(kept)}
    missing = [r.id for r in held_out if r.id not in chunks]
    if missing:
        raise ValueError(f"{len(missing)} summarised chunks (e.g. {missing[0]}) are not in {kept}")
    upper = [chunks[r.id] for r in held_out]
    held_docs = {r.doc_id for r in held_out}
    test_questions = [q for q in questions if q.evidence and {s.doc_id for s in q.evidence} <= held_docs]
    targets = np.array([r.target_embedding for r in held_out], dtype=np.float32)
    serve = config.serve

    results: dict[str, dict] = {}
    with ExitStack() as stack:
        tracker = stack.enter_context(start_run(config.tracking, "eval compressor", config))
        client = Client.from_url(config.server_url or stack.enter_context(serve_in_background(serve)))
        children = [np.array(r.child_embeddings, dtype=np.float32) for r in held_out]
        child_texts = [[chunks[cid].text for cid in r.child_ids] for r in held_out]

        def compress_with(name: str) -> Callable[[], np.ndarray]:
            # each compressor on a server of its own (one compressor role per stack), timed like the others
            role = RoleConfig(model=checkpoints[name], kind="compression")
            url = stack.enter_context(serve_in_background(ServeConfig(host=serve.host, port=0,
                                                                      roles={"compressor": role})))
            compressor = Client.from_url(url)
            if kinds[name] == "text-compressor":
                return lambda: compressor.compress("compressor", groups=child_texts)
            return lambda: compressor.compress("compressor", embeddings=children)

        summary_config = SummariesConfig(corpus=config.corpus, out="", max_summary_tokens=config.max_summary_tokens,
                                         max_input_chars=config.max_input_chars, serve=serve)

        def summarize_all() -> np.ndarray:
            def one(record: SummaryRecord) -> np.ndarray:
                chunk = chunks[record.id]
                try:
                    fresh = summarise(chunk, [chunks[k] for k in chunk.children], client, summary_config)
                except SummaryFailed:  # counted as the encoder on the raw text: the fallback a system would use
                    return client.embed("embedder", [chunk_text_for_index(chunk)])[0]
                return np.array(fresh.target_embedding, dtype=np.float32)

            with ThreadPoolExecutor(max_workers=config.concurrency) as pool, Progress() as progress:
                task = progress.add_task("summarize: regenerating summaries", total=len(held_out))

                def counted(record: SummaryRecord) -> np.ndarray:
                    vector = one(record)
                    progress.advance(task)
                    return vector

                return np.stack(list(pool.map(counted, held_out)))

        builders = {
            **{name: compress_with(name) for name in checkpoints},
            "mean_pool": lambda: np.stack([c.mean(0) for c in children]),
            "direct_encode": lambda: client.embed("embedder", [chunk_text_for_index(c) for c in upper]),
            "summarize": summarize_all,
        }
        for i, method in enumerate(builders, 1):
            print(f"[{i}/{len(builders)}] {method}: embedding {len(upper)} upper-level chunks", flush=True)
            before = client.stats.summary().get("generator", {})
            vectors, seconds = _timed(builders[method])
            after = client.stats.summary().get("generator", {})
            index = DenseIndex(upper, vectors, lambda texts: client.embed("embedder", texts))
            hits = index.search([q.question for q in test_questions], config.k) if test_questions else []
            normed = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
            recalls = [recall_at_k([h.chunk for h in row], q.evidence, config.k)
                       for q, row in zip(test_questions, hits)]
            interval = bootstrap_interval(recalls)
            results[method] = {
                "cosine_to_target": float(np.mean(np.sum(normed * targets, axis=1))),
                f"recall@{config.k}": mean(recalls),
                f"recall@{config.k}_ci95": list(interval) if interval else None,
                "seconds": round(seconds, 3),
                "llm_completion_tokens": after.get("completion_tokens", 0) - before.get("completion_tokens", 0),
                "llm_prompt_tokens": after.get("prompt_tokens", 0) - before.get("prompt_tokens", 0),
            }
            tracker.log({f"{method}/{k}": v for k, v in results[method].items() if v is not None})
        for method in builders:  # times under a millisecond count as one: below what the clock resolves here
            results[method]["speedup_vs_summarize"] = round(
                results["summarize"]["seconds"] / max(results[method]["seconds"], 1e-3), 1)
        report = {"checkpoints": checkpoints, "kinds": kinds, "n_upper_chunks": len(upper),
                  "n_documents": len(held_docs), "n_questions": len(test_questions),
                  "levels": sorted({c.level for c in upper}), "methods": results, "config": to_dict(config)}
        tracker.summary({f"{m}/{k}": v for m, row in results.items() for k, v in row.items() if v is not None})
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(report, indent=2))
    plot_recall_vs_cost(results, config.k, out / "recall_vs_cost.png")
    _print(report, config.k)
    return report


def _print(report: dict, k: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report['n_upper_chunks']} upper-level chunks of {report['n_documents']} held-out "
                        f"documents, {report['n_questions']} questions")
    for column in ("method", "cosine to e_gt", f"recall@{k} [95% CI]", "seconds", "LLM tokens",
                   "speed-up vs summarize"):
        table.add_column(column, justify="right")
    for method, row in report["methods"].items():
        recall, interval = row[f"recall@{k}"], row[f"recall@{k}_ci95"]
        shown = "-" if recall is None else f"{recall:.3f}"
        if recall is not None and interval:
            shown += f" [{interval[0]:.2f}, {interval[1]:.2f}]"
        table.add_row(method, f"{row['cosine_to_target']:.3f}", shown,
                      f"{row['seconds']:.2f}", str(row["llm_prompt_tokens"] + row["llm_completion_tokens"]),
                      f"{row['speedup_vs_summarize']:g}x")
    Console(width=110).print(table)
