"""The main job on the embedded CPU stack: data -> hierarchies -> indexes -> served models -> RAG.

    overstory quickstart --out runs/quickstart

Stages write into one ``report.json`` under ``stages``; later issues add their own stages to the
same command and report. Every stage records its wall-clock ``seconds`` (also collected under the report's
``stage_seconds``, with ``total_seconds``). One embedded stack serves the whole job, on a free
port by default (``serve.port=0``: it is private to the job; the URL is printed and kept in the
``serving`` stage). The defaults are sized for a 2-core CPU: the whole job takes a few minutes. This stage set:

- ``hierarchy``: per-level chunk counts and token statistics for both shipped corpora (and a PNG);
- ``retrieval``: recall@5 of BM25, dense and hybrid indexes over paragraphs, for both corpora, each question
  searched in its scope (``retrieval_scope``: a SQuAD question within its own article, HotpotQA's over the whole
  corpus, as ``eval pipeline`` searches them);
- ``rag_baseline``: plain retrieve-then-generate through the served stack on one corpus (``overstory eval rag``:
  the evaluation harness with the naive strategy);
- ``compressor``: summaries of a slice, a short compressor training run, and the comparison of the
  four ways to embed upper levels (compressor, mean_pool, direct_encode, summarize);
- ``planner``: pseudo-labels and traces for a slice of questions, planner SFT and a few STITCH steps on
  the built-in model, and the base / SFT / STITCH comparison on the held-out documents;
- ``lattice``: a LATTICE tree built bottom-up by the generator over a slice of HotpotQA, the served teacher's
  traversal traces of a few questions, a short cross-encoder distillation, and the comparison of oracle, teacher,
  student, BM25, dense, hybrid and LATTICE++ on the student's held-out questions;
- ``strategies``: the evaluation harness (``overstory eval pipeline``) on a slice of each shipped sample: naive
  top-k, SmartChunk (the served planner) and A-RAG's agent answer the same questions with the same generator, with
  answer quality, recall and cost per question (LATTICE has its own stage; FABLE and Orion-RAG need an index job).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from overstory.core.config import ConfigError
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies, chunks_at_levels, save_hierarchies
from overstory.data_pipeline.hierarchy_job import level_stats
from overstory.data_pipeline.lattice_traces import LatticeTracesConfig
from overstory.data_pipeline.lattice_traces import run as run_lattice_traces
from overstory.data_pipeline.lattice_tree import ClusteringConfig, LatticeTreeConfig
from overstory.data_pipeline.lattice_tree import run as run_lattice_tree
from overstory.data_pipeline.planner_examples import PlannerDataConfig
from overstory.data_pipeline.pseudo_labels import PseudoLabelsConfig
from overstory.data_pipeline.pseudo_labels import run as run_pseudo_labels
from overstory.data_pipeline.summaries import SummariesConfig
from overstory.data_pipeline.summaries import run as run_summaries
from overstory.data_pipeline.traces import TracesConfig
from overstory.data_pipeline.traces import run as run_traces
from overstory.evaluation.compressor import EvalCompressorConfig
from overstory.evaluation.compressor import run as run_evaluation
from overstory.evaluation.lattice import LatticeEvalConfig, SystemConfig
from overstory.evaluation.lattice import run as run_lattice_eval
from overstory.evaluation.pipeline import PipelineEvalConfig
from overstory.evaluation.pipeline import run as run_pipeline_eval
from overstory.evaluation.planner import EvalPlannerConfig
from overstory.evaluation.planner import run as run_planner_eval
from overstory.evaluation.plots import plot_level_stats
from overstory.evaluation.rag import RagEvalConfig
from overstory.evaluation.repairs import repairs_cell
from overstory.evaluation.scope import resolve_scope, search_in_scope
from overstory.retrieval.arag import ARagConfig
from overstory.retrieval.index import BM25Index, DenseIndex, HybridIndex
from overstory.retrieval.lattice.search import SearchConfig
from overstory.retrieval.metrics import mean, recall_at_k
from overstory.retrieval.naive import AnswerConfig, NaiveConfig
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig
from overstory.serving.launch import serve_in_background
from overstory.training.compressor import CompressorJobConfig, CompressorTrainConfig
from overstory.training.compressor import run as run_training
from overstory.training.distill_scorer import DistillScorerConfig
from overstory.training.distill_scorer import run as run_distill_scorer
from overstory.training.planner_common import GrpoUpdateSettings, RewardSettings
from overstory.training.planner_sft import PlannerSftConfig
from overstory.training.planner_sft import run as run_sft
from overstory.training.sft import SftTrainSettings
from overstory.training.stitch import StitchConfig, StitchSettings
from overstory.training.stitch import run as run_stitch

console = Console()


@dataclass(frozen=True)
class CompressorStageConfig:
    """A small compressor run: summaries of a slice, a short training, the four-way evaluation."""

    corpus: str = "squad"
    levels: list[str] = field(default_factory=lambda: ["section"])
    max_summary_tokens: int = 32
    # a section's first ~375 tokens: prompt processing is most of a summary's cost on CPU (the job's default is 12000)
    max_input_chars: int = 1500
    epochs: int = 15
    lr: float = 1e-3
    # recall@k over the held-out article's sections: it has about 5, so k=5 would find every answer for every method
    k: int = 1
    # summaries asked at once: the embedded engine batches the requests that wait together (19 sections at the test's
    # size: 41 s at 2, 32 s at 8, the job's own stack start included)
    concurrency: int = 8


@dataclass(frozen=True)
class PlannerStageConfig:
    """A small planner run: pseudo-labels, template traces, SFT, a few STITCH steps, the comparison."""

    corpus: str = "squad"
    # many questions tried once each (the template teacher turns every correct one into a trace) rather than
    # few questions with retries; the stage shows the recipe end to end in a few minutes (the planner pipeline of
    # docs/data.md, scripts/planner_gold_pipeline.sh, trains on hundreds of labels)
    questions: int = 30
    max_attempts: int = 1
    label_k: int = 3  # chunks retrieved per labelling attempt (the job's default is 5): shorter prompts on CPU
    # the backbone's first room per reply (the job's default is 24): half of SmolLM2's replies run past 24 tokens,
    # and each cut reply is asked again with twice the room, a second pass over its ~1000-token prompt; greedy
    # decoding gives the same first tokens either way, so 48 at once keeps the labels and skips most re-asks
    answer_tokens: int = 48
    concurrency: int = 8  # labelling requests at once, batched together by the embedded engine
    metadata_tokens: int = 48  # short prompts keep SFT steps, rollouts and plans cheap on CPU
    sft_epochs: float = 4  # a handful of traces: more passes, small batches (the format is learned by epoch 3-4)
    sft_batch_size: int = 2
    sft_lr: float = 2e-3  # a LoRA adapter on a few dozen traces: a high rate learns the format in few steps
    stitch_steps: int = 1
    stitch_generations: int = 2
    # held-out questions per variant in the comparison (0 = all), and at most as many without a label: a few dozen
    # labels hold out a handful of questions, so the unlabelled ones are planned and answered too (`unlabelled`)
    eval_questions: int = 3
    # SmartChunk QA for the predicted ranges in the comparison (the strategies stage answers with SmartChunk already)
    qa: bool = False


@dataclass(frozen=True)
class LatticeStageConfig:
    """A small LATTICE run: a tree, the teacher's traces of a few questions, a cross-encoder student, the table."""

    corpus: str = "hotpotqa"
    # the corpus's first N paragraphs, organised bottom-up (one generator summary per new node: about N / M calls,
    # where the top-down build first writes keyword summaries of every paragraph)
    leaves: int = 30
    m_max: int = 10
    trace_questions: int = 3  # the served teacher (the job's scorer role) walks the tree for this many questions
    iterations: int = 2  # search iterations per question (the paper: 20)
    max_tokens: int = 192  # per slate reply: the reasoning, then the scores
    max_candidate_chars: int = 200  # each candidate's text in the slate prompt (and in the student's pairs)
    student_steps: int = 10  # cross-encoder steps from the built-in MiniLM (pointwise, on teacher score / 100)
    # of the traced questions, by query: the student never sees them; the eval runs them. The split holds out at
    # least one: so small a share holds out exactly one of 3 (0.25 held out 2, leaving the student 1 to learn from)
    heldout_fraction: float = 0.01


