"""`overstory eval compressor`: four ways to embed the upper levels of a hierarchy, on held-out documents.

    overstory eval compressor --config configs/eval/compressor.yaml --checkpoint DIR --data FILE --out DIR
    overstory eval compressor --config configs/eval/compressor-qasper-all.yaml   # no summaries

The upper-level chunks come from summary records (``data``: ``overstory data summaries`` output, with e_gt) or,
without summaries (``groups``), from the ``corpus``'s own hierarchy, their children embedded by the served embedder
(``data_pipeline/compressor_groups.py``); then ``summarize`` and the cosine to e_gt are left out (named in
``metrics.json``), and the other methods run on every upper-level chunk.
Methods, for every upper-level chunk of the held-out documents: the training split's validation documents, by
the same hash (``held_out: validation``, for a ``data`` file the compressor was trained on), or every document of
``data`` (``held_out: all``, for summaries of documents kept out of training, e.g. the QASPER dev papers):
- ``compressor``: the trained compressor ``checkpoint`` (either design);
- ``mean_pool``: the mean of the children's embeddings;
- ``direct_encode``: the encoder on the chunk's text (truncated as the encoder truncates);
- ``summarize``: an LLM summary, then the encoder (the expensive target e_gt), regenerated here so
  its cost is measured in the same run (``summarize: recorded`` reads the summaries of ``data`` instead, with the
  tokens and time their job recorded: for a teacher whose summaries of every held-out chunk took hours).
``extra_checkpoints`` (name -> folder) adds one row per further compressor, so design (a), the set
compressor, and design (b), the fine-tuned text encoder, are compared on the same chunks in one run;
a set compressor reads the children's embeddings, a text compressor their texts.

For each method: cosine to e_gt, recall@k on the real questions whose text evidence lies in the held-out
documents (those whose evidence is only a figure or table, or who have no text evidence, are left out and counted,
and so are the kept ones that no held-out chunk covers), retrieving among the upper-level chunks embedded that way
(under ``scope: auto`` those of the question's own document on a document-scoped dataset, QASPER, SQuAD or
NarrativeQA, as ``eval pipeline`` searches them, and all of them on HotpotQA; ``scope: corpus`` ranks every held-out
document's chunks for every question, the harder open-corpus variant; ``evaluation/scope.py``), wall-clock seconds, LLM
tokens spent, and its repairs by kind: a summary that fails is replaced by the encoder on the chunk's
text inside the ``summarize`` row (``summary_failed_direct_encode``), so that row measures partly
direct_encode, and says how much. The children's embeddings are not counted as cost: they are the lower levels of the
index, embedded anyway. Writes ``metrics.json`` (with the scope searched and how many chunks each question was
ranked among) and ``recall_vs_cost.png``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np
from rich.console import Console
from rich.table import Table

from overstory.core.config import ConfigError, to_dict
from overstory.core.progress import JobProgress
from overstory.core.records import Chunk, QAExample, SummaryRecord, read_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.compressor_groups import (
    ChildGroup,
    GroupsConfig,
    child_groups,
    question_counts,
    uncovered_questions,
    upper_chunks,
)
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import build_hierarchies, load_hierarchies, stored_hierarchy_path
from overstory.data_pipeline.splits import split_by_document
from overstory.data_pipeline.summaries import SummariesConfig
from overstory.data_pipeline.summarize import SummaryFailed, summarise
from overstory.evaluation.compressor_paired import paired_methods, paired_methods_table, per_question_key
from overstory.evaluation.plots import plot_recall_vs_cost
from overstory.evaluation.repairs import repairs_cell
from overstory.evaluation.scope import resolve_scope, scope_title, search_in_scope
from overstory.models.text_compressor import checkpoint_kind
from overstory.retrieval.index import DenseIndex, Hit, chunk_text_for_index
from overstory.retrieval.metrics import bootstrap_interval, mean, recall_at_k
from overstory.serving.client import Client
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.job_client import client_for, served_models
from overstory.serving.launch import serve_in_background

BASELINES = ("compressor", "mean_pool", "direct_encode", "summarize")
EMBED_BATCH = 256  # children embedded per request when groups are built here


@dataclass(frozen=True)
class EvalCompressorConfig:
    checkpoint: str
    corpus: CorpusConfig
    out: str
    # summary records (`overstory data summaries` output); empty: no summaries, `groups` takes the corpus's own upper
    # levels (no summarize row, no cosine to e_gt)
    data: str = ""
    groups: GroupsConfig | None = None
    # further compressors to compare, each a method row of its own: {name: checkpoint folder}
    extra_checkpoints: dict[str, str] = field(default_factory=dict)
    # validation: the hash split's validation documents of `data` (val_fraction must match the training run's
    # train.val_fraction); all: every document of `data`, summaries of documents the compressor never saw
    held_out: Literal["validation", "all"] = "validation"
    val_fraction: float = 0.2
    k: int = 5
    # auto: each question ranks its own document's chunks where the dataset poses it so (squad, qasper, narrativeqa),
    # every held-out chunk otherwise (hotpotqa); document / corpus: force one (corpus on qasper: open-corpus QASPER)
    scope: str = "auto"
    max_summary_tokens: int = 128
    max_input_chars: int = 12000  # as the summaries job's: chunks are cut at this many characters before summarising
    # summarize: regenerate (each summary made afresh, timed in this run) or recorded (data's own summaries, with the
    # tokens the summaries job recorded and its wall time from summaries_record, e.g. the teacher runbook's
    # jobs/summaries-qasper_dev.json, in proportion to the chunks evaluated; without it the seconds are unknown)
    summarize: Literal["regenerate", "recorded"] = "regenerate"
    summaries_record: str = ""
    concurrency: int = 2
    # a running stack with the generator and embedder roles (e.g. the quickstart's); empty: start one from serve
    server_url: str = ""
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if bool(self.data) == (self.groups is not None):
            raise ConfigError("give data (a summaries file from `overstory data summaries`) or groups (the corpus's "
                              "own upper levels, no summaries, e.g. groups: {levels: [subsection, section]}), exactly "
                              f"one; got data={self.data!r}, groups={self.groups}")
        if self.summaries_record and self.summarize != "recorded":
            raise ConfigError("summaries_record: only read with summarize: recorded (regenerate times its own run)")
        taken = set(self.extra_checkpoints) & set(BASELINES)
        if taken:
            raise ConfigError(f"extra_checkpoints: {', '.join(sorted(taken))} is a method name already; pick another")
        resolve_scope(self.scope, self.corpus)  # an unknown scope, or document scope on an open corpus, names the key

    @property
    def scope_mode(self) -> str:
        """Where questions are searched: ``document`` (each within its own document) or ``corpus`` (everywhere)."""
        return resolve_scope(self.scope, self.corpus)


@dataclass
class HeldOut:
    """What every method embeds and is scored on: the held-out upper-level chunks with their children's embeddings
    and texts, their e_gt targets (None without summaries), the questions whose text evidence lies in their
    documents, and how many questions were left out or are covered by no held-out chunk (``question_counts``)."""

    records: list[SummaryRecord] | list[ChildGroup]
    chunks: dict[str, Chunk]
    upper: list[Chunk]
    children: list[np.ndarray]
    child_texts: list[list[str]]
    targets: np.ndarray | None
    questions: list[QAExample]
    n_documents: int
    question_counts: dict[str, int] = field(default_factory=dict)

    @property
    def has_summaries(self) -> bool:
        return self.targets is not None


def held_out_records(records: list, config: EvalCompressorConfig) -> list:
    """The records (or chunks) evaluated: those of the training split's validation documents, or all of them."""
    held_out = split_by_document(records, config.val_fraction)[1] if config.held_out == "validation" else records
    if not held_out:
        raise ValueError(f"no held-out upper-level chunks in {config.data or config.corpus.path} "
                         f"(held_out: {config.held_out})")
    return held_out


