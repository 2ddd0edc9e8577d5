"""The main job on the embedded CPU stack: data -> hierarchies -> indexes -> served models -> RAG.

    overstory quickstart --out runs/quickstart

Stages write into one ``report.json`` under ``stages``; later issues add their own stages to the
same command and report. This stage set:

- ``hierarchy``: per-level chunk counts and token statistics for both shipped corpora (and a PNG);
- ``retrieval``: recall@5 of BM25, dense and hybrid indexes over paragraphs, for both corpora;
- ``rag_baseline``: plain retrieve-then-generate through the served stack on one corpus;
- ``compressor``: summaries of a slice, a short compressor training run, and the comparison of the
  four ways to embed upper levels (compressor, mean_pool, direct_encode, summarize);
- ``planner``: pseudo-labels and traces for a slice of questions, planner SFT and a few STITCH steps on
  the built-in model, and the base / SFT / STITCH comparison on the held-out documents.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from overstory.core.config import ConfigError
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.formats import write_jsonl
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies, chunks_at_levels, save_hierarchies
from overstory.data_pipeline.hierarchy_job import level_stats
from overstory.data_pipeline.planner_examples import PlannerDataConfig
from overstory.data_pipeline.pseudo_labels import PseudoLabelsConfig
from overstory.data_pipeline.pseudo_labels import run as run_pseudo_labels
from overstory.data_pipeline.summaries import SummariesConfig
from overstory.data_pipeline.summaries import run as run_summaries
from overstory.data_pipeline.traces import TracesConfig
from overstory.data_pipeline.traces import run as run_traces
from overstory.evaluation.compressor import EvalCompressorConfig
from overstory.evaluation.compressor import run as run_evaluation
from overstory.evaluation.planner import EvalPlannerConfig
from overstory.evaluation.planner import run as run_planner_eval
from overstory.evaluation.plots import plot_level_stats
from overstory.evaluation.rag import GenerationConfig, RetrievalConfig, evaluate_rag, select_questions
from overstory.retrieval.index import BM25Index, DenseIndex, HybridIndex
from overstory.retrieval.metrics import mean, recall_at_k
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig
from overstory.serving.launch import serve_in_background
from overstory.training.compressor import CompressorJobConfig, CompressorTrainConfig
from overstory.training.compressor import run as run_training
from overstory.training.planner_common import GrpoSettings
from overstory.training.planner_sft import PlannerSftConfig, SftTrainSettings
from overstory.training.planner_sft import run as run_sft
from overstory.training.stitch import StitchConfig, StitchSettings
from overstory.training.stitch import run as run_stitch

console = Console()


@dataclass(frozen=True)
class CompressorStageConfig:
    """A small compressor run: summaries of a slice, a short training, the four-way evaluation."""

    corpus: str = "squad"
    levels: list[str] = field(default_factory=lambda: ["subsection", "section"])
    max_summary_tokens: int = 32
    epochs: int = 30
    lr: float = 1e-4


@dataclass(frozen=True)
class PlannerStageConfig:
    """A small planner run: pseudo-labels, template traces, SFT, a few STITCH steps, the comparison."""

    corpus: str = "squad"
    questions: int = 24
    max_attempts: int = 2
    metadata_tokens: int = 128
    sft_epochs: float = 5
    stitch_steps: int = 3
    qa: bool = True  # SmartChunk QA for the predicted ranges in the comparison


@dataclass(frozen=True)
class QuickstartConfig:
    out: str = "runs/quickstart"
    corpora: dict[str, CorpusConfig] = field(default_factory=lambda: {
        "hotpotqa": CorpusConfig(kind="hotpotqa", path="data/hotpotqa"),
        "squad": CorpusConfig(kind="squad", path="data/squad/dev-v2.0-articles.json"),
    })
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)
    # the corpus whose questions the RAG baseline answers with the generator
    rag_corpus: str = "hotpotqa"
    rag_questions: int = 0
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    compressor: CompressorStageConfig = field(default_factory=CompressorStageConfig)
    planner: PlannerStageConfig = field(default_factory=PlannerStageConfig)
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local())
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        for key, name in (("rag_corpus", self.rag_corpus), ("compressor.corpus", self.compressor.corpus),
                          ("planner.corpus", self.planner.corpus)):
            if name not in self.corpora:
                raise ConfigError(f"{key} {name!r} is not one of corpora: {', '.join(self.corpora)}")


def _update_report(path: Path, stages: dict) -> dict:
    """Merge ``stages`` into report.json, keeping stages that other runs (later issues) wrote."""
    report = json.loads(path.read_text()) if path.exists() else {}
    report.setdefault("stages", {}).update(stages)
    report["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)
    return report


def run(config: QuickstartConfig) -> dict:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "report.json"
    started = time.perf_counter()

    with start_run(config.tracking, "quickstart", config) as tracker:
        console.rule("[bold]hierarchy")
        loaded, chunks = {}, {}
        for name, corpus in config.corpora.items():
            t0 = time.perf_counter()
            loaded[name] = load_corpus(corpus)
            chunks[name] = build_hierarchies(loaded[name][0], config.hierarchy)
            save_hierarchies(out / "hierarchies" / f"{name}.jsonl", chunks[name])
            console.print(f"{name}: {len(loaded[name][0])} documents, {len(loaded[name][1])} questions, "
                          f"{len(chunks[name])} chunks in {time.perf_counter() - t0:.1f}s")
        plot = plot_level_stats(chunks, out / "level_stats.png")
        hierarchy_stage = {name: level_stats(c) for name, c in chunks.items()}
        hierarchy_stage["plot"] = str(plot)
        _update_report(report_path, {"hierarchy": hierarchy_stage})

        console.rule("[bold]serving")
        with serve_in_background(config.serve) as url:
            client = Client.from_url(url)
            console.print(f"embedded stack at {url}: roles {', '.join(client.models())}")

            console.rule("[bold]retrieval")
            retrieval_stage, indexes = _retrieval_stage(loaded, chunks, client, config.retrieval)
            _update_report(report_path, {"retrieval": retrieval_stage})

            console.rule(f"[bold]rag_baseline ({config.rag_corpus})")
            questions = select_questions(loaded[config.rag_corpus][1], config.rag_questions, True)
            with Progress(console=console) as progress:
                index = indexes[config.rag_corpus][config.retrieval.index]
                metrics, records = evaluate_rag(questions, index, client, config.retrieval, config.generation,
                                                progress)
            rag_stage = {"dataset": config.rag_corpus, **metrics, "usage": client.stats.summary()}
            write_jsonl(out / "rag_predictions.jsonl", records)
            _update_report(report_path, {"rag_baseline": rag_stage})

            console.rule(f"[bold]compressor ({config.compressor.corpus})")
            _update_report(report_path, {"compressor": _compressor_stage(config, out / "compressor", url)})

            console.rule(f"[bold]planner ({config.planner.corpus})")
            report = _update_report(report_path, {"planner": _planner_stage(config, out / "planner", url)})
        tracker.summary({f"rag_baseline/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
        methods = report["stages"]["compressor"]["methods"]
        tracker.summary({f"compressor/{method}/{k}": v for method, row in methods.items()
                         for k, v in row.items() if isinstance(v, (int, float))})

    _print_summary(report, time.perf_counter() - started, report_path)
    return report


def _compressor_stage(config: QuickstartConfig, folder: Path, server_url: str) -> dict:
    """Summaries of a slice through the running stack, a short compressor training run, and the
    compressor / mean_pool / direct_encode / summarize comparison on the held-out documents."""
    stage = config.compressor
    quiet = TrackingConfig(backend="none")  # the quickstart's own run tracks the stage's figures
    corpus = config.corpora[stage.corpus]
    summaries = folder / "summaries.jsonl"
    counts = run_summaries(SummariesConfig(
        corpus=corpus, out=str(summaries), hierarchy=config.hierarchy, levels=stage.levels,
        hierarchies=str(folder.parent / "hierarchies" / f"{stage.corpus}.jsonl"),  # built by the hierarchy stage
        max_summary_tokens=stage.max_summary_tokens, server_url=server_url, serve=config.serve, tracking=quiet))
    training = run_training(CompressorJobConfig(
        data=str(summaries), out=str(folder / "model"), tracking=quiet,
        train=CompressorTrainConfig(epochs=stage.epochs, lr=stage.lr, batch_size=16)))
    evaluation = run_evaluation(EvalCompressorConfig(
        checkpoint=str(folder / "model" / "best"), data=str(summaries), corpus=corpus, out=str(folder / "eval"),
        max_summary_tokens=stage.max_summary_tokens, tracking=quiet,
        serve=ServeConfig(host=config.serve.host, port=0, roles=config.serve.roles)))
    return {"dataset": stage.corpus, "levels": list(stage.levels), "summaries": counts,
            "training": training, "n_questions": evaluation["n_questions"],
            "n_upper_chunks": evaluation["n_upper_chunks"], "methods": evaluation["methods"],
            "plot": str(folder / "eval" / "recall_vs_cost.png")}


def _planner_stage(config: QuickstartConfig, folder: Path, server_url: str) -> dict:
    """Pseudo-labels through the running stack, template-teacher traces, planner SFT, STITCH from the
    SFT adapter, and base / sft / stitch compared on the held-out documents' questions."""
    stage, quiet = config.planner, TrackingConfig(backend="none")
    corpus = config.corpora[stage.corpus]
    labels = folder / "pseudo_labels.jsonl"
    counts = run_pseudo_labels(PseudoLabelsConfig(
        corpus=corpus, out=str(labels), hierarchy=config.hierarchy, max_attempts=stage.max_attempts,
        limit=stage.questions, server_url=server_url, serve=config.serve, tracking=quiet))
    if counts["correct"] + counts["skipped"] == 0:
        return {"pseudo_labels": counts, "skipped": "the backbone answered no question correctly"}
    traces = folder / "traces.jsonl"
    yields = run_traces(TracesConfig(labels=str(labels), out=str(traces),
                                     metadata_tokens=stage.metadata_tokens, tracking=quiet))
    data = PlannerDataConfig(labels=str(labels), metadata_tokens=stage.metadata_tokens)
    sft = run_sft(PlannerSftConfig(traces=str(traces), out=str(folder / "sft"), tracking=quiet,
                                   train=SftTrainSettings(epochs=stage.sft_epochs, batch_size=4)))
    stitch = run_stitch(StitchConfig(
        data=data, traces=str(traces), out=str(folder / "stitch"), model=str(folder / "sft" / "final"),
        stitch=StitchSettings(steps=stage.stitch_steps, questions_per_step=4, num_generations=4,
                              imitation_threshold=4, max_completion_tokens=128),
        grpo=GrpoSettings(num_generations=4, batch_size=4, lr=1e-4), tracking=quiet))
    variants = {"base": config.serve.roles["planner"].model, "sft": str(folder / "sft" / "final"),
                "stitch": str(folder / "stitch" / "final")}
    comparison = run_planner_eval(EvalPlannerConfig(
        data=str(labels), out=str(folder / "eval"), metadata_tokens=stage.metadata_tokens, variants=variants,
        compare="base,sft,stitch", qa=stage.qa,
        serve=ServeConfig(host=config.serve.host, port=0, roles=config.serve.roles), tracking=quiet))
    return {"dataset": stage.corpus, "pseudo_labels": counts, "trace_yield": yields, "sft": sft, "stitch": stitch,
            "n_questions": comparison["n_questions"], "split": comparison["split"],
            "majority_baseline": comparison["majority_baseline"],
            "variants": {name: {k: v for k, v in row.items() if k != "examples"}
                         for name, row in comparison["variants"].items()},
            "plots": [str(folder / "eval" / "planner_comparison.png"), str(folder / "eval" / "training_curves.png")]}