@dataclass(frozen=True)
class StrategiesStageConfig:
    """The evaluation harness on a slice of each shipped sample: every strategy on the same questions."""

    strategies: str = "naive,smartchunk,arag"
    corpora: list[str] = field(default_factory=lambda: ["hotpotqa", "squad"])
    questions: int = 1  # per corpus: the stage shows the harness end to end; `eval pipeline` measures
    limit_docs: int = 100  # the corpus's first N documents (HotpotQA: 6 questions have all their paragraphs in them)
    # A-RAG's agent at CPU size: a tool call (the first turn is constrained to one), then the answer
    arag: ARagConfig = field(default_factory=lambda: ARagConfig(max_turns=2, max_context_tokens=6000, max_tokens=96,
                                                                first_tool_choice="required"))


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
    rag_questions: int = 6  # 0: all of the corpus's answerable questions (40 for the HotpotQA sample)
    # the indexes of the retrieval stage (recall@k of each kind), and the RAG baseline's (`index`) top-k chunks
    retrieval: NaiveConfig = field(default_factory=NaiveConfig)
    # where the retrieval stage searches each question (evaluation/scope.py): auto follows each corpus (a SQuAD
    # question within its own article, HotpotQA's over the whole corpus); corpus searches everything for every
    # question (open-corpus SQuAD, a harder variant); document insists on the question's document
    retrieval_scope: str = "auto"
    answer: AnswerConfig = field(default_factory=AnswerConfig)  # how the RAG baseline and the strategies answer
    compressor: CompressorStageConfig = field(default_factory=CompressorStageConfig)
    planner: PlannerStageConfig = field(default_factory=PlannerStageConfig)
    lattice: LatticeStageConfig = field(default_factory=LatticeStageConfig)
    strategies: StrategiesStageConfig = field(default_factory=StrategiesStageConfig)
    # port 0: a free port, so the job's private stack never collides with a server on 8000
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        for key, name in (("rag_corpus", self.rag_corpus), ("compressor.corpus", self.compressor.corpus),
                          ("planner.corpus", self.planner.corpus), ("lattice.corpus", self.lattice.corpus),
                          *(("strategies.corpora", name) for name in self.strategies.corpora)):
            if name not in self.corpora:
                raise ConfigError(f"{key} {name!r} is not one of corpora: {', '.join(self.corpora)}")
        for name in self.corpora:
            self.retrieval_scope_of(name)  # an unknown scope, or document scope on an open corpus, names the key

    def retrieval_scope_of(self, corpus: str) -> str:
        """``document`` or ``corpus``: how the retrieval stage searches the questions of ``corpus`` (a name in
        ``corpora``) under ``retrieval_scope``; ConfigError naming ``retrieval_scope`` and the corpus for a bad one."""
        try:
            return resolve_scope(self.retrieval_scope, self.corpora[corpus])
        except ConfigError as exc:
            raise ConfigError(f"retrieval_scope (corpus {corpus!r}): {exc}") from exc


