"""`overstory data pseudo-labels`: the planner's training labels, found by retrieving and answering.

    overstory data pseudo-labels --config configs/data/pseudo_labels.yaml

SmartChunk's labelling procedure, per question: build the full hierarchy of its document, retrieve
the top-k chunks over all levels, and let the backbone (the ``generator`` role) answer from them. If
the answer is correct, the label is the smallest and largest level among the retrieved chunks. If
not, retrieval expands (``k`` grows by ``k_step`` and the smallest level moves one up, favouring
larger chunks) and the backbone answers again, up to ``max_attempts``. A question no attempt answers
is kept with ``correct: false`` and no label, so its cost is visible and a rerun skips it.

Correctness is configurable: exact match, token F1 above a threshold, answer contained in the reply, or an LLM judge
(the ``scorer`` role answers yes/no). Where the dataset marks evidence (QASPER, SQuAD) the gold levels of
``gold_labels.py`` are stored too (``gold_level_min``/``gold_level_max``), and the job ends by measuring the labelling
method itself against them (``label_agreement.py``: ``<out stem>.agreement.json`` and ``.agreement.png``), and the
answer-grounded rule beside it (``grounded_levels.py``: the range read off where the reply lies among the retrieved
chunks instead of off every level retrieval returned). A question belongs to the one document its evidence lies in,
or, for datasets without evidence spans (NarrativeQA), the document it was asked about. Output is a resumable JSONL of
``PseudoLabel`` records (ids already written are skipped), with the question's evidence spans, and beside it the
hierarchy it labelled on (``<out stem>.hierarchy.jsonl``), which the traces job, the planner recipes and ``eval
planner`` read instead of rebuilding it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from overstory.core.config import ConfigError
from overstory.core.records import LEVELS, Chunk, Document, PseudoLabel, QAExample, read_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.fanout import Fanout, ServedWork, job_server, job_settings
from overstory.data_pipeline.gold_labels import GOLD_KINDS, exclusion, gold_label
from overstory.data_pipeline.grounded_levels import ground_labels
from overstory.data_pipeline.hierarchy import (
    HierarchyConfig,
    build_hierarchies,
    load_hierarchies,
    save_hierarchies,
    stored_hierarchy_path,
)
from overstory.data_pipeline.label_agreement import label_agreement, plot_agreement
from overstory.data_pipeline.ray_runner import RayConfig
from overstory.retrieval.answer import clean_answer
from overstory.retrieval.judge import CorrectnessConfig, is_correct
from overstory.retrieval.smartchunk import DocumentRetrievers
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig
from overstory.serving.job_client import client_for, served_models


@dataclass(frozen=True)
class PseudoLabelsConfig:
    corpus: CorpusConfig
    out: str
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)
    correctness: CorrectnessConfig = field(default_factory=CorrectnessConfig)
    k: int = 5
    k_step: int = 5
    max_attempts: int = 3
    # how upper levels are embedded for retrieval: the encoder on their text, or the served compressor
    upper: Literal["direct", "compressor"] = "direct"
    max_answer_tokens: int = 24
    concurrency: int = 2
    runner: Literal["threads", "ray"] = "threads"  # ray: Ray Data workers, requests spread over ray.endpoints
    ray: RayConfig = field(default_factory=RayConfig)
    limit: int = 0  # label at most this many questions, taken round-robin over documents (0 = all)
    max_failure_share: float = 0.0  # the job fails (exit 1) when more of its questions than this failed
    server_url: str = ""
    # per request: a CPU stack answering `concurrency` prompts of k chunks at once can take minutes for each
    request_timeout_s: float = 120.0
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if self.k < 1 or self.k_step < 0 or self.max_attempts < 1 or self.concurrency < 1:
            raise ConfigError("k, max_attempts and concurrency must be positive and k_step >= 0")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        if (self.upper == "compressor" and "compressor" not in self.serve.roles
                and not job_server(self.server_url, self.runner, self.ray)[0]):
            raise ConfigError("upper: 'compressor' needs a compressor role in serve.roles (or a server_url or "
                              "ray.endpoints that serve one)")


def gold_levels(example: QAExample, document: Document, chunks: list[Chunk]) -> tuple[str | None, str | None]:
    """The question's gold ``(level_min, level_max)`` by ``gold_labels.py``'s rules, or ``(None, None)`` where its
    dataset marks no evidence or the question has no gold label (unanswerable, evidence only in a figure, ...)."""
    if example.dataset not in GOLD_KINDS or exclusion(example) is not None:
        return None, None
    label = gold_label(example, document, chunks)
    return label.level_min, label.level_max


def label_question(example: QAExample, document: Document, retrievers: DocumentRetrievers, client: Client,
                   config: PseudoLabelsConfig, doc_chunks: list[Chunk], served: Mapping[str, str]) -> PseudoLabel:
    """Answer from top-k over all levels; expand and retry until correct or out of attempts. ``served`` (role ->
    model, from the server) names the backbone in the label."""
    doc_id = document.id
    retriever = retrievers[doc_id]
    gold_min, gold_max = gold_levels(example, document, doc_chunks)
    truncated = {"truncated_replies": 0, "truncated_after_retry": 0, "truncated_raw": ""}
    for attempt in range(1, config.max_attempts + 1):
        lowest = LEVELS[min(attempt - 1, len(LEVELS) - 1)]
        k = config.k + (attempt - 1) * config.k_step
        reply, chunks = retriever.answer(example.question, lowest, "document", k=k,
                                         max_tokens=config.max_answer_tokens)
        if reply.finish_reason == "length":  # cut by max_tokens: the same question once more, with twice the room
            truncated["truncated_replies"] += 1
            reply, chunks = retriever.answer(example.question, lowest, "document", k=k,
                                             max_tokens=2 * config.max_answer_tokens)
            if reply.finish_reason == "length":
                truncated.update(truncated_after_retry=truncated["truncated_after_retry"] + 1,
                                 truncated_raw=reply.text)
        answer = clean_answer(reply.text)
        correct = is_correct(answer, example.answers, example.question, config.correctness, client)
        if correct or attempt == config.max_attempts:
            levels = sorted({c.level for c in chunks}, key=LEVELS.index)
            return PseudoLabel(
                id=example.id, doc_id=doc_id, question=example.question, answers=example.answers,
                level_min=levels[0] if correct else None, level_max=levels[-1] if correct else None,
                correct=correct, attempts=attempt, retrieved_ids=[c.id for c in chunks],
                retrieved_levels=[c.level for c in chunks], answer=answer,
                backbone=served.get("generator", ""), correctness=config.correctness.rule,
                gold_level_min=gold_min, gold_level_max=gold_max, evidence=list(example.evidence), **truncated)
    raise AssertionError("unreachable: the last attempt always returns")


def single_document_questions(questions: list[QAExample]) -> list[tuple[QAExample, str]]:
    """Answerable questions whose evidence lies in one document (or, without evidence spans, that were asked
    about one document: ``metadata["doc_id"]``), with that document's id."""
    picked = []
    for q in questions:
        docs = {s.doc_id for s in q.evidence} or ({q.metadata["doc_id"]} if q.metadata.get("doc_id") else set())
        if q.answers and len(docs) == 1:
            picked.append((q, docs.pop()))
    return picked