def summary_held_out(config: EvalCompressorConfig) -> tuple[list[SummaryRecord], dict[str, Chunk]]:
    """The held-out summary records of ``data`` and the hierarchy the summaries job stored beside it, by id."""
    held_out = held_out_records(list(read_jsonl(config.data, SummaryRecord)), config)
    kept = stored_hierarchy_path(config.data)
    if not kept.exists():
        raise ValueError(f"{kept} not found: `overstory data summaries` stores the hierarchy it summarised there; "
                         f"rerun it (it resumes) to write the hierarchy beside {config.data}")
    chunks = {c.id: c for c in load_hierarchies(kept)}
    missing = [r.id for r in held_out if r.id not in chunks]
    if missing:
        raise ValueError(f"{len(missing)} summarised chunks (e.g. {missing[0]}) are not in {kept}")
    return held_out, chunks


def group_held_out(config: EvalCompressorConfig, groups: GroupsConfig, documents: list, client: Client
                   ) -> tuple[list[ChildGroup], dict[str, Chunk]]:
    """Without summaries: the held-out documents' upper-level chunks of the corpus's own hierarchy (``groups``),
    their children embedded by the served embedder (the encoder that embeds the questions and direct_encode's
    chunks)."""
    chunks = build_hierarchies(documents, groups.hierarchy)
    held_docs = {c.doc_id for c in held_out_records(upper_chunks(chunks, groups.levels), config)}
    kept = [c for c in chunks if c.doc_id in held_docs]

    def embed(texts: list[str]) -> np.ndarray:
        return np.concatenate([client.embed("embedder", texts[i:i + EMBED_BATCH])
                               for i in range(0, len(texts), EMBED_BATCH)])

    encoder = served_models(client, ["embedder"]).get("embedder", "")
    print(f"groups without summaries: embedding the children of {len(upper_chunks(kept, groups.levels))} "
          f"upper-level chunks of {len(held_docs)} documents with {encoder}", flush=True)
    return child_groups(kept, groups.levels, embed, encoder), {c.id: c for c in kept}