def _update_report(path: Path, stages: dict, **top: object) -> dict:
    """Merge ``stages`` into report.json, keeping stages that other runs (later issues) wrote; a stage's
    ``seconds`` are also collected under the report's ``stage_seconds``; ``top`` sets top-level keys."""
    report = json.loads(path.read_text()) if path.exists() else {}
    report.setdefault("stages", {}).update(stages)
    for name, stage in stages.items():
        if isinstance(stage, dict) and "seconds" in stage:
            report.setdefault("stage_seconds", {})[name] = stage["seconds"]
    report.update(top)
    report["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)
    return report


class _Stage:
    """Times one stage: prints its name and, at the end, its seconds; ``done`` adds them to the stage dict."""

    def __init__(self, name: str, title: str = "") -> None:
        self.name, self.started = name, time.perf_counter()
        console.rule(f"[bold]{title or name}")

    @property
    def seconds(self) -> float:
        return round(time.perf_counter() - self.started, 1)

    def done(self, stage: dict) -> dict:
        stage["seconds"] = self.seconds
        console.print(f"[bold green]{self.name}[/] done in {stage['seconds']:.1f}s")
        return {self.name: stage}


def _step(steps: dict, name: str, index: int, total: int, what: str):
    """Print ``[index/total] what`` and return a function that records the step's seconds in ``steps``."""
    console.print(f"[bold][{index}/{total}][/] {what}")
    started = time.perf_counter()

    def finish() -> None:
        steps[name] = round(time.perf_counter() - started, 1)
        console.print(f"      {name}: {steps[name]:.1f}s")

    return finish


def run(config: QuickstartConfig) -> dict:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "report.json"
    started = time.perf_counter()

    with start_run(config.tracking, "quickstart", config) as tracker:
        timer = _Stage("hierarchy")
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
        _update_report(report_path, timer.done(hierarchy_stage))

        timer = _Stage("serving")
        console.print(f"loading {', '.join(config.serve.roles)} and starting the job's embedded stack")
        with serve_in_background(config.serve) as url:
            client = Client.from_url(url)
            port = int(url.rsplit(":", 1)[1])
            console.print(f"embedded stack at {url} (private to this job): roles {', '.join(client.models())}")
            _update_report(report_path, timer.done({"url": url, "port": port, "roles": client.models()}))

            timer = _Stage("retrieval")
            retrieval_stage = run_retrieval_stage(config, loaded, chunks, client)
            _update_report(report_path, timer.done(retrieval_stage))

            timer = _Stage("rag_baseline", f"rag_baseline ({config.rag_corpus})")
            rag_stage = _rag_stage(config, out / "rag_baseline", url)
            _update_report(report_path, timer.done(rag_stage))

            timer = _Stage("compressor", f"compressor ({config.compressor.corpus})")
            _update_report(report_path, timer.done(_compressor_stage(config, out / "compressor", url)))

            timer = _Stage("planner", f"planner ({config.planner.corpus})")
            _update_report(report_path, timer.done(_planner_stage(config, out / "planner", url)))

            timer = _Stage("lattice", f"lattice ({config.lattice.corpus})")
            _update_report(report_path, timer.done(_lattice_stage(config, out / "lattice", url)))

            timer = _Stage("strategies", f"strategies ({', '.join(config.strategies.corpora)})")
            _update_report(report_path, timer.done(_strategies_stage(config, out / "strategies", url)))
        report = _update_report(report_path, {}, total_seconds=round(time.perf_counter() - started, 1))
        tracker.summary({f"rag_baseline/{k}": v for k, v in rag_stage.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)})
        methods = report["stages"]["compressor"]["methods"]
        tracker.summary({f"compressor/{method}/{k}": v for method, row in methods.items()
                         for k, v in row.items() if isinstance(v, (int, float))})
        tracker.summary({f"lattice/{name}/{k}": v for name, row in report["stages"]["lattice"]["systems"].items()
                         for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})

    _print_summary(report, time.perf_counter() - started, report_path)
    return report


