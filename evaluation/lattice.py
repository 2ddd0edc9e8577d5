"""`overstory eval lattice`: LATTICE's search with each scorer beside BM25, dense, hybrid and LATTICE++, one table.

    overstory eval lattice --config configs/eval/lattice.yaml --compare oracle,teacher,ce_pointwise,bm25,dense

Every system ranks the tree's leaves for the same questions (those with gold leaves: HotpotQA's supporting
paragraphs, QASPER's evidence paragraphs; ``heldout_from`` keeps a student's held-out questions only). Quality is
nDCG@10, Recall@10 and Recall@100 against the gold leaves with binary gains (as the released LATTICE code),
computed by ``ir_measures`` (trec_eval's definitions), each with a 95% bootstrap interval over questions. Cost per
question: scorer calls, prompt and completion tokens (the server's ``usage``) and seconds.

System kinds (``systems`` in the config; ``--compare`` picks names):

* ``search``: the calibrated tree search with a scorer: ``oracle`` (gold labels: can the tree and the search reach
  the gold at all), ``llm`` (the served ``scorer`` role: the teacher, or with ``model`` a distilled LoRA adapter
  on it) or ``cross_encoder`` (``model``: a CrossEncoder folder, served at ``/score``; whether it serves
  probabilities or raw logits is what each response reports, checked against the folder's saved activation,
  ``serving.cross_encoder.saved_activation``, which also stands in for a ``server_url`` that does not report one
  (vLLM); the scorer maps either onto 0-100 in order). ``calibration: false``
  turns the slate-bias fit off (a pointwise scorer has no slate bias: measure both).
* ``bm25``, ``dense`` (the built-in MiniLM), ``hybrid`` (their reciprocal rank fusion): flat retrieval over the
  same leaves.
* ``recorded``: a search that ``overstory data lattice-traces`` already ran, read from the job's record
  (``traces``: its traces file; ``evaluation/lattice_recorded.py``) instead of run again: each question's ranking and
  cost as the job recorded them, and the model that served it (``served_by``). Refused, naming the key, when the job
  ran under other settings than this eval's where they change the ranking (tree, corpus, hierarchy, leaf level,
  ``search``, the slate prompt's sizes), and when a question searched has no record. A CPU teacher's search over
  the students' held-out questions is then read, not re-run (hours here).
* ``fusion``: LATTICE++, the ranking of the search (or recorded) system ``of`` fused with BM25 and dense by min-max
  normalised weights (``retrieval/lattice/fusion.py``); its cost is that search's.

Each scorer system gets a stack of its own (``serve`` with the ``scorer`` role replaced) unless it names a
``server_url``. With ``agreement_traces`` (teacher slates from ``overstory data lattice-traces``: one file or a list,
as the students were trained on), each system whose ``model`` is a distilled student also scores the teacher's slates
of the student's held-out questions in every file (``heldout_queries.json`` beside ``model``): Kendall tau with the
teacher's scores and top-1 agreement, beside top-1's chance and first-candidate references
(``evaluation/lattice_agreement.py``; each slate's scores in ``agreement/<system>.jsonl``). Several students can be
rows of one table (the cross-encoder's losses and activations side by side): every student whose folder has a
``heldout_queries.json`` must have held out each question searched, or the run is refused naming it.
The ratio columns (nDCG@10 as a share of the teacher's, times faster) compare each row with the row named
``teacher``, searched or recorded. Writes ``metrics.json``, ``table.md``, ``rankings/<system>.jsonl`` and
``quality_vs_cost.png``; and for each search (or recorded) row, where it loses the gold, depth by depth
(``routing``: ``evaluation/lattice_routing.py``), in the table and in ``routing.png``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np

from overstory.core.config import ConfigError, path_list, to_dict
from overstory.core.progress import JobProgress
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig
from overstory.data_pipeline.lattice_leaves import gold_leaves, tree_leaf_chunks
from overstory.evaluation.lattice_agreement import agreement, agreement_cell, heldout_slates
from overstory.evaluation.lattice_recorded import RecordedSearch, job_wall_seconds, load_recorded, recorded_row
from overstory.evaluation.lattice_routing import ScoredSlate, gold_routing, plot_routing, routing_table
from overstory.evaluation.markdown import grid
from overstory.evaluation.plots import plot_quality_vs_cost
from overstory.evaluation.repairs import repair_counts, repairs_cell
from overstory.models.registry import MINILM, base_model_of, load_sentence_encoder
from overstory.models.scorer import SLATE_SCHEMA
from overstory.retrieval.index import BM25Index, DenseIndex, HybridIndex
from overstory.retrieval.lattice.fusion import LATTICE_PP_WEIGHTS, lattice_pp
from overstory.retrieval.lattice.scorers import (
    CrossEncoderSlateScorer,
    LLMSlateScorer,
    OracleSlateScorer,
    SlateScorer,
)
from overstory.retrieval.lattice.search import SearchConfig, check_reach, search
from overstory.retrieval.lattice.tree import Tree
from overstory.retrieval.metrics import bootstrap_interval
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.cross_encoder import saved_activation
from overstory.serving.job_client import client_for

MEASURES = ("nDCG@10", "R@10", "R@100")


@dataclass(frozen=True)
class SystemConfig:
    kind: Literal["search", "recorded", "bm25", "dense", "hybrid", "fusion"]
    scorer: Literal["oracle", "llm", "cross_encoder"] = "llm"  # search only
    # search: llm -> a LoRA adapter folder (a distilled student) on its base model, empty = the served scorer
    # role as configured (the teacher); cross_encoder -> a CrossEncoder folder
    model: str = ""
    calibration: bool = True
    of: str = ""  # fusion: the search (or recorded) system whose ranking is fused
    weights: dict[str, float] = field(default_factory=lambda: dict(LATTICE_PP_WEIGHTS))
    note: str = ""  # shown in the table, e.g. "trained on gold labels (not distillation)"
    server_url: str = ""  # a running server whose scorer role this system uses (no stack is started)
    traces: str = ""  # recorded: the traces file of the `overstory data lattice-traces` job that searched
    # recorded: the job's wall time record (wall_s; scripts/teacher_runs.sh's runs/teacher/jobs/<job>.json): the row's
    # seconds become it per question traced, comparable with a searched row's; empty: each question's recorded seconds
    job_record: str = ""


@dataclass(frozen=True)
class LatticeEvalConfig:
    tree: str
    corpus: CorpusConfig
    out: str
    systems: dict[str, SystemConfig]
    compare: str = ""  # comma-separated names from `systems`; empty: all of them
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)  # as the tree was built with
    leaf_level: str = "paragraph"
    limit: int = 0  # at most this many questions (0: all with gold leaves in the tree)
    heldout_from: str = ""  # a distill-scorer output folder: only its held-out questions
    # teacher slates for the students' agreement: a traces file or a list of them (empty: not measured)
    agreement_traces: str | list[str] = ""
    search: SearchConfig = field(default_factory=SearchConfig)
    max_tokens: int = 384
    max_reasoning_chars: int = 400
    max_candidate_chars: int = 600
    max_attempts: int = 2
    concurrency: int = 8
    request_timeout_s: float = 900.0  # per request; queued slates on a CPU server wait long
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        names = self.names
        unknown = [n for n in names if n not in self.systems]
        if unknown:
            raise ConfigError(f"compare: {', '.join(unknown)} not in systems ({', '.join(self.systems) or 'none'})")
        for name in names:
            system = self.systems[name]
            if system.kind == "fusion" and self.systems.get(system.of, SystemConfig("bm25")).kind not in (
                    "search", "recorded"):
                raise ConfigError(f"systems.{name}.of must name a search system or a recorded one, got {system.of!r}")
            if system.kind == "recorded" and not system.traces:
                raise ConfigError(f"systems.{name}.traces: a recorded system needs the traces file of the "
                                  "`overstory data lattice-traces` job that searched")
            if system.kind == "search" and system.scorer == "cross_encoder" and not system.model:
                raise ConfigError(f"systems.{name}.model: a cross_encoder scorer needs a CrossEncoder folder")
        if self.limit < 0:
            raise ConfigError(f"limit must be >= 0, got {self.limit}")

    @property
    def names(self) -> list[str]:
        return [n for n in self.compare.split(",") if n] or list(self.systems)

    @property
    def agreement_files(self) -> list[str]:
        """``agreement_traces`` as a list: a YAML list, or one string with the paths comma-separated (as a command
        line override gives them)."""
        return path_list(self.agreement_traces)

    def ranking_settings(self, system: SystemConfig) -> dict:
        """This eval's settings in the keys a traces job records, for a recorded system's check."""
        return {"tree": self.tree, "corpus": to_dict(self.corpus), "hierarchy": to_dict(self.hierarchy),
                "leaf_level": self.leaf_level, "search": to_dict(replace(self.search, calibration=system.calibration)),
                "max_candidate_chars": self.max_candidate_chars, "max_reasoning_chars": self.max_reasoning_chars,
                "max_tokens": self.max_tokens, "slate_schema": SLATE_SCHEMA}


# --- metrics -----------------------------------------------------------------------------------------------

def retrieval_metrics(rankings: dict[str, list[tuple[str, float]]], gold: dict[str, set[str]]) -> dict:
    """Mean nDCG@10, R@10 and R@100 over the questions of ``gold`` (a question a system left without a ranking
    scores 0), each with its 95% bootstrap interval, from ``ir_measures``."""
    import ir_measures

    qrels = {q: dict.fromkeys(leaves, 1) for q, leaves in gold.items()}
    # trec_eval breaks score ties by document id; the ranks are made explicit so each system's own order counts
    run = {q: {doc: float(len(ranking) - rank) for rank, (doc, _) in enumerate(ranking)}
           for q, ranking in rankings.items() if ranking}
    per_query = {m: dict.fromkeys(gold, 0.0) for m in MEASURES}
    parsed = [ir_measures.parse_measure(m) for m in MEASURES]
    for metric in ir_measures.iter_calc(parsed, qrels, run):
        per_query[str(metric.measure)][metric.query_id] = float(metric.value)
    out: dict = {}
    for measure in MEASURES:
        values = list(per_query[measure].values())
        key = measure.lower().replace("r@", "recall@")
        out[key] = round(float(np.mean(values)), 4) if values else None
        interval = bootstrap_interval(values)
        out[f"{key}_ci95"] = [round(v, 4) for v in interval] if interval else None
    return out


# --- systems -----------------------------------------------------------------------------------------------

def _scorer_role(config: LatticeEvalConfig, system: SystemConfig) -> RoleConfig:
    """The ``scorer`` role a search system's stack serves."""
    if system.scorer == "cross_encoder":
        return RoleConfig(model=system.model, kind="cross-encoder")
    teacher = config.serve.roles.get("scorer")
    if teacher is None:
        raise ConfigError("serve.roles.scorer: the llm scorer systems need a scorer role to serve")
    if system.model:  # a distilled LoRA student on its base model
        return replace(teacher, model=base_model_of(system.model), adapter=system.model)
    return teacher