def _retrieval_stage(loaded: dict, chunks: dict, client: Client,
                     retrieval: RetrievalConfig) -> tuple[dict, dict[str, dict]]:
    """recall@k of every index kind over the configured levels, for every corpus with questions;
    returns the stage and the indexes (corpus -> kind -> index) for the RAG stage to reuse."""
    stage: dict[str, dict] = {}
    indexes: dict[str, dict] = {}
    for name, (_, questions) in loaded.items():
        indexed = chunks_at_levels(chunks[name], retrieval.levels)
        dense = DenseIndex.build(indexed, lambda texts: client.embed("embedder", texts))
        bm25 = BM25Index.build(indexed)
        indexes[name] = {"bm25": bm25, "dense": dense, "hybrid": HybridIndex(dense, bm25)}
        answerable = [q for q in questions if q.evidence]
        if not answerable:
            continue
        stage[name] = {"n_questions": len(answerable), "levels": list(retrieval.levels)}
        for kind, index in indexes[name].items():
            hits = index.search([q.question for q in answerable], retrieval.k)
            recall = mean([recall_at_k([h.chunk for h in row], q.evidence, retrieval.k)
                           for q, row in zip(answerable, hits)])
            stage[name][f"{kind}_recall@{retrieval.k}"] = recall
        console.print(f"{name}: " + ", ".join(f"{k}={v:.3f}" for k, v in stage[name].items() if "recall" in k))
    return stage, indexes


def _print_summary(report: dict, seconds: float, path: Path) -> None:
    rag = report["stages"]["rag_baseline"]
    table = Table(title=f"rag_baseline on {rag['dataset']}")
    for column in ("questions", "recall@k", "exact match", "token F1", "contains match", "seconds"):
        table.add_column(column)
    recall_key = next(k for k in rag if k.startswith("recall@"))
    table.add_row(str(rag["n_questions"]), f"{rag[recall_key]:.3f}", f"{rag['exact_match']:.3f}",
                  f"{rag['token_f1']:.3f}", f"{rag['contains_match']:.3f}", f"{rag['seconds']:.1f}")
    console.print(table)
    console.print(f"report: {path} (quickstart took {seconds:.0f}s)")