def stage_serve(config: QuickstartConfig) -> ServeConfig:
    """The serve settings a later stage's job gets: the job's own, every setting kept (engine, api_key, the vllm_*
    settings, ...) and only the port free, so a stack the job starts beside the running one never collides."""
    return replace(config.serve, port=0)


def rag_eval_config(config: QuickstartConfig, folder: Path, server_url: str) -> PipelineEvalConfig:
    """``eval rag``'s harness config for the RAG baseline: the naive strategy on ``rag_questions`` questions."""
    return RagEvalConfig(
        corpus=config.corpora[config.rag_corpus], limit_questions=config.rag_questions, hierarchy=config.hierarchy,
        naive=config.retrieval, answer=config.answer, recall_k=config.retrieval.k, server_url=server_url,
        resume=False, serve=stage_serve(config), out=str(folder), tracking=TrackingConfig(backend="none")).pipeline()


def _rag_stage(config: QuickstartConfig, folder: Path, server_url: str) -> dict:
    """``overstory eval rag`` on the RAG corpus's questions, on the job's stack: the naive row with its files."""
    report = run_pipeline_eval(rag_eval_config(config, folder, server_url))
    row = dict(report["strategies"]["naive"])
    # the stage's `seconds` is its wall time, as in every stage; the row's are per question
    row["seconds_per_question"] = row.pop("seconds")
    return {"dataset": config.rag_corpus, **row, "table": str(folder / "table.md"),
            "predictions": str(folder / "predictions" / "naive.jsonl")}