def _slate_scorer(config: LatticeEvalConfig, system: SystemConfig, stack: ExitStack, tree: Tree,
                  gold: dict[str, set[str]]) -> SlateScorer:
    """The system's slate scorer; a model-backed one gets a client for ``server_url`` or for a scorer stack of its
    own, open for as long as ``stack`` is."""
    if system.scorer == "oracle":
        return OracleSlateScorer(tree, gold)
    serve = config.serve if system.server_url else replace(config.serve, port=0,
                                                           roles={"scorer": _scorer_role(config, system)})
    client = stack.enter_context(client_for(serve, system.server_url, timeout_s=config.request_timeout_s))
    if system.scorer == "cross_encoder":
        return CrossEncoderSlateScorer(client, concurrency=config.concurrency,
                                       activation=saved_activation(system.model))
    return LLMSlateScorer(client, max_tokens=config.max_tokens, max_attempts=config.max_attempts,
                          concurrency=config.concurrency, max_candidate_chars=config.max_candidate_chars,
                          max_reasoning_chars=config.max_reasoning_chars)


def check_students(config: LatticeEvalConfig, question_ids: list[str]) -> None:
    """Before any stack starts, refuse a student row that would mislead, naming it: a cross-encoder folder whose
    saved activation is not served (neither probabilities nor logits), or a student scored on a question it trained
    on (each search system whose ``model`` folder has a ``heldout_queries.json`` beside it must have held out every
    question searched; students trained on the same traces with the same ``val_fraction`` share one split, and
    ``heldout_from`` picks it)."""
    for name in config.names:
        system = config.systems[name]
        if system.kind != "search" or not system.model:
            continue
        if system.scorer == "cross_encoder":
            try:
                saved_activation(system.model)
            except ValueError as exc:
                raise ConfigError(f"systems.{name}.model: {exc}") from exc
        held_file = Path(system.model).parent / "heldout_queries.json"
        if not held_file.exists():
            continue
        trained = [q for q in question_ids if q not in set(json.loads(held_file.read_text()))]
        if trained:
            raise ConfigError(f"systems.{name}.model: {system.model} was trained on {len(trained)} of the "
                              f"{len(question_ids)} questions searched (e.g. {trained[0]}); set heldout_from to its "
                              "folder, or train every student on the same traces with the same val_fraction")


