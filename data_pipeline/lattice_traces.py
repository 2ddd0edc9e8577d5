"""`overstory data lattice-traces`: LATTICE searches with a teacher scorer over training questions, every slate logged.

    overstory data lattice-traces --config configs/data/lattice_traces.yaml

The distillation data of the scorer students. Questions come from the corpus the tree was built over; their gold
leaves are the tree's leaf chunks that overlap the question's evidence (HotpotQA: the supporting paragraphs; QASPER:
the evidence paragraphs; ``data_pipeline/lattice_leaves.py``). Each question is one item of the fan-out: its search
runs on the runner's workers (``batch_queries`` questions at once, on threads or, with ``runner: ray``, on Ray Data
workers whose requests are spread over ``ray.endpoints``), its slates scored ``concurrency // batch_queries`` at a
time (at least one), so about ``concurrency`` requests are in flight in all. When a question's search finishes, its
slates are appended to ``out`` (query, candidate ids and texts, the teacher's raw scores and reasoning, the latent
scores after the refit, whether each candidate leads to gold), then its summary (ranking, recall@10, calls, tokens,
seconds) to ``<out>.queries.jsonl``, which marks it done. Finished questions are skipped on restart, so a killed run
resumes; slates of a question without a summary (a run killed between the two) are discarded on restart and the
question is searched again from scratch, so two searches' slates never mix. A question whose search lost a slate to a
transient request failure (a timeout, a 5xx, the server down; the slate's ``failure`` field says so) is not written:
it goes to ``<out>.failures.jsonl`` and a rerun searches it again; a refused request (4xx: a wrong role, a bad
request) raises ``RequestRefused`` (``retrieval/strategy.py``) and stops the job. The job runs on the fan-out skeleton
(``data_pipeline/fanout.py``): its settings, the slate reply schema's version and the scorer's served model are kept
in ``<out>.settings.json`` (a rerun with others is refused), and it fails (exit code 1) when more than
``max_failure_share`` of its questions failed. The job's totals (its tracked summary and the line it prints) add up
the questions written: slates, recall@10, and beside them the slate repairs (``SLATE_REPAIRS``): failed slates, those
among them whose prompt did not fit the teacher's context (``prompt_too_long_failed``: not sent) and the replies cut
at ``max_tokens`` (``reply_truncated``: their complete scores kept), each question's own counts being in its summary's
``failed_slates`` and ``problems``. ``scorer: oracle`` scores from the gold labels instead of an LLM (no server
needed): it checks what the search can reach and gives a best-case trace set.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from overstory.core.config import ConfigError
from overstory.core.records import JsonlAppender, QAExample, read_jsonl, write_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.fanout import Fanout, ServedWork, job_server, job_settings
from overstory.data_pipeline.hierarchy import HierarchyConfig
from overstory.data_pipeline.lattice_leaves import gold_leaves, tree_leaf_chunks
from overstory.data_pipeline.ray_runner import RayConfig
from overstory.models.scorer import SLATE_SCHEMA
from overstory.retrieval.lattice.scorers import LLMSlateScorer, OracleSlateScorer, SlateScorer
from overstory.retrieval.lattice.search import SearchConfig, SearchResult, check_reach, search
from overstory.retrieval.lattice.tree import Tree
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig
from overstory.serving.job_client import client_for, served_models


@dataclass(frozen=True)
class LatticeTracesConfig:
    tree: str  # a tree from `overstory data lattice-tree`
    corpus: CorpusConfig  # the questions, and the documents the tree's leaves came from
    out: str
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)  # as the tree was built with
    leaf_level: str = "paragraph"
    scorer: Literal["llm", "oracle"] = "llm"
    role: str = "scorer"  # the teacher's role on the server
    max_tokens: int = 384
    max_reasoning_chars: int = 400
    max_candidate_chars: int = 600
    max_attempts: int = 2
    concurrency: int = 8  # slate requests in flight over all the questions searched at once
    search: SearchConfig = field(default_factory=SearchConfig)
    batch_queries: int = 8  # questions searched at once (the fan-out's threads or Ray workers)
    limit: int = 0  # trace at most this many questions (0 = all with gold leaves in the tree)
    max_failure_share: float = 0.0  # the job fails (exit 1) when more of its questions than this failed
    server_url: str = ""
    # seconds one request may wait: a CPU server with `concurrency` slates queued answers each slowly, and a
    # question with a timed-out slate is searched again by a rerun
    request_timeout_s: float = 900.0
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    runner: Literal["threads", "ray"] = "threads"  # ray: Ray Data workers, requests spread over ray.endpoints
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        if self.batch_queries < 1 or self.concurrency < 1 or self.max_attempts < 1:
            raise ConfigError("batch_queries, concurrency and max_attempts must be >= 1")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        if self.limit < 0:
            raise ConfigError(f"limit must be >= 0, got {self.limit}")


# the repairs of the teacher's slates the totals add up over the questions written (as evaluation/repairs.py
# counts them): slates without usable scores, and two of their causes, a prompt refused before sending for want of
# context (always a failed slate) and a reply cut at max_tokens (a failed slate only when no score was complete)
SLATE_REPAIRS = ("failed_slates", "prompt_too_long_failed", "reply_truncated")


def leads_to_gold(tree: Tree, node_ids: list[str], gold: set[str]) -> list[bool]:
    """For each node: is it a gold leaf, or does a gold leaf lie below it."""
    on_path = tree.on_paths_to(gold)
    return [n in on_path for n in node_ids]


def slate_records(tree: Tree, result: SearchResult, query: str, gold: set[str], teacher: str) -> list[dict]:
    return [{"id": s.slate_id, "query_id": result.query_id, "query": query, "teacher": teacher,
             **{k: v for k, v in asdict(s).items() if k != "slate_id"},
             "leads_to_gold": leads_to_gold(tree, s.node_ids, gold)} for s in result.slates]


def query_record(result: SearchResult, query: str, gold: set[str], k: int = 10) -> dict:
    top = [n for n, _ in result.ranking[:k]]
    return {"id": result.query_id, "query": query, "gold": sorted(gold), "ranking": result.ranking,
            f"recall@{k}": len(set(top) & gold) / len(gold), "llm_calls": result.llm_calls,
            "input_tokens": result.input_tokens, "output_tokens": result.output_tokens,
            "scorer_seconds": round(result.scorer_seconds, 3), "seconds": round(result.seconds, 3),
            "failed_slates": result.failed_slates, "problems": result.problems}


def traces_settings(config: LatticeTracesConfig) -> dict:
    """What decides the traces (a rerun under others is refused): the config's settings and the slate reply schema's
    version the teacher was held to (``SLATE_SCHEMA``)."""
    return {**job_settings(config, drop={"batch_queries"}), "slate_schema": SLATE_SCHEMA}


def run(config: LatticeTracesConfig) -> dict:
    """Search every question with gold leaves the output lacks, logging each question's slates and summary."""
    tree = Tree.load(config.tree)
    check_reach(tree, config.search.iterations, "search.iterations")
    documents, questions = load_corpus(config.corpus)
    gold = gold_leaves(questions, tree_leaf_chunks(tree, documents, config.hierarchy, config.leaf_level))
    todo_questions = [q for q in questions if q.id in gold][: config.limit or None]
    if not todo_questions:
        raise ConfigError(f"no question of {config.corpus.path!r} has evidence in the tree's leaves ({config.tree}); "
                          f"build the tree over the same corpus and hierarchy settings")
    out = Path(config.out)
    queries_path = out.with_name(out.stem + ".queries.jsonl")
    totals = {"questions": 0, "slates": 0, "recall@10": 0.0, **dict.fromkeys(SLATE_REPAIRS, 0)}
    with ExitStack() as stack:
        tracker = stack.enter_context(start_run(config.tracking, "data lattice-traces", config))
        fanout = stack.enter_context(Fanout("lattice-traces", queries_path,
                                            traces_settings(config), beside=out,
                                            concurrency=config.batch_queries,
                                            max_failure_share=config.max_failure_share, runner=config.runner,
                                            ray=config.ray))
        todo = fanout.todo(todo_questions, lambda q: q.id)
        discard_unfinished_slates(out, fanout.out.done)
        slates_out = stack.enter_context(JsonlAppender(out))
        teacher = "oracle" if config.scorer == "oracle" else config.role
        if todo:  # the teacher's server is asked for (or started) only when a question is left
            fanout.run(todo, lambda q: q.id, _search_work(config, tree, gold, fanout, stack),
                       lambda q, result: _write_question(q, result, tree, gold[q.id], teacher, slates_out, fanout,
                                                         totals), "lattice traces (questions)")
        totals = {**totals, **fanout.finish(),
                  "recall@10": round(totals["recall@10"] / max(totals["questions"], 1), 4)}
        tracker.summary(totals)
    print(f"lattice traces ({teacher}): {totals['questions']} questions, {totals['slates']} slates "
          f"({repairs_line(totals)}), recall@10 {totals['recall@10']}, {totals['failed']} failed (searched again on "
          f"rerun), {totals['skipped']} already done -> {out}")
    fanout.raise_if_failed()
    return totals