def _compressor_stage(config: QuickstartConfig, folder: Path, server_url: str) -> dict:
    """Summaries of a slice through the running stack, a short compressor training run, and the
    compressor / mean_pool / direct_encode / summarize comparison on the held-out documents (on the same stack)."""
    stage = config.compressor
    quiet = TrackingConfig(backend="none")  # the quickstart's own run tracks the stage's figures
    corpus = config.corpora[stage.corpus]
    summaries = folder / "summaries.jsonl"
    steps: dict[str, float] = {}
    finish = _step(steps, "summaries", 1, 3, f"summaries of the {', '.join(stage.levels)} chunks of {stage.corpus} "
                                              f"(at most {stage.max_summary_tokens} tokens each)")
    counts = run_summaries(SummariesConfig(
        corpus=corpus, out=str(summaries), hierarchy=config.hierarchy, levels=stage.levels,
        hierarchies=str(folder.parent / "hierarchies" / f"{stage.corpus}.jsonl"),  # built by the hierarchy stage
        max_summary_tokens=stage.max_summary_tokens, max_input_chars=stage.max_input_chars, server_url=server_url,
        concurrency=stage.concurrency, serve=stage_serve(config), tracking=quiet))
    finish()
    finish = _step(steps, "training", 2, 3, f"set compressor training, {stage.epochs} epochs")
    training = run_training(CompressorJobConfig(
        data=str(summaries), out=str(folder / "model"), tracking=quiet,
        train=CompressorTrainConfig(epochs=stage.epochs, lr=stage.lr, batch_size=16)))
    finish()
    finish = _step(steps, "evaluation", 3, 3,
                   "compressor / mean_pool / direct_encode / summarize on held-out documents")
    evaluation = run_evaluation(compressor_eval_config(config, folder, server_url))
    finish()
    return {"dataset": stage.corpus, "levels": list(stage.levels), "summaries": counts,
            "training": training, "n_questions": evaluation["n_questions"],
            "n_upper_chunks": evaluation["n_upper_chunks"], "methods": evaluation["methods"],
            "plot": str(folder / "eval" / "recall_vs_cost.png"), "step_seconds": steps}


def compressor_eval_config(config: QuickstartConfig, folder: Path, server_url: str) -> EvalCompressorConfig:
    """The compressor stage's evaluation: the trained checkpoint and the three references on the held-out
    documents of its summaries, on the job's stack."""
    stage = config.compressor
    return EvalCompressorConfig(
        checkpoint=str(folder / "model" / "best"), data=str(folder / "summaries.jsonl"),
        corpus=config.corpora[stage.corpus], out=str(folder / "eval"), max_summary_tokens=stage.max_summary_tokens,
        max_input_chars=stage.max_input_chars, k=stage.k, concurrency=stage.concurrency,
        tracking=TrackingConfig(backend="none"),
        server_url=server_url, serve=stage_serve(config))


def planner_eval_config(config: QuickstartConfig, folder: Path, server_url: str) -> EvalPlannerConfig:
    """The planner stage's comparison: base, SFT and STITCH on the held-out article's questions, labelled or not."""
    stage = config.planner
    variants = {"base": config.serve.roles["planner"].model, "sft": str(folder / "sft" / "final"),
                "stitch": str(folder / "stitch" / "final")}
    return EvalPlannerConfig(
        data=str(folder / "pseudo_labels.jsonl"), out=str(folder / "eval"), metadata_tokens=stage.metadata_tokens,
        variants=variants, compare="base,sft,stitch", qa=stage.qa, limit=stage.eval_questions, max_new_tokens=96,
        server_url=server_url, unlabelled=True, fixed_ranges=[],  # the fixed-range references cost 15 QA runs each
        serve=stage_serve(config), tracking=TrackingConfig(backend="none"))