def check_recorded(config: LatticeEvalConfig, tree: Tree,
                   gold: dict[str, set[str]]) -> dict[str, tuple[RecordedSearch, float | None]]:
    """Before any stack starts: every recorded system's record of the questions searched with its job's wall time
    (None without ``job_record``), or its refusal."""
    found = {}
    for name in config.names:
        system = config.systems[name]
        if system.kind == "recorded":
            found[name] = (load_recorded(name, system.traces, config.ranking_settings(system), gold, tree),
                           job_wall_seconds(name, system.job_record) if system.job_record else None)
    return found


def _questions(config: LatticeEvalConfig):
    tree = Tree.load(config.tree)
    check_reach(tree, config.search.iterations, "search.iterations")
    documents, questions = load_corpus(config.corpus)
    leaves = tree_leaf_chunks(tree, documents, config.hierarchy, config.leaf_level)
    gold = gold_leaves(questions, leaves)
    chosen = [q for q in questions if q.id in gold]
    if config.heldout_from:
        held_file = Path(config.heldout_from) / "heldout_queries.json"
        if not held_file.exists():
            raise ConfigError(f"heldout_from: {config.heldout_from} has no heldout_queries.json (distill-scorer writes "
                              "it into its out folder): name the folder of a student trained on these traces")
        held = set(json.loads(held_file.read_text()))
        chosen = [q for q in chosen if q.id in held]
    if config.limit:
        chosen = chosen[: config.limit]
    if not chosen:
        raise ConfigError(f"no question of {config.corpus.path!r} has gold leaves in {config.tree}"
                          + (f" among the held-out queries of {config.heldout_from}" if config.heldout_from else ""))
    return tree, leaves, chosen, {q.id: gold[q.id] for q in chosen}


