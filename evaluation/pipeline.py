"""`overstory eval pipeline`: every retrieval strategy on the same questions, with the same generator and costs.

    overstory eval pipeline --config configs/eval/pipeline.yaml --strategies naive,smartchunk,arag --data squad

Strategies: ``naive`` (hybrid top-k), ``smartchunk`` (the served planner's level range), ``lattice`` (LATTICE's tree
search with the served scorer), ``arag`` (A-RAG's tool-calling agent), ``fable`` (FABLE's bi-path retrieval over
document trees), ``orion`` (Orion-RAG's tag paths, weighted RRF and pruning) and ``bm25_floor`` (the baseline
with no LLM call: BM25 over the question's document's paragraphs, the top paragraph's sentence with the most
question words as the answer; document scope only); FABLE and Orion-RAG read the output of their index jobs
(``fable_forest``, ``orion.tags``) or build it here.

Document scope: QASPER, NarrativeQA and SQuAD ask each question about one given document (a paper, a story, an
article), and every strategy then retrieves from that document only (``Strategy.answer``'s ``scope``); HotpotQA's
questions are posed over the open corpus. ``scope: auto`` follows the dataset (``CorpusConfig.document_scoped``),
``scope: corpus`` searches the whole corpus for every question (open-corpus QASPER: a harder variant, named so in
the table and in metrics.json), ``scope: document`` insists on the question's document.

Each strategy is built once over the corpus by the Python API's builder (``overstory.retrieval.api.build_strategy``,
the one users call; its index cost is recorded apart), then answers every question
through a client of its own for that question (``Client.fork``), so the calls and tokens it spent are counted per
question and per role from the servers' ``usage``. Per strategy the report gives exact match, token F1,
contain-match and ROUGE-L (for free-form answers such as NarrativeQA's), an optional LLM judge's accuracy over all
questions (never over the answered ones only), recall@k of the evidence against the gold spans, tokens given to
the generator, LLM calls and tokens in/out per question by role, seconds per question and failures by kind. The
costs add up twice over: the per-role totals are the sums over questions, and when the harness talks HTTP they
are checked against the change in the servers' own token counters (``/metrics``; a vLLM stack's through its front
door) over the strategy's questions, roles that one vLLM server counts under one name summed together.

Writes ``metrics.json``, ``table.md``, ``predictions/<strategy>.jsonl``, ``quality_vs_cost.png`` (answer quality
against generator tokens per question, SmartChunk's Figure 1) and ``quality_vs_seconds.png``; for QASPER also
``qasper/<strategy>.jsonl`` in the official prediction format (``question_id``, ``predicted_answer``,
``predicted_evidence``) for the official evaluator, and QASPER's own metrics of it (``evaluation/qasper_metrics.py``:
Answer F1 overall and by answer type, Evidence F1, with intervals) in metrics.json and a second table. Its evidence
is the paragraphs of the strategy's top chunks, the first ``qasper.evidence_paragraphs`` of them in rank order;
with ``qasper.evidence: cited`` the generator is also asked to cite the numbered passages its answer rests on, and
``qasper/<strategy>.cited.jsonl`` holds those passages' paragraphs, scored beside the first, with the answers whose
citation could not be read (given the top chunks' paragraphs instead) counted next to its Evidence F1.

Each answered question is appended to ``predictions/<strategy>.jsonl`` as it finishes, so a killed run resumes where
it stopped and a larger ``limit_questions`` answers only the new questions (``evaluation/pipeline_records.py``;
``resume=false`` starts over).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

from overstory.core.config import ConfigError, to_dict
from overstory.core.failures import check_failure_share, raise_if_too_many
from overstory.core.progress import JobProgress
from overstory.core.records import Chunk, Document, QAExample
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.data_pipeline.orion_index import tag_and_index
from overstory.evaluation.pipeline_judge import JudgeConfig, judge_agreement, judge_answers, judge_sanity
from overstory.evaluation.pipeline_qasper import QasperConfig, qasper_outputs
from overstory.evaluation.pipeline_records import StrategyRecords, combined_cost_check, served_summary
from overstory.evaluation.pipeline_tables import QUALITY, pipeline_table
from overstory.evaluation.plots import plot_quality_vs_cost
from overstory.evaluation.qasper_metrics import gold_references, official_papers
from overstory.evaluation.repairs import repair_counts
from overstory.evaluation.scope import question_scope, resolve_scope
from overstory.retrieval import api
from overstory.retrieval.answer import AnswerConfig
from overstory.retrieval.api import check_lattice_tree, check_strategies, usage_by_role
from overstory.retrieval.arag import ARagConfig
from overstory.retrieval.fable.strategy import FableConfig
from overstory.retrieval.lattice.strategy import LatticeStrategyConfig
from overstory.retrieval.metrics import (
    bootstrap_interval,
    contains_match,
    exact_match,
    mean,
    recall_at_k,
    rouge_l,
    token_f1,
)
from overstory.retrieval.naive import NaiveConfig
from overstory.retrieval.orion.query import QUERY_PROMPTS_DIGEST
from overstory.retrieval.orion.strategy import OrionConfig
from overstory.retrieval.orion.tagger import ChunkingConfig, TaggingConfig
from overstory.retrieval.smartchunk import SmartChunkConfig
from overstory.retrieval.strategy import RequestRefused, Strategy, StrategyAnswer
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig
from overstory.serving.job_client import client_for, served_models
from overstory.serving.stack_metrics import role_groups

# Questions the harness could not get answered: the requests failed after the client's retries, or the strategy
# raised. Replies a strategy could not use (no_answer, no_tool_call, budget_exhausted, ...) are measurements.
RUN_FAILURES = ("request_failed", "strategy_error")
# where each question is searched: auto = the dataset's own setting, document = the question's document only,
# corpus = every document (the open corpus)
# the shipped samples by name (`--data hotpotqa`); the `corpus` section names any other copy (../shared/data)
DATASETS: dict[str, CorpusConfig] = {
    "hotpotqa": CorpusConfig("hotpotqa", "data/hotpotqa"),
    "squad": CorpusConfig("squad", "data/squad/dev-v2.0-articles.json"),
    "qasper": CorpusConfig("qasper", "data/qasper", split="dev"),
    "narrativeqa": CorpusConfig("narrativeqa", "data/narrativeqa"),
}
NOT_LLM_ROLES = ("embedder", "compressor")  # their requests are encoder passes, not LLM calls


@dataclass(frozen=True)
class PipelineEvalConfig:
    # comma-separated, from naive, smartchunk, lattice, arag, fable, orion, bm25_floor
    strategies: str = "naive,smartchunk"
    data: str = ""  # a shipped sample by name (hotpotqa, squad, qasper, narrativeqa); empty: the corpus section
    corpus: CorpusConfig = field(default_factory=lambda: DATASETS["hotpotqa"])
    limit_questions: int = 30  # 0 = all
    skip_unanswerable: bool = True
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)
    answer: AnswerConfig = field(default_factory=AnswerConfig)
    naive: NaiveConfig = field(default_factory=NaiveConfig)
    smartchunk: SmartChunkConfig = field(default_factory=SmartChunkConfig)
    lattice: LatticeStrategyConfig = field(default_factory=LatticeStrategyConfig)
    arag: ARagConfig = field(default_factory=ARagConfig)
    fable: FableConfig = field(default_factory=FableConfig)
    # a forest.json from `overstory data fable-forest` over the same corpus; empty: the harness builds the forest
    # (its LLM calls are the strategy's index cost; minutes per document on CPU, so build big corpora once)
    fable_forest: str = ""
    # orion.tags: the out folder of `overstory data orion-tags` over the same corpus; empty: the harness tags the
    # corpus into <out>/orion_tags with these settings (the tagging calls are the strategy's index cost)
    orion: OrionConfig = field(default_factory=OrionConfig)
    orion_chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    orion_tagging: TaggingConfig = field(default_factory=TaggingConfig)
    recall_k: int = 5
    qasper: QasperConfig = field(default_factory=QasperConfig)
    # auto: each question searched within its own document where the dataset poses it so (squad, qasper,
    # narrativeqa), over the whole corpus otherwise (hotpotqa); document / corpus: force one (corpus on qasper is
    # open-corpus QASPER, a harder variant)
    scope: str = "auto"
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    concurrency: int = 2  # questions answered at once (each strategy's own calls may fan out further)
    resume: bool = True  # keep the answers already in <out>/predictions (same settings); false: answer them again
    request_timeout_s: float = 600.0
    # the run exits 1 (after writing its tables) when more than this share of its questions went unanswered for the
    # harness's reasons (RUN_FAILURES); replies a strategy could not use are its figures, not failures of the run
    max_failure_share: float = 0.0
    server_url: str = ""  # a running stack; empty starts `serve` in the background
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    out: str = "runs/eval/pipeline"
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        check_strategies(self.names)
        if self.data and self.data not in DATASETS:
            raise ConfigError(f"data: {self.data!r} is not a shipped sample ({', '.join(DATASETS)}); name another "
                              "copy in the corpus section")
        if "lattice" in self.names:
            check_lattice_tree(self.lattice)
        mode = self.scope_mode  # refuses an unknown scope, or document scope on an open corpus, naming the key
        if "bm25_floor" in self.names and mode == "corpus":
            raise ConfigError("strategies: bm25_floor answers within each question's own document (BM25 over its "
                              "paragraphs), and these questions are searched over the open corpus "
                              f"({self.dataset.kind}, scope={self.scope}): leave it out, or use squad, qasper or "
                              "narrativeqa with scope=auto")
        check_failure_share(self.max_failure_share)
        if self.limit_questions < 0 or self.recall_k < 1 or self.concurrency < 1 or self.request_timeout_s <= 0:
            raise ConfigError("limit_questions must be >= 0, recall_k and concurrency >= 1, request_timeout_s > 0")

    @property
    def names(self) -> list[str]:
        return [s.strip() for s in self.strategies.split(",") if s.strip()]

    @property
    def dataset(self) -> CorpusConfig:
        """The corpus evaluated: the shipped sample ``data`` names (``corpus.limit_docs`` still applies), else the
        corpus section."""
        if not self.data:
            return self.corpus
        return replace(DATASETS[self.data], limit_docs=self.corpus.limit_docs)

    @property
    def answer_settings(self) -> AnswerConfig:
        """How the strategies ask the generator: the ``answer`` section, citing its passages when a QASPER run
        predicts cited evidence (``qasper.evidence: cited``)."""
        if self.dataset.kind == "qasper" and self.qasper.evidence == "cited":
            return replace(self.answer, cite=True)
        return self.answer

    @property
    def scope_mode(self) -> str:
        """Where questions are searched: ``document`` (each within its own document) or ``corpus`` (everywhere)."""
        return resolve_scope(self.scope, self.dataset)


def select_questions(questions: Sequence[QAExample], limit: int, skip_unanswerable: bool) -> list[QAExample]:
    """The first ``limit`` questions (0: all), leaving out those without a reference answer when asked to."""
    kept = [q for q in questions if q.answers or not skip_unanswerable]
    return kept[:limit] if limit else kept


def build_strategy(name: str, config: PipelineEvalConfig, documents: Sequence[Document], chunks: Sequence[Chunk],
                   client: Client) -> Strategy:
    """Build one strategy over the corpus with the API's builder (``retrieval.api.build_strategy``) and this config's
    sections; index calls go through ``client``. Orion-RAG without a tags folder has the corpus tagged first into
    ``<out>/orion_tags`` (a data job, so it runs here, above the API)."""
    section = getattr(config, name, None)
    if name == "orion" and not config.orion.tags:
        section = replace(config.orion, tags=str(Path(config.out) / "orion_tags"))
        tag_and_index(documents, client, section.tags, config.orion_chunking, config.orion_tagging)
    return api.build_strategy(name, documents, chunks, client, section, config.answer_settings,
                              forest=config.fable_forest if name == "fable" else "")


def answer_question(strategy: Strategy, question: QAExample, client: Client, recall_k: int,
                    scope: Sequence[str] | None = None) -> dict:
    """One question through one strategy on a client of its own, searched in the documents ``scope`` names (None:
    the whole corpus): the answer, its scores and what it cost."""
    own = client.fork()
    started = time.perf_counter()
    try:
        result = strategy.answer(question.question, own, scope=scope)
    except (RequestRefused, ConfigError):  # every question would fail alike (a 4xx, a tree of another corpus)
        raise
    except Exception as exc:  # a strategy bug must not lose the question: it is recorded, with the error
        result = StrategyAnswer("", "", failure="strategy_error", failure_detail=f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - started
    usage = usage_by_role(own)
    return {
        "id": question.id, "question": question.question, "answers": question.answers,
        "scope": list(scope) if scope is not None else None, "prediction": result.prediction, "raw": result.raw,
        "failure": result.failure, "failure_detail": result.failure_detail,
        "evidence": [c.id for c in result.evidence],
        f"recall@{recall_k}": recall_at_k(result.evidence, question.evidence, recall_k),
        "exact_match": exact_match(result.prediction, question.answers),
        "token_f1": token_f1(result.prediction, question.answers),
        # lenient: the gold answer appears in the raw reply (small models answer in sentences)
        "contains_match": contains_match(result.raw, question.answers),
        "rouge_l": rouge_l(result.prediction, question.answers),
        "seconds": round(seconds, 3), "usage": usage, "details": result.details,
        "evidence_spans": [[c.doc_id, c.start, c.end] for c in result.evidence[:recall_k]],
    }


def failure_counts(records: Sequence[dict]) -> dict[str, int]:
    """Questions that failed (no answer), by kind; what strategies repaired inside answered questions is counted
    apart (``repairs``).

    >>> failure_counts([{"failure": "request_failed"}, {"failure": ""}, {"failure": "request_failed"}])
    {'request_failed': 2}
    """
    return dict(Counter(record["failure"] for record in records if record["failure"]))


def slate_counts(records: Sequence[dict]) -> dict[str, int] | None:
    """The slates a tree search scored over these questions and how many of them failed (no score could be read);
    None for a strategy without slates.

    >>> slate_counts([{"details": {"slates": 4, "failed_slates": 1}}, {"details": {"slates": 3, "failed_slates": 0}}])
    {'slates': 7, 'failed': 1}
    >>> slate_counts([{"details": {"turns": 2}}]) is None
    True
    """
    with_slates = [r["details"] for r in records if "slates" in r["details"]]
    if not with_slates:
        return None
    return {"slates": sum(d["slates"] for d in with_slates), "failed": sum(d.get("failed_slates", 0)
                                                                            for d in with_slates)}


def summarise(records: Sequence[dict], recall_k: int) -> dict:
    """A strategy's row: quality means with 95% bootstrap intervals, costs per question, failures and repairs by
    kind, and the failed slates of a tree search."""
    n = len(records)
    row: dict = {"n_questions": n, "answered": sum(1 for r in records if not r["failure"])}
    for key in (*QUALITY, f"recall@{recall_k}", "judge"):
        values = [r.get(key) for r in records]
        if all(v is None for v in values):
            continue
        row[key] = mean(values)
        row[f"{key}_ci95"] = bootstrap_interval(values)
    roles = sorted({role for r in records for role in r["usage"]})
    totals = {role: {k: sum(r["usage"].get(role, {}).get(k, 0) for r in records)
                     for k in ("calls", "prompt_tokens", "completion_tokens", "failed_calls")} for role in roles}
    row["usage_total"] = totals
    row["per_question"] = {role: {k: round(v / n, 2) for k, v in t.items()} for role, t in totals.items()}
    llm = [role for role in roles if role not in NOT_LLM_ROLES]
    row["llm_calls"] = round(sum(totals[r]["calls"] for r in llm) / n, 2)
    row["llm_input_tokens"] = round(sum(totals[r]["prompt_tokens"] for r in llm) / n, 1)
    row["llm_output_tokens"] = round(sum(totals[r]["completion_tokens"] for r in llm) / n, 1)
    row["generator_tokens"] = round(totals.get("generator", {}).get("prompt_tokens", 0) / n, 1)
    row["seconds"] = round(sum(r["seconds"] for r in records) / n, 3)
    row["failures"] = failure_counts(records)
    row["repairs"] = repair_counts(r["details"] for r in records)
    slates = slate_counts(records)
    if slates is not None:
        row["slates"] = slates
    agreement = judge_agreement(records)
    if agreement is not None:
        row["judge_vs_contains"] = agreement
    return {**row, **served_summary(records)}


def costs_add_up(totals: dict[str, dict[str, int]], before: dict | None, after: dict | None) -> dict | None:
    """Compare the per-question sums by role with the change in the servers' counters. The counters are keyed by
    the roles they stand for (``Client.server_token_totals``): a role, or ``a+b`` where one vLLM server counts
    several roles under one name; the sums are added up the same way before they are compared.

    >>> costs_add_up({"generator": {"prompt_tokens": 10, "completion_tokens": 2},
    ...               "planner": {"prompt_tokens": 4, "completion_tokens": 1}},
    ...              {"generator+planner": {"prompt_tokens": 5, "completion_tokens": 1}},
    ...              {"generator+planner": {"prompt_tokens": 19, "completion_tokens": 4}})
    {'match': True, 'server': {'generator+planner': {'prompt_tokens': 14, 'completion_tokens': 3}}}
    """
    if before is None or after is None:
        return None
    server = {key: {k: after.get(key, {}).get(k, 0) - before.get(key, {}).get(k, 0)
                    for k in ("prompt_tokens", "completion_tokens")} for key in after}
    server = {key: v for key, v in server.items() if any(v.values())}
    ours = {key: v for key, v in role_groups(totals, after).items() if any(v.values())}
    return {"match": server == ours, "server": server}


def run_strategy(name: str, strategy: Strategy, questions: Sequence[QAExample], client: Client,
                 config: PipelineEvalConfig, progress: JobProgress, records: StrategyRecords, served: dict[str, str],
                 already_done: int = 0) -> tuple[list[dict], dict | None]:
    """Answer ``questions``, appending each record as it finishes, with the models that served its calls (``served``:
    role -> model); the records and the cost check of this run."""
    task = progress.add_task(f"{name}: questions", total=already_done + len(questions), completed=already_done)
    before = client.server_token_totals()

    def one(question: QAExample) -> dict:
        record = answer_question(strategy, question, client, config.recall_k,
                                 question_scope(question, config.scope_mode))
        record["served_by"] = {role: served[role] for role in record["usage"] if role in served}
        records.append(record)
        progress.advance(task)
        return record

    try:
        with ThreadPoolExecutor(max_workers=config.concurrency) as pool:
            answered = list(pool.map(one, questions))
    finally:
        records.close()
    after = client.server_token_totals()
    totals = summarise(answered, config.recall_k)["usage_total"]
    return answered, costs_add_up(totals, before, after)


def strategy_settings(name: str, config: PipelineEvalConfig, checkpoints: dict) -> dict:
    """What decides a strategy's answers; records made under other settings are not resumed. A running server's
    address is left out (its port changes between runs; its served names stay). The scope is recorded when it is
    the question's document: records without it were searched over the open corpus. Orion-RAG's records name its
    query prompts (their digest), which its settings do not otherwise show."""
    own = {"fable": ("fable", "fable_forest"), "orion": ("orion", "orion_chunking", "orion_tagging"),
           "bm25_floor": ()}.get(name, (name,))
    full = {**to_dict(config), "answer": to_dict(config.answer_settings)}
    scope = {"scope": "document"} if config.scope_mode == "document" else {}
    prompts = {"orion_prompts": QUERY_PROMPTS_DIGEST} if name == "orion" else {}
    return {"dataset": to_dict(config.dataset), **scope, "skip_unanswerable": config.skip_unanswerable,
            **{key: full[key] for key in ("hierarchy", "answer", "recall_k", *own)}, **prompts,
            "checkpoints": {key: value for key, value in checkpoints.items() if key != "server_url"}}


def evaluate_strategy(name: str, config: PipelineEvalConfig, corpus: tuple[Sequence[Document], Sequence[Chunk]],
                      questions: Sequence[QAExample], client: Client, progress: JobProgress,
                      checkpoints: dict, served: dict[str, str]) -> tuple[dict, list[dict]]:
    """One strategy's row and records: the questions answered before (same settings, same served models) are kept,
    the rest are answered now by a strategy built over the corpus (its index cost recorded with the run)."""
    records = StrategyRecords(Path(config.out) / "predictions", name)
    records.start(strategy_settings(name, config, checkpoints), config.resume)
    ids = [q.id for q in questions]
    done = records.done(ids, retry=RUN_FAILURES)
    todo = [q for q in questions if q.id not in done]
    if todo:
        records.check_served(done, served)
    if done:
        print(f"{name}: resuming, {len(done)} of {len(questions)} questions already answered in {records.path} "
              f"(questions the harness failed to answer are asked again)")
    if todo:
        index_client = client.fork()
        started = time.perf_counter()
        strategy = build_strategy(name, config, *corpus, index_client)
        index = {"seconds": round(time.perf_counter() - started, 2), "usage": index_client.stats.summary()}
        answered, check = run_strategy(name, strategy, todo, client, config, progress, records, served, len(done))
        records.log_run({"question_ids": [r["id"] for r in answered], "index": index, "costs_add_up": check,
                         "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})
        done.update({r["id"]: r for r in answered})
    ordered = [done[i] for i in ids]
    row: dict = {}
    if config.judge.enabled:
        row["judge_usage"] = judge_answers(ordered, {q.id: q for q in questions}, client, config.judge)
    if todo or config.judge.enabled:
        records.rewrite(ordered)  # the questions' order (they were appended as they finished), with any verdicts
    runs = records.runs()
    row = {**summarise(ordered, config.recall_k), **row, "costs_add_up": combined_cost_check(runs, ids),
           "runs": len(runs), "index": runs[-1]["index"] if runs else None}
    return row, ordered


def _recorded_checkpoints(config: PipelineEvalConfig, client: Client) -> dict:
    """Which models answered: the roles of the stack the harness started, or what a running server lists."""
    if config.server_url:
        return {"server_url": config.server_url, "models": client.models()}
    return {role: {"model": r.model, "kind": r.kind, "adapter": r.adapter} for role, r in config.serve.roles.items()}


def run(config: PipelineEvalConfig) -> dict:
    out = Path(config.out)
    (out / "predictions").mkdir(parents=True, exist_ok=True)
    corpus = config.dataset
    documents, questions = load_corpus(corpus)
    questions = select_questions(questions, config.limit_questions, config.skip_unanswerable)
    if not questions:
        raise ConfigError(f"corpus {corpus.path} has no questions to evaluate")
    for question in questions:  # a question without its document is refused before any strategy is built
        question_scope(question, config.scope_mode)
    chunks = build_hierarchies(documents, config.hierarchy)
    report: dict = {"dataset": corpus.kind, "corpus": to_dict(corpus), "scope": config.scope_mode,
                    "n_questions": len(questions), "n_documents": len(documents), "recall_k": config.recall_k,
                    "strategies": {}}
    gold = None
    if corpus.kind == "qasper":  # the references as the official evaluator reads them, from the same JSON
        gold = gold_references(official_papers(corpus), config.qasper.text_evidence_only)
        report["qasper"] = to_dict(config.qasper)
    with ExitStack() as stack, JobProgress() as progress:
        tracker = stack.enter_context(start_run(config.tracking, "eval pipeline", config))
        client = stack.enter_context(client_for(replace(config.serve, port=0), config.server_url,
                                                timeout_s=config.request_timeout_s))
        report["checkpoints"] = _recorded_checkpoints(config, client)
        report["served"] = served_models(client)  # role -> the model its server says serves it (the judge's too)
        if config.judge.enabled:
            report["judge_sanity"] = judge_sanity(questions, client, config.judge)
        for name in config.names:
            row, records = evaluate_strategy(name, config, (documents, chunks), questions, client, progress,
                                             report["checkpoints"], report["served"])
            report["strategies"][name] = row
            if gold is not None:
                row["qasper"] = qasper_outputs(name, records, documents, gold, Path(config.out), config.qasper)
        tracker.summary({f"{name}/{key}": value for name, row in report["strategies"].items()
                         for key, value in row.items()
                         if isinstance(value, (int, float)) and not isinstance(value, bool)})
    sanity = report.get("judge_sanity")
    judge_works = sanity is not None and sanity["reference_accepted"] == sanity["asked"]
    quality = "judge" if judge_works else "contains_match"  # a judge that refuses the reference plots nothing
    label = f"{corpus.kind}, open corpus" if corpus.document_scoped and config.scope_mode == "corpus" else corpus.kind
    (out / "metrics.json").write_text(json.dumps({"config": to_dict(config), **report}, indent=2))
    (out / "table.md").write_text(pipeline_table(report))
    plot_quality_vs_cost(report["strategies"], out / "quality_vs_cost.png", quality=quality, cost="generator_tokens",
                         cost_label="tokens given to the generator per question",
                         title=f"{label}: answer quality against generator tokens per question")
    plot_quality_vs_cost(report["strategies"], out / "quality_vs_seconds.png", quality=quality,
                         title=f"{label}: answer quality against seconds per question")
    print(pipeline_table(report))
    print(f"-> {out / 'metrics.json'}, {out / 'table.md'}, {out / 'quality_vs_cost.png'}")
    raise_if_run_failed(report, config.max_failure_share, out / "predictions")
    return report


def raise_if_run_failed(report: dict, max_failure_share: float, predictions: Path) -> None:
    """``TooManyFailures`` when more than ``max_failure_share`` of the questions, over every strategy, failed for
    one of ``RUN_FAILURES`` (the records in ``predictions`` keep them; a rerun with ``resume`` asks them again).

    >>> rows = {"naive": {"n_questions": 4, "failures": {"request_failed": 1, "no_answer": 2}}}
    >>> raise_if_run_failed({"strategies": rows}, 0.25, Path("p"))
    >>> try:
    ...     raise_if_run_failed({"strategies": rows}, 0.0, Path("p"))
    ... except RuntimeError as exc:
    ...     print(type(exc).__name__, exc.counts)
    TooManyFailures {'failed': 1}
    """
    rows = report["strategies"].values()
    failed = sum(row.get("failures", {}).get(kind, 0) for row in rows for kind in RUN_FAILURES)
    raise_if_too_many("eval pipeline", {"failed": failed}, sum(row["n_questions"] for row in rows), max_failure_share,
                      str(predictions))