def load_held_out(config: EvalCompressorConfig, client: Client) -> HeldOut:
    """The held-out upper-level chunks (of the summary records' stored hierarchy, or of the corpus's own without
    summaries), and the questions about their documents: those with text evidence kept, the rest counted."""
    documents, questions = load_corpus(config.corpus)
    records, chunks = summary_held_out(config) if config.groups is None else \
        group_held_out(config, config.groups, documents, client)
    upper = [chunks[r.id] for r in records]
    kept, counts = question_counts(questions, {r.doc_id for r in records}, within=True)
    counts["uncovered"] = uncovered_questions(kept, upper)
    return HeldOut(
        records=records, chunks=chunks, upper=upper,
        children=[np.array(r.child_embeddings, dtype=np.float32) for r in records],
        child_texts=[[chunks[cid].text for cid in r.child_ids] for r in records],
        targets=np.array([r.target_embedding for r in records], dtype=np.float32) if config.groups is None else None,
        questions=kept, n_documents=len({r.doc_id for r in records}), question_counts=counts)


def compress_with(checkpoint: str, kind: str, data: HeldOut, serve: ServeConfig, stack: ExitStack
                  ) -> Callable[[], np.ndarray]:
    """One compressor checkpoint on a server of its own (one compressor role per stack, the job's other serve
    settings kept): a set compressor reads the children's embeddings, a text compressor their texts."""
    role = RoleConfig(model=checkpoint, kind="compression")
    compressor = Client.from_url(stack.enter_context(serve_in_background(
        replace(serve, port=0, roles={"compressor": role}))))
    if kind == "text-compressor":
        return lambda: compressor.compress("compressor", groups=data.child_texts)
    return lambda: compressor.compress("compressor", embeddings=data.children)


def summarize_with(config: EvalCompressorConfig, data: HeldOut, client: Client, repairs: Counter[str]
                   ) -> Callable[[], np.ndarray]:
    """The ``summarize`` method: each chunk summarised afresh, then encoded. A summary that fails is replaced by the
    encoder on the chunk's raw text (the fallback a system would use), counted in ``repairs`` under
    ``summary_failed_direct_encode``: the row's figures then partly measure direct_encode."""
    summary_config = SummariesConfig(corpus=config.corpus, out="", max_summary_tokens=config.max_summary_tokens,
                                     max_input_chars=config.max_input_chars, serve=config.serve)

    def one(record: SummaryRecord) -> tuple[np.ndarray, bool]:
        """The chunk's embedding, and whether it is the fallback's."""
        chunk = data.chunks[record.id]
        try:
            fresh = summarise(chunk, [data.chunks[k] for k in chunk.children], client, summary_config)
        except SummaryFailed:
            return client.embed("embedder", [chunk_text_for_index(chunk)])[0], True
        return np.array(fresh.target_embedding, dtype=np.float32), False

    def summarize_all() -> np.ndarray:
        with ThreadPoolExecutor(max_workers=config.concurrency) as pool, JobProgress() as progress:
            task = progress.add_task("summarize: regenerating summaries", total=len(data.records))

            def counted(record: SummaryRecord) -> tuple[np.ndarray, bool]:
                result = one(record)
                progress.advance(task)
                return result

            vectors, fell_back = zip(*pool.map(counted, data.records))
        repairs["summary_failed_direct_encode"] += sum(fell_back)
        return np.stack(vectors)

    return summarize_all