def round_robin_by_document(pairs: list[tuple[QAExample, str]]) -> list[tuple[QAExample, str]]:
    """Interleave questions document by document, so any prefix (a ``limit``) spans the documents and a
    split by document still has something on both sides."""
    queues: dict[str, list] = {}
    for pair in pairs:
        queues.setdefault(pair[1], []).append(pair)
    ordered = []
    for i in range(max((len(q) for q in queues.values()), default=0)):
        ordered.extend(q[i] for q in queues.values() if i < len(q))
    return ordered


def labelled_documents_hierarchy(documents: list[Document], needed: set[str],
                                 config: PseudoLabelsConfig) -> list[Chunk]:
    """The hierarchy of the documents to label, stored beside the labels (``stored_hierarchy_path``): what the
    traces job, the planner recipes and ``eval planner`` read. A rerun keeps the stored chunks of documents it
    already has (the labels written so far refer to their ids) and adds the documents it lacks."""
    path = stored_hierarchy_path(config.out)
    stored = load_hierarchies(path) if path.exists() else []
    have = {c.doc_id for c in stored}
    added = build_hierarchies([d for d in documents if d.id in needed - have], config.hierarchy)
    if added or not path.exists():
        save_hierarchies(path, [*stored, *added])
    return [c for c in [*stored, *added] if c.doc_id in needed]