def _planner_stage(config: QuickstartConfig, folder: Path, server_url: str) -> dict:
    """Pseudo-labels through the running stack, template-teacher traces, planner SFT, STITCH from the
    SFT adapter, and base / sft / stitch compared on the held-out documents' questions."""
    stage, quiet = config.planner, TrackingConfig(backend="none")
    corpus = config.corpora[stage.corpus]
    labels = folder / "pseudo_labels.jsonl"
    steps: dict[str, float] = {}
    finish = _step(steps, "pseudo_labels", 1, 5, f"pseudo-labels for {stage.questions} {stage.corpus} questions "
                                                 f"({stage.max_attempts} attempt(s) each)")
    counts = run_pseudo_labels(PseudoLabelsConfig(
        corpus=corpus, out=str(labels), hierarchy=config.hierarchy, max_attempts=stage.max_attempts,
        k=stage.label_k, max_answer_tokens=stage.answer_tokens, limit=stage.questions, server_url=server_url,
        concurrency=stage.concurrency,
        serve=stage_serve(config), tracking=quiet))
    finish()
    if counts["correct"] + counts["skipped"] == 0:
        return {"pseudo_labels": counts, "skipped": "the backbone answered no question correctly",
                "step_seconds": steps}
    traces = folder / "traces.jsonl"
    finish = _step(steps, "traces", 2, 5, "template-teacher traces of the correct labels")
    yields = run_traces(TracesConfig(labels=str(labels), out=str(traces),
                                     metadata_tokens=stage.metadata_tokens, tracking=quiet))
    finish()
    data = PlannerDataConfig(labels=str(labels), metadata_tokens=stage.metadata_tokens)
    finish = _step(steps, "sft", 3, 5, f"planner SFT (LoRA), {stage.sft_epochs:g} epochs at lr {stage.sft_lr:g}")
    sft = run_sft(PlannerSftConfig(traces=str(traces), out=str(folder / "sft"), tracking=quiet,
                                   # no per-epoch checkpoint and evaluation: the final one is enough here
                                   train=SftTrainSettings(epochs=stage.sft_epochs, batch_size=stage.sft_batch_size,
                                                          lr=stage.sft_lr, logging_steps=2, save_steps=100_000)))
    finish()
    finish = _step(steps, "stitch", 4, 5, f"STITCH from the SFT adapter, {stage.stitch_steps} step(s) x "
                                          f"{stage.stitch_generations} rollouts")
    generations = stage.stitch_generations
    stitch = run_stitch(StitchConfig(
        data=data, traces=str(traces), out=str(folder / "stitch"), model=str(folder / "sft" / "final"),
        stitch=StitchSettings(steps=stage.stitch_steps, questions_per_step=2, num_generations=generations,
                              imitation_threshold=2),
        rewards=RewardSettings(max_completion_tokens=96), grpo=GrpoUpdateSettings(lr=1e-4), tracking=quiet))
    finish()
    finish = _step(steps, "eval", 5, 5, "base / sft / stitch on the held-out article's questions"
                                        + (" with SmartChunk QA" if stage.qa else ""))
    comparison = run_planner_eval(planner_eval_config(config, folder, server_url))
    finish()
    return {"dataset": stage.corpus, "pseudo_labels": counts, "trace_yield": yields, "sft": sft, "stitch": stitch,
            "n_questions": comparison["n_questions"], "n_unlabelled": comparison["n_unlabelled"],
            "split": comparison["split"],
            "majority_baseline": comparison["majority_baseline"],
            # over every planned held-out question, labelled or not
            "format_valid": {name: row["format_valid"] for name, row in comparison["variants"].items()},
            "variants": {name: {k: v for k, v in row.items() if k != "examples"}
                         for name, row in comparison["variants"].items()},
            "plots": [str(folder / "eval" / "planner_comparison.png"), str(folder / "eval" / "training_curves.png")],
            "step_seconds": steps}


def lattice_eval_config(config: QuickstartConfig, folder: Path, server_url: str) -> LatticeEvalConfig:
    """The lattice stage's comparison on the student's held-out questions: the oracle, the served teacher, the
    distilled student, the flat indexes and LATTICE++ over the teacher's ranking."""
    stage, student = config.lattice, folder / "ce_student"
    systems = {"oracle": SystemConfig("search", scorer="oracle", calibration=False),
               "teacher": SystemConfig("search", scorer="llm", server_url=server_url),
               "ce_student": SystemConfig("search", scorer="cross_encoder", model=str(student / "final")),
               "bm25": SystemConfig("bm25"), "dense": SystemConfig("dense"), "hybrid": SystemConfig("hybrid"),
               "lattice++": SystemConfig("fusion", of="teacher")}
    return LatticeEvalConfig(
        tree=str(folder / "tree.json"), corpus=config.corpora[stage.corpus], out=str(folder / "eval"),
        systems=systems, hierarchy=config.hierarchy, heldout_from=str(student),
        agreement_traces=str(folder / "traces.jsonl"), search=SearchConfig(iterations=stage.iterations),
        max_tokens=stage.max_tokens, max_candidate_chars=stage.max_candidate_chars, max_reasoning_chars=200,
        serve=stage_serve(config), tracking=TrackingConfig(backend="none"))