def recorded_cost(config: EvalCompressorConfig, data: HeldOut) -> dict:
    """The ``summarize`` row's cost under ``summarize: recorded``: the generator tokens the summaries job recorded for
    the chunks evaluated, and its wall time (``summaries_record``'s ``wall_s``) in proportion to them (None without a
    record), with where the figures come from."""
    total = sum(1 for _ in read_jsonl(config.data))
    seconds = None
    if config.summaries_record:
        seconds = round(json.loads(Path(config.summaries_record).read_text())["wall_s"] * len(data.records) / total, 3)
    return {"seconds": seconds, "llm_prompt_tokens": sum(r.prompt_tokens for r in data.records),
            "llm_completion_tokens": sum(r.completion_tokens for r in data.records),
            "source": f"recorded: {len(data.records)} of the {total} summaries in {config.data}, seconds "
                      + (f"{seconds} ({config.summaries_record}'s wall_s in proportion)" if seconds is not None
                         else "unknown (no summaries_record)")}


def rank(data: HeldOut, vectors: np.ndarray, client: Client, k: int, mode: str) -> list[list[Hit]]:
    """Each question's top ``k`` upper-level chunks, embedded as ``vectors``: among its own document's under the
    ``document`` mode, among all of them under ``corpus`` (``evaluation/scope.py``). Questions that share a scope
    are embedded in one request."""
    index = DenseIndex(data.upper, vectors, lambda texts: client.embed("embedder", texts))
    return search_in_scope(index, data.questions, k, mode)


def candidates_per_question(data: HeldOut, mode: str) -> float | None:
    """How many upper-level chunks a question is ranked among, on average (recall@k over fewer than k is 1)."""
    per_document = Counter(c.doc_id for c in data.upper)
    counts = [len(data.upper) if mode == "corpus" else per_document[q.metadata.get("doc_id")]
              for q in data.questions]
    return mean(counts)


def measure(build: Callable[[], np.ndarray], data: HeldOut, client: Client, k: int, mode: str) -> dict:
    """One method's row: its embeddings' cosine to e_gt (None without summaries), recall@k of the questions among
    the chunks embedded that way (in each question's scope, ``mode``; with a 95% bootstrap interval, and each
    question's, in ``data.questions``' order, for the paired comparison), the seconds it took and the generator tokens
    it spent."""
    before = client.stats.summary().get("generator", {})
    started = time.perf_counter()
    vectors = build()
    seconds = time.perf_counter() - started
    after = client.stats.summary().get("generator", {})
    hits = rank(data, vectors, client, k, mode)
    normed = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    recalls = [recall_at_k([h.chunk for h in row], q.evidence, k) for q, row in zip(data.questions, hits)]
    interval = bootstrap_interval(recalls)
    cosine = float(np.mean(np.sum(normed * data.targets, axis=1))) if data.has_summaries else None
    return {"cosine_to_target": cosine,
            f"recall@{k}": mean(recalls), f"recall@{k}_ci95": list(interval) if interval else None,
            per_question_key(k): recalls,
            "seconds": round(seconds, 3),
            "llm_completion_tokens": after.get("completion_tokens", 0) - before.get("completion_tokens", 0),
            "llm_prompt_tokens": after.get("prompt_tokens", 0) - before.get("prompt_tokens", 0)}


def run(config: EvalCompressorConfig) -> dict:
    checkpoints = {"compressor": config.checkpoint, **config.extra_checkpoints}
    kinds = {name: checkpoint_kind(folder) for name, folder in checkpoints.items()}  # fails before models load
    results: dict[str, dict] = {}
    with ExitStack() as stack:
        tracker = stack.enter_context(start_run(config.tracking, "eval compressor", config))
        client = stack.enter_context(client_for(config.serve, config.server_url))
        data = load_held_out(config, client)
        print_questions(data)
        summary_repairs: Counter[str] = Counter()
        builders = {
            **{name: compress_with(checkpoints[name], kinds[name], data, config.serve, stack) for name in checkpoints},
            "mean_pool": lambda: np.stack([c.mean(0) for c in data.children]),
            "direct_encode": lambda: client.embed("embedder", [chunk_text_for_index(c) for c in data.upper]),
        }
        if data.has_summaries and config.summarize == "regenerate":  # without summaries: nothing to regenerate
            builders["summarize"] = summarize_with(config, data, client, summary_repairs)
        elif data.has_summaries:
            builders["summarize"] = lambda: data.targets
        for i, method in enumerate(builders, 1):
            print(f"[{i}/{len(builders)}] {method}: embedding {len(data.upper)} upper-level chunks", flush=True)
            results[method] = measure(builders[method], data, client, config.k, config.scope_mode)
            results[method]["repairs"] = ({k: n for k, n in summary_repairs.items() if n} if method == "summarize"
                                          else {})
            if method == "summarize" and config.summarize == "recorded":
                results[method].update(recorded_cost(config, data))
            tracker.log({f"{method}/{k}": v for k, v in results[method].items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)})
        summarize_seconds = results.get("summarize", {}).get("seconds")
        for method in builders:  # times under a millisecond count as one: below what the clock resolves here
            results[method]["speedup_vs_summarize"] = round(
                summarize_seconds / max(results[method]["seconds"], 1e-3), 1) if summarize_seconds else None
        report = build_report(config, data, checkpoints, kinds, results)
        tracker.summary({f"{m}/{k}": v for m, row in results.items() for k, v in row.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)})
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(report, indent=2))
    plot_recall_vs_cost(results, config.k, out / "recall_vs_cost.png")
    print_table(report, config.k)
    if report["paired"]:
        print("each checkpoint against each baseline, question by question:\n" + paired_methods_table(report))
    return report