def run(config: PseudoLabelsConfig) -> dict:
    """Label every single-document question the output lacks, then report agreement with the gold levels."""
    documents, questions = load_corpus(config.corpus)
    # QASPER marks questions whose evidence is only a figure or table, which the text the backbone reads lacks
    figure_only = [q for q in questions if q.metadata.get("figure_table_only")]
    todo_all = single_document_questions([q for q in questions if not q.metadata.get("figure_table_only")])
    if not todo_all:
        raise ValueError(f"{config.corpus.kind}: no answerable question has its evidence in a single document; "
                         f"SmartChunk plans per document (HotpotQA's two-document questions are not labelled)")
    if config.limit:
        todo_all = round_robin_by_document(todo_all)[: config.limit]
    chunks = labelled_documents_hierarchy(documents, {doc_id for _, doc_id in todo_all}, config)
    documents_by_id = {d.id: d for d in documents}
    by_doc: dict[str, list[Chunk]] = {}
    for chunk in chunks:
        by_doc.setdefault(chunk.doc_id, []).append(chunk)
    with ExitStack() as stack:
        tracker = stack.enter_context(start_run(config.tracking, "data pseudo-labels", config))
        fanout = stack.enter_context(Fanout("pseudo-labels", config.out, job_settings(config),
                                            concurrency=config.concurrency,
                                            max_failure_share=config.max_failure_share, runner=config.runner,
                                            ray=config.ray))
        todo = fanout.todo(todo_all, lambda pair: pair[0].id)
        if todo:
            # on Ray with endpoints and no server_url, the first endpoint: the fleet needs no stack of the job's own
            url, options = job_server(config.server_url, config.runner, config.ray)
            client = stack.enter_context(client_for(config.serve, url, timeout_s=config.request_timeout_s, **options))
            served = served_models(client, ["generator", "scorer"])
            fanout.record_served(served)

            def labeller(worker_client: Client) -> Callable[[tuple[QAExample, str]], PseudoLabel]:
                """Label one question through ``worker_client`` (the job's, or a Ray worker's for its endpoint)."""
                retrievers = DocumentRetrievers(chunks, worker_client, upper=config.upper)

                def label(pair: tuple[QAExample, str]) -> PseudoLabel:
                    question, doc_id = pair
                    return label_question(question, documents_by_id[doc_id], retrievers, worker_client, config,
                                          by_doc[doc_id], served)
                return label

            def write(_: tuple, result: PseudoLabel) -> None:
                fanout.write(result, "correct" if result.correct else "unsolved")
                fanout.counts["truncated_replies"] += result.truncated_replies
                fanout.counts["truncated_after_retry"] += result.truncated_after_retry
                tracker.log({key: fanout.counts[key] for key in ("correct", "unsolved", "truncated_replies")})

            work = ServedWork(labeller, client, {"timeout_s": config.request_timeout_s})
            fanout.run(todo, lambda pair: pair[0].id, work, write, "pseudo-labelling")
        counts = {"correct": 0, "unsolved": 0, "truncated_replies": 0, "truncated_after_retry": 0, **fanout.finish(),
                  "excluded_figure_table": len(figure_only)}
        agreement = report_labels(config.out).get("agreement", {})
        tracker.summary({**counts, **{f"agreement/{rule}/{k}": figures[k]["value"]
                                      for rule, figures in agreement.items() for k in AGREEMENT_SUMMARY}})
    print(f"pseudo-labels: {counts['correct']} labelled, {counts['unsolved']} unsolved, {counts['failed']} failed "
          f"(retried on rerun), {counts['skipped']} already done; backbone replies cut by max_tokens: "
          f"{counts['truncated_replies']} (each asked again with twice the room), {counts['truncated_after_retry']} "
          f"still cut; {len(figure_only)} questions excluded, their evidence only a figure or table -> {config.out}")
    fanout.raise_if_failed()
    return counts