def run(config: LatticeEvalConfig) -> dict:
    tree, leaves, questions, gold = _questions(config)
    queries = [(q.id, q.question) for q in questions]
    check_students(config, [q.id for q in questions])
    recorded = check_recorded(config, tree, gold)
    out = Path(config.out)
    (out / "rankings").mkdir(parents=True, exist_ok=True)
    flat: dict[str, object] = {}
    encoder = None

    def flat_index(kind: str):
        nonlocal encoder
        if kind not in flat:
            if kind != "bm25" and encoder is None:
                encoder = load_sentence_encoder(MINILM)
            embed = (lambda texts: encoder.encode(texts, batch_size=64)) if kind != "bm25" else None
            if kind == "bm25":
                flat[kind] = BM25Index.build(leaves)
            elif kind == "dense":
                flat[kind] = DenseIndex.build(leaves, embed)
            else:
                flat[kind] = HybridIndex(flat_index("dense"), flat_index("bm25"))
        return flat[kind]

    results: dict[str, dict] = {}
    rankings: dict[str, dict[str, list[tuple[str, float]]]] = {}
    order = sorted(config.names, key=lambda n: config.systems[n].kind == "fusion")  # fusions after their search
    with ExitStack() as stack:
        tracker = stack.enter_context(start_run(config.tracking, "eval lattice", config))
        for name in order:
            system = config.systems[name]
            print(f"[{name}] {system.kind}" + (f" / {system.scorer}" if system.kind == "search" else ""))
            if system.kind == "search":
                row, rankings[name] = _run_search(config, system, tree, queries, gold)
            elif system.kind == "recorded":
                row, rankings[name] = recorded_row(*recorded[name])
            elif system.kind == "fusion":
                row, rankings[name] = _run_fusion(system, rankings, results, queries, flat_index)
            else:
                index = flat_index(system.kind)  # built (leaves embedded) before the clock: a query's cost only
                started = time.perf_counter()
                hits = index.search([q for _, q in queries], k=config.search.top_k)
                seconds = (time.perf_counter() - started) / len(queries)
                rankings[name] = {qid: [(h.chunk.id, h.score) for h in row_hits]
                                  for (qid, _), row_hits in zip(queries, hits, strict=True)}
                row = {"llm_calls": 0.0, "input_tokens": 0.0, "output_tokens": 0.0, "seconds": round(seconds, 4),
                       "repairs": {}}
            note = "; ".join(n for n in (system.note, row.pop("note", "")) if n)
            row = {**retrieval_metrics(rankings[name], gold), **row, "kind": system.kind, "note": note}
            if system.kind == "search":
                row.update(scorer=system.scorer)
            if system.kind in ("search", "recorded"):
                row.update(calibration=system.calibration)
            if config.agreement_files and system.kind == "search" and system.model:
                row["agreement"] = _run_agreement(config, name, tree, gold)
            results[name] = row
            with open(out / "rankings" / f"{name}.jsonl", "w") as handle:
                for qid, ranking in rankings[name].items():
                    handle.write(json.dumps({"id": qid, "ranking": ranking[:100]}) + "\n")
        report = {"n_questions": len(queries), "tree": config.tree, "measures": list(MEASURES),
                  "systems": results}
        (out / "metrics.json").write_text(json.dumps(report, indent=2))
        (out / "table.md").write_text(markdown_table(report))
        plot_quality_vs_cost(results, out / "quality_vs_cost.png")
        plot_routing(results, out / "routing.png")
        tracker.summary({f"{name}/{k}": v for name, row in results.items() for k, v in row.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)})
    print(markdown_table(report))
    print(f"-> {out / 'metrics.json'}, {out / 'table.md'}, {out / 'quality_vs_cost.png'}, {out / 'routing.png'}")
    return report