def build_report(config: EvalCompressorConfig, data: HeldOut, checkpoints: dict[str, str], kinds: dict[str, str],
                 results: dict[str, dict]) -> dict:
    """metrics.json's content: what was evaluated (the dataset and the scope its questions were searched in, with
    how many chunks each was ranked among; the questions left out and uncovered; the records' source and any method
    left out), each method's row, every checkpoint against every baseline question by question (``paired``; the
    questions' ids in ``question_ids``), and the config."""
    left_out = {} if data.has_summaries else {
        "summarize": "no summaries (groups: the corpus's own upper levels): nothing to regenerate or compare to"}
    return {"checkpoints": checkpoints, "kinds": kinds, "dataset": config.corpus.kind, "scope": config.scope_mode,
            "records": "summaries" if data.has_summaries else "groups",
            "candidates_per_question": candidates_per_question(data, config.scope_mode),
            "n_upper_chunks": len(data.upper), "n_documents": data.n_documents, "n_questions": len(data.questions),
            "questions_left_out": {k: data.question_counts.get(k, 0) for k in ("figure_table_only",
                                                                                "no_text_evidence")},
            "questions_uncovered": data.question_counts.get("uncovered", 0), "methods_left_out": left_out,
            "levels": sorted({c.level for c in data.upper}), "methods": results,
            "question_ids": [q.id for q in data.questions],
            "paired": paired_methods(results, list(checkpoints), config.k),
            "config": to_dict(config)}


def print_questions(data: HeldOut) -> None:
    """Which questions are scored, and how many were left out or can reach no held-out chunk."""
    counts = data.question_counts
    print(f"questions: {len(data.questions)} with text evidence in the {data.n_documents} held-out documents scored "
          f"({counts.get('uncovered', 0)} of them covered by no upper-level chunk: recall 0); left out "
          f"{counts.get('figure_table_only', 0)} whose evidence is only a figure or table and "
          f"{counts.get('no_text_evidence', 0)} with no text evidence", flush=True)


def print_table(report: dict, k: int) -> None:
    """The methods' rows, under what was evaluated and the scope the questions were searched in."""
    candidates = report["candidates_per_question"]
    table = Table(title=f"{report['n_upper_chunks']} upper-level chunks of {report['n_documents']} held-out "
                        f"documents, {report['n_questions']} questions, each ranking "
                        f"{'-' if candidates is None else f'{candidates:.1f}'} chunks on average")
    for column in ("method", "cosine to e_gt", f"recall@{k} [95% CI]", "seconds", "LLM tokens",
                   "speed-up vs summarize", "repairs"):
        table.add_column(column, justify="right")
    for method, row in report["methods"].items():
        recall, interval = row[f"recall@{k}"], row[f"recall@{k}_ci95"]
        shown = "-" if recall is None else f"{recall:.3f}"
        if recall is not None and interval:
            shown += f" [{interval[0]:.2f}, {interval[1]:.2f}]"
        cosine, speedup = row["cosine_to_target"], row["speedup_vs_summarize"]
        table.add_row(method, "-" if cosine is None else f"{cosine:.3f}", shown,
                      "-" if row["seconds"] is None else f"{row['seconds']:.2f}",
                      str(row["llm_prompt_tokens"] + row["llm_completion_tokens"]),
                      "-" if speedup is None else f"{speedup:g}x", repairs_cell(row.get("repairs")))
    console = Console(width=110)
    console.print(scope_title(report))
    console.print(table)
    left_out = report.get("questions_left_out", {})
    console.print(f"questions left out: {left_out.get('figure_table_only', 0)} evidence only a figure or table, "
                  f"{left_out.get('no_text_evidence', 0)} no text evidence; scored but covered by no upper-level "
                  f"chunk: {report.get('questions_uncovered', 0)}"
                  + "".join(f"; {m} left out: {why}" for m, why in report.get("methods_left_out", {}).items()))