def _lattice_stage(config: QuickstartConfig, folder: Path, server_url: str) -> dict:
    """A bottom-up LATTICE tree built by the running stack's generator, the scorer role's traversal traces (the
    teacher), a cross-encoder distilled from them, and the comparison on the questions it did not train on."""
    stage, quiet = config.lattice, TrackingConfig(backend="none")
    corpus = config.corpora[stage.corpus]
    tree, traces, student = folder / "tree.json", folder / "traces.jsonl", folder / "ce_student"
    search = SearchConfig(iterations=stage.iterations)
    slates = {"max_tokens": stage.max_tokens, "max_candidate_chars": stage.max_candidate_chars,
              "max_reasoning_chars": 200}
    steps: dict[str, float] = {}
    finish = _step(steps, "tree", 1, 4, f"bottom-up tree over the first {stage.leaves} {stage.corpus} paragraphs, "
                                        f"at most {stage.m_max} children per node")
    build = run_lattice_tree(LatticeTreeConfig(
        corpus=corpus, out=str(folder), method="bottom-up", hierarchy=config.hierarchy,
        clustering=ClusteringConfig(m_max=stage.m_max), limit_leaves=stage.leaves, server_url=server_url,
        tracking=quiet))
    finish()
    finish = _step(steps, "traces", 2, 4, f"the teacher's traversal traces of {stage.trace_questions} questions, "
                                          f"{stage.iterations} iteration(s) each")
    traced = run_lattice_traces(LatticeTracesConfig(
        tree=str(tree), corpus=corpus, out=str(traces), hierarchy=config.hierarchy, search=search,
        limit=stage.trace_questions, batch_queries=stage.trace_questions, server_url=server_url, tracking=quiet,
        **slates))
    finish()
    finish = _step(steps, "distill", 3, 4, f"cross-encoder student, {stage.student_steps} steps on the teacher's "
                                           "scores")
    distilled = run_distill_scorer(DistillScorerConfig(
        traces=str(traces), out=str(student), student="cross_encoder", max_candidate_chars=stage.max_candidate_chars,
        train=SftTrainSettings(max_steps=stage.student_steps, lr=3e-4, batch_size=16, max_length=128,
                               val_fraction=stage.heldout_fraction, warmup_ratio=0.1, logging_steps=10),
        tracking=quiet))
    finish()
    finish = _step(steps, "eval", 4, 4, "oracle / teacher / student / BM25 / dense / hybrid / LATTICE++ on the "
                                        "student's held-out questions")
    table = run_lattice_eval(lattice_eval_config(config, folder, server_url))
    finish()
    return {"dataset": stage.corpus, "tree": build, "traces": traced, "student": distilled,
            "n_questions": table["n_questions"], "systems": table["systems"],
            "table": str(folder / "eval" / "table.md"), "plot": str(folder / "eval" / "quality_vs_cost.png"),
            "step_seconds": steps}


def _strategies_stage(config: QuickstartConfig, folder: Path, server_url: str) -> dict:
    """``overstory eval pipeline`` on each corpus's slice, on the job's stack; each corpus's row per strategy."""
    stage = config.strategies
    corpora: dict[str, dict] = {}
    for i, name in enumerate(stage.corpora, 1):
        console.print(f"[bold][{i}/{len(stage.corpora)}][/] {name}: {stage.strategies} on {stage.questions} "
                      "questions")
        corpus = config.corpora[name]
        report = run_pipeline_eval(PipelineEvalConfig(
            strategies=stage.strategies, corpus=CorpusConfig(corpus.kind, corpus.path, limit_docs=stage.limit_docs,
                                                             split=corpus.split),
            limit_questions=stage.questions, hierarchy=config.hierarchy, answer=config.answer, arag=stage.arag,
            server_url=server_url, serve=stage_serve(config),
            # answered afresh: the stack serves this run's planner adapter under the same role names as the last
            resume=False, out=str(folder / name), tracking=TrackingConfig(backend="none")))
        keys = ("contains_match", "token_f1", "recall@5", "llm_calls", "generator_tokens", "seconds", "failures",
                "repairs", "answered")
        corpora[name] = {"n_questions": report["n_questions"], "table": str(folder / name / "table.md"),
                         "plot": str(folder / name / "quality_vs_cost.png"),
                         "strategies": {strategy: {key: row[key] for key in keys if key in row}
                                        | {"costs_add_up": (row["costs_add_up"] or {}).get("match")}
                                        for strategy, row in report["strategies"].items()}}
    return {"strategies": stage.strategies.split(","), "corpora": corpora}