def _run_search(config: LatticeEvalConfig, system: SystemConfig, tree: Tree, queries, gold):
    settings = replace(config.search, calibration=system.calibration)
    with ExitStack() as stack:
        scorer = _slate_scorer(config, system, stack, tree, gold)
        with JobProgress() as progress:
            bar = progress.add_task(f"  search iterations ({len(queries)} questions)", total=settings.iterations)
            found = search(tree, queries, scorer, settings,
                           progress=lambda i: progress.update(bar, completed=i + 1))
    n = len(found)
    problems: Counter[str] = Counter()
    for result in found:
        problems.update(result.problems)
    row = {"llm_calls": round(sum(r.llm_calls for r in found) / n, 2),
           "input_tokens": round(sum(r.input_tokens for r in found) / n, 1),
           "output_tokens": round(sum(r.output_tokens for r in found) / n, 1),
           "seconds": round(sum(r.seconds for r in found) / n, 3),
           "slates": round(sum(len(r.slates) for r in found) / n, 2),
           "slates_total": sum(len(r.slates) for r in found),
           "failed_slates": sum(r.failed_slates for r in found), "problems": dict(problems),
           # what the search repaired: slate replies with unusable parts, candidates it left unscored
           "repairs": repair_counts([problems]),
           "routing": gold_routing(tree, gold, (ScoredSlate(r.query_id, s.expanded, s.node_ids, s.raw_scores)
                                                for r in found for s in r.slates))}
    return row, {r.query_id: r.ranking for r in found}