def _search_work(config: LatticeTracesConfig, tree: Tree, gold: dict[str, set[str]], fanout: Fanout,
                 stack: ExitStack) -> ServedWork | Callable[[QAExample], SearchResult]:
    """One question's search: with the oracle, a plain function; else ``ServedWork`` through the served role (its
    model recorded with the settings), its slates scored ``concurrency // batch_queries`` at a time."""
    if config.scorer == "oracle":
        return _searcher(config, tree, OracleSlateScorer(tree, gold))
    url, options = job_server(config.server_url, config.runner, config.ray)
    client = stack.enter_context(client_for(config.serve, url, timeout_s=config.request_timeout_s, **options))
    fanout.record_served(served_models(client, [config.role]))

    def build(worker_client: Client) -> Callable[[QAExample], SearchResult]:
        return _searcher(config, tree, LLMSlateScorer(
            worker_client, role=config.role, max_tokens=config.max_tokens, max_attempts=config.max_attempts,
            concurrency=max(1, config.concurrency // config.batch_queries),
            max_candidate_chars=config.max_candidate_chars, max_reasoning_chars=config.max_reasoning_chars))
    return ServedWork(build, client, {"timeout_s": config.request_timeout_s})


def _searcher(config: LatticeTracesConfig, tree: Tree, scorer: SlateScorer) -> Callable[[QAExample], SearchResult]:
    """The search of one question (a search's questions are independent: one at a time gives each the result a
    batch of them would)."""
    return lambda question: search(tree, [(question.id, question.question)], scorer, config.search)[0]


def _write_question(question: QAExample, result: SearchResult, tree: Tree, gold: set[str], teacher: str,
                    slates_out: JsonlAppender, fanout: Fanout, totals: dict) -> None:
    """A question's slates, then its summary (which marks it done); or, when a slate's request failed on a
    transient error, nothing but a failure (the rerun searches it again)."""
    lost = transient_failures(result)
    if lost:
        fanout.fail(question.id, f"{len(lost)} of {len(result.slates)} slates lost to a request failure, e.g. "
                                 f"{lost[0]}")
        return
    for record in slate_records(tree, result, question.question, gold, teacher):
        slates_out.write(record)
        totals["slates"] += 1
    summary = query_record(result, question.question, gold)
    fanout.write(summary, "questions")
    totals["questions"] += 1
    totals["recall@10"] += summary["recall@10"]
    totals["failed_slates"] += result.failed_slates
    for key in SLATE_REPAIRS[1:]:
        totals[key] += result.problems.get(key, 0)


def repairs_line(totals: dict) -> str:
    """The slate repairs of a run's totals as its summary prints them.

    >>> repairs_line({"failed_slates": 3, "prompt_too_long_failed": 1, "reply_truncated": 2})
    '3 failed slates (1 prompt too long, not sent), 2 replies cut at max_tokens'
    """
    return (f"{totals['failed_slates']} failed slates ({totals['prompt_too_long_failed']} prompt too long, not "
            f"sent), {totals['reply_truncated']} replies cut at max_tokens")


def transient_failures(result: SearchResult) -> list[str]:
    """The errors of the slates lost to a transient request failure (a timeout, a 5xx, the server down), read from
    each slate's ``failure`` field ("" when its request got a reply); a refused request (a 4xx other than 408 and
    429), which no rerun mends, never gets here: the scorers raise ``RequestRefused`` for it."""
    return [slate.failure for slate in result.slates if slate.failure]


def discard_unfinished_slates(out: Path, finished: set[str]) -> int:
    """Drop from ``out`` the slates of questions without a summary (a run killed between a question's slates and
    its summary), so that the rerun's search of that question starts from scratch; returns how many were dropped."""
    if not out.exists():
        return 0
    slates = list(read_jsonl(out))
    kept = [s for s in slates if s["query_id"] in finished]
    if len(kept) < len(slates):
        write_jsonl(out, kept)
    return len(slates) - len(kept)