AGREEMENT_SUMMARY = ("coverage", "exact_range", "level_min", "level_max", "within_one")


def report_labels(out: str) -> dict:
    """What every label in ``out`` amounts to, written beside it as ``<out stem>.summary.json`` (the results page's
    table): questions labelled (by attempt) and not, cut replies, the backbones, the ranges by the method and by the
    answer-grounded rule (``grounded_levels.py``, with how many it could not ground) and, where the dataset has gold
    levels, each rule's agreement with them (also ``.agreement.json``, ``.agreement.png`` and
    ``.grounded-agreement.png``)."""
    labels = list(read_jsonl(out, PseudoLabel))
    grounded, grounding = ground_labels(labels, load_hierarchies(stored_hierarchy_path(out)))
    labelled = [x for x in labels if x.correct]

    def ranges(records: list[PseudoLabel]) -> dict[str, int]:
        return dict(Counter(f"{x.level_min}..{x.level_max}" for x in records if x.level_min).most_common())

    summary = {"labels": len(labels), "labelled": len(labelled), "unsolved": len(labels) - len(labelled),
               "labelled_at_attempt": {str(k): n for k, n in sorted(Counter(x.attempts for x in labelled).items())},
               "truncated_replies": sum(x.truncated_replies for x in labels),
               "truncated_after_retry": sum(x.truncated_after_retry for x in labels),
               "backbones": sorted({x.backbone for x in labels}), "grounding": grounding,
               "ranges": {"method": ranges(labelled), "grounded": ranges(grounded)}}
    agreement = report_agreement(out, labels, grounded, grounding)
    if agreement:
        summary["agreement"] = {rule: {k: figures[k] for k in ("gold", "both", *AGREEMENT_SUMMARY)}
                                for rule, figures in (("method", agreement), ("grounded", agreement["grounded_rule"]))}
    path = Path(out).with_suffix(".summary.json")
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"labels: {summary['labelled']} of {summary['labels']} questions labelled (by attempt: "
          f"{summary['labelled_at_attempt']}); the answer-grounded rule ranged {grounding['grounded']} of them "
          f"({grounding['ungrounded']} without a retrieved chunk holding the reply) -> {path}")
    return summary


def report_agreement(out: str, labels: list[PseudoLabel], grounded: list[PseudoLabel],
                     grounding: dict[str, int]) -> dict | None:
    """Agreement of the labels of ``out`` with their gold levels, written beside it (``.agreement.json`` and
    ``.agreement.png``), for the method's ranges and, under ``grounded_rule``, the answer-grounded rule's
    (``grounded``, with its counts ``grounding``; ``.grounded-agreement.png``); None when no label has gold levels
    (a corpus without evidence spans)."""
    report = label_agreement(labels)
    if not report["gold"]:
        print(f"agreement with gold levels: none of the {len(labels)} questions has gold levels")
        return None
    report["grounded_rule"] = {**label_agreement(grounded), "counts": grounding}
    stem = Path(out).with_suffix("")
    Path(f"{stem}.agreement.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_agreement(report, Path(out).stem, f"{stem}.agreement.png")
    plot_agreement(report["grounded_rule"], f"{Path(out).stem}, answer-grounded rule", f"{stem}.grounded-agreement.png")
    for name, rule in (("method", report), ("answer-grounded rule", report["grounded_rule"])):
        print(f"agreement with gold levels, {name}: " + ", ".join(
            f"{k} {rule[k]['value']:.1%} [{rule[k]['ci95'][0]:.1%}, {rule[k]['ci95'][1]:.1%}]"
            for k in AGREEMENT_SUMMARY if rule[k]["value"] is not None) + f" ({rule['both']} of {rule['gold']} "
            f"gold-labelled questions with a range) -> {stem}.agreement.json")
    return report