def _run_fusion(system: SystemConfig, rankings, results, queries, flat_index):
    if system.of not in rankings:
        raise ConfigError(f"fusion of {system.of!r}: compare it too (the fusion reuses its ranking)")
    k = max(len(r) for r in rankings[system.of].values()) or 100
    texts = [q for _, q in queries]
    bm25 = flat_index("bm25").search(texts, k=k)
    dense = flat_index("dense").search(texts, k=k)
    fused = {qid: lattice_pp(rankings[system.of][qid], [(h.chunk.id, h.score) for h in b],
                             [(h.chunk.id, h.score) for h in d], system.weights, top_k=k)
             for (qid, _), b, d in zip(queries, bm25, dense, strict=True)}
    base = results[system.of]  # the fused ranking rests on that search's slates: its cost, failed slates and repairs
    return {key: base[key] for key in ("llm_calls", "input_tokens", "output_tokens", "seconds", "slates_total",
                                       "failed_slates", "repairs") if key in base}, fused


def _run_agreement(config: LatticeEvalConfig, name: str, tree: Tree, gold) -> dict:
    """``name``'s agreement with the teacher (``evaluation/lattice_agreement.py``), its slates' scores kept in
    ``agreement/<name>.jsonl``."""
    system = config.systems[name]
    slates = heldout_slates(config.agreement_files, system.model)
    if not slates:
        return {"kendall_tau": None, "top1_agreement": None, "n_slates": 0}
    with ExitStack() as stack:
        return agreement(_slate_scorer(config, system, stack, tree, gold), slates,
                         record=Path(config.out) / "agreement" / f"{name}.jsonl")


def markdown_table(report: dict) -> str:
    """One row per system: quality with intervals, cost per question, the failed slates among the slates scored and
    the repairs by kind (slate replies with unusable parts, candidates left unscored; a fusion shows its search's),
    and the students' agreement; with a system named ``teacher``, each row's nDCG@10 as a share of the teacher's and
    how many times faster it answers.

    >>> row = {"ndcg@10": 0.5, "llm_calls": 0, "input_tokens": 0, "output_tokens": 0}
    >>> table = markdown_table({"n_questions": 2, "systems": {"teacher": {**row, "seconds": 10.0},
    ...                                                       "bm25": {**row, "ndcg@10": 0.4, "seconds": 0.1}}})
    >>> [line.split(" | ")[-3:-1] for line in table.splitlines()[4:]]
    [['1.00', '1x'], ['0.80', '100x']]
    """
    teacher = report["systems"].get("teacher")
    versus = ["nDCG@10 / teacher's", "times faster than teacher"] if teacher else []
    header = ["system", "nDCG@10", "Recall@10", "Recall@100", "scorer calls", "tokens in / out", "seconds",
              "failed slates", "repairs", "Kendall tau / top-1 vs teacher", *versus, "note"]
    rows = []

    def cell(row, key):
        value, interval = row.get(key), row.get(f"{key}_ci95")
        if value is None:
            return "-"
        return f"{value:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else f"{value:.3f}"

    def relative(row) -> list[str]:
        if not teacher:
            return []
        quality = f"{row['ndcg@10'] / teacher['ndcg@10']:.2f}" if teacher.get("ndcg@10") else "-"
        speed = f"{teacher['seconds'] / row['seconds']:.0f}x" if row["seconds"] > 0 else "-"
        return [quality, speed]

    for name, row in report["systems"].items():
        label = name + ("" if row.get("calibration", True) else " (calibration off)")
        slates = f"{row['failed_slates']}/{row['slates_total']}" if "slates_total" in row else "-"
        cells = [label, cell(row, "ndcg@10"), cell(row, "recall@10"), cell(row, "recall@100"), f"{row['llm_calls']:g}",
                 f"{row['input_tokens']:g} / {row['output_tokens']:g}", f"{row['seconds']:.3f}", slates,
                 repairs_cell(row.get("repairs")), agreement_cell(row.get("agreement")), *relative(row),
                 row.get("note", "")]
        rows.append(cells)
    lines = [f"{report['n_questions']} questions; 95% bootstrap intervals; cost per question", "",
             grid(header, rows).rstrip("\n")]
    if any(row.get("routing") for row in report["systems"].values()):
        lines += ["", "Where each search loses the gold (evaluation/lattice_routing.py): per depth of the node "
                  "expanded, slates holding a child that leads to a gold leaf / slates scored -> those where it was "
                  "scored first (ties included)", "", routing_table(report["systems"]).rstrip("\n")]
    return "\n".join(lines) + "\n"