def run_retrieval_stage(config: QuickstartConfig, loaded: dict, chunks: dict, client: Client) -> dict:
    """recall@k of every index kind over the configured levels, for every corpus with questions: each corpus
    embedded once, each question searched in its scope (``retrieval_scope``; the stage records it per corpus)."""
    retrieval, stage = config.retrieval, {}
    for i, (name, (documents, questions)) in enumerate(loaded.items(), 1):
        answerable = [q for q in questions if q.evidence]
        if not answerable:
            continue
        mode = config.retrieval_scope_of(name)
        indexed = chunks_at_levels(chunks[name], retrieval.levels)
        console.print(f"[bold][{i}/{len(loaded)}][/] {name}: embedding {len(indexed)} chunks, then BM25, dense and "
                      f"hybrid recall@{retrieval.k}, each question searched "
                      + ("within its own document" if mode == "document" else "over the whole corpus"))
        dense = DenseIndex.build(indexed, lambda texts: client.embed("embedder", texts))
        bm25 = BM25Index.build(indexed)
        stage[name] = {"n_questions": len(answerable), "levels": list(retrieval.levels), "scope": mode,
                       "n_documents": len(documents)}
        for kind, index in {"bm25": bm25, "dense": dense, "hybrid": HybridIndex(dense, bm25)}.items():
            hits = search_in_scope(index, answerable, retrieval.k, mode)
            stage[name][f"{kind}_recall@{retrieval.k}"] = mean([
                recall_at_k([h.chunk for h in row], q.evidence, retrieval.k) for q, row in zip(answerable, hits)])
        console.print(f"{name}: " + ", ".join(f"{k}={v:.3f}" for k, v in stage[name].items() if "recall" in k))
    return stage


def _print_summary(report: dict, seconds: float, path: Path) -> None:
    rag = report["stages"]["rag_baseline"]
    table = Table(title=f"rag_baseline on {rag['dataset']}")
    for column in ("questions", "recall@k", "exact match", "token F1", "contains match", "failed", "repairs",
                   "seconds"):
        table.add_column(column)
    recall_key = next(k for k in rag if k.startswith("recall@"))
    table.add_row(str(rag["n_questions"]), f"{rag[recall_key]:.3f}", f"{rag['exact_match']:.3f}",
                  f"{rag['token_f1']:.3f}", f"{rag['contains_match']:.3f}",
                  str(rag["n_questions"] - rag["answered"]), repairs_cell(rag["repairs"]), f"{rag['seconds']:.1f}")
    console.print(table)
    planner = report["stages"].get("planner", {})
    if "format_valid" in planner:
        console.print(f"planner format-valid rate on {planner['n_questions'] + planner['n_unlabelled']} held-out "
                      "questions: " + ", ".join(
            f"{name} {rate:.2f}" for name, rate in planner["format_valid"].items()))
    lattice = report["stages"].get("lattice", {})
    if "systems" in lattice:
        console.print(f"lattice nDCG@10 on {lattice['n_questions']} held-out questions: " + ", ".join(
            f"{name} {row['ndcg@10']:.3f}" for name, row in lattice["systems"].items()))
    for name, row in report["stages"].get("strategies", {}).get("corpora", {}).items():
        console.print(f"strategies on {row['n_questions']} {name} questions, contains-match / generator tokens per "
                      "question: " + ", ".join(f"{s} {r['contains_match']:.2f} / {r['generator_tokens']:.0f}"
                                               for s, r in row["strategies"].items()))
    stage_seconds = report.get("stage_seconds", {})
    console.print("stage seconds: " + ", ".join(f"{name} {s:.0f}" for name, s in stage_seconds.items()))
    console.print(f"report: {path} (quickstart took {seconds:.0f}s)")
