"""A LATTICE search read from a traces job instead of run again: the ``recorded`` system of `overstory eval lattice`.

``overstory data lattice-traces`` searches each question with the teacher and writes, besides its slates
(``<out>``), one summary line per question (``<out stem>.queries.jsonl``: the ranking of the top leaves with their
path relevance, the gold leaves, scorer calls, tokens, seconds, failed slates and slate problems) and the settings it
ran under with the model that served it (``<out stem>.settings.json``, ``served``). When an evaluation asks for the
same search over the same tree, those lines are its result: re-running a CPU teacher for it costs hours and gives
what is on disk.

It is the same result only under the same settings, so ``load_recorded`` refuses, naming the key, a record whose
settings differ from the eval's where they change the ranking (``RANKING_KEYS``: the tree, the corpus, the hierarchy,
the leaf level, every ``search`` setting, the slate prompt's ``max_candidate_chars``, ``max_reasoning_chars`` and
``max_tokens``, and the reply schema's version ``slate_schema``, which a record made before it was recorded lacks),
and a question searched that the job never traced (how many, and one id). The traces job records the tree's path, not
a digest of it, so the tree's content is checked by what it decides: each question's recorded gold leaves must be the
eval's, and every leaf ranked must be a leaf of this tree.

The row has a search row's cost columns, per question as the traces job recorded them: scorer calls, prompt and
completion tokens, seconds, slates, failed slates and their problems (as repairs), where its slates lost the gold
(``routing``, as a searched row counts it); and ``served_by``, the model that
served the teacher (``oracle`` for the gold-label scorer). A question's recorded seconds are its search's wall time in
that job, which searched several questions at once: a latency under that load, several times the job's wall time per
question, which is what a searched row's seconds measure (its questions' wall time over their number). Given a
record of the job's wall time (``job_record``: a JSON with ``wall_s``, as ``scripts/teacher_runs.sh`` writes to
``runs/teacher/jobs/<job>.json``), the row's seconds are that over the questions the job traced, and the recorded
mean is kept as ``latency_seconds``; the note says which the row shows.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from overstory.core.config import ConfigError, differing_keys
from overstory.core.records import read_jsonl
from overstory.data_pipeline.fanout import CORPUS_OPERATIONAL_KEYS, settings_path
from overstory.evaluation.lattice_routing import ScoredSlate, gold_routing
from overstory.evaluation.repairs import repair_counts
from overstory.retrieval.lattice.tree import Tree

# the traces job's settings that change a question's ranking (the rest, e.g. concurrency or the stack, only its speed)
RANKING_KEYS = ("tree", "corpus", "hierarchy", "leaf_level", "search", "max_candidate_chars", "max_reasoning_chars",
                "max_tokens", "slate_schema")


@dataclass(frozen=True)
class RecordedSearch:
    """What a traces job recorded of the questions an eval searches."""

    traces: str
    served_by: str
    records: dict[str, dict]  # question id -> its summary line of <stem>.queries.jsonl
    slates: Counter[str]  # question id -> how many slates it logged
    n_traced: int  # questions the job traced (searched or not here)
    routing: dict[str, dict[str, int]]  # where its slates of these questions lost the gold (lattice_routing.py)


def queries_file(traces: str | Path) -> Path:
    """The per-question summaries beside a traces file, named as ``data_pipeline/lattice_traces.py`` names them."""
    traces = Path(traces)
    return traces.with_name(traces.stem + ".queries.jsonl")


def ranking_settings(settings: dict) -> dict:
    """The part of a traces job's settings (or an eval's, in the same keys) that decides a ranking, the tree as a
    resolved path and the corpus without its operational keys (path, limit_docs), as the traces job records them.

    >>> ranking_settings({"tree": "t.json", "corpus": {"kind": "hotpotqa", "path": "x"}, "concurrency": 8})["corpus"]
    {'kind': 'hotpotqa'}
    """
    view = {key: settings.get(key) for key in RANKING_KEYS if key in settings}
    if view.get("tree"):
        view["tree"] = str(Path(view["tree"]).resolve())
    if isinstance(view.get("corpus"), dict):
        view["corpus"] = {k: v for k, v in view["corpus"].items() if k not in CORPUS_OPERATIONAL_KEYS}
    return view


def _at(settings: dict, dotted: str) -> object:
    for part in dotted.split("."):
        settings = settings.get(part) if isinstance(settings, dict) else None
    return settings


def check_settings(name: str, recorded: dict, wanted: dict, record_file: Path) -> None:
    """Refuse a record made under other ranking settings than ``wanted`` (the eval's), naming each key."""
    old, new = ranking_settings(recorded), ranking_settings(wanted)
    changed = differing_keys(old, new)
    if changed:
        detail = ", ".join(f"{key} (recorded {_at(old, key)!r}, this eval {_at(new, key)!r})" for key in changed)
        raise ConfigError(f"systems.{name}.traces: the recorded search ran under other settings than this eval's: "
                          f"{detail} ({record_file}); set them as recorded, or search again (kind: search)")


def check_content(name: str, records: dict[str, dict], gold: dict[str, set[str]], tree: Tree) -> None:
    """Refuse records whose gold leaves differ from the eval's, or that rank a leaf this tree lacks: the tree or the
    corpus changed since the traces were made."""
    leaves = {leaf.id for leaf in tree.leaves()}
    for qid, leaves_gold in gold.items():
        recorded = set(records[qid].get("gold", []))
        if recorded != leaves_gold:
            raise ConfigError(f"systems.{name}.traces: question {qid}'s recorded gold leaves ({len(recorded)}) are not "
                              f"this eval's ({len(leaves_gold)}): the tree or the corpus changed since it was traced")
        stray = [doc for doc, _ in records[qid]["ranking"] if doc not in leaves]
        if stray:
            raise ConfigError(f"systems.{name}.traces: question {qid}'s recorded ranking holds {len(stray)} leaves "
                              f"this tree lacks (e.g. {stray[0]}): it was searched over another tree")


def served_by(recorded: dict) -> str:
    """The model that served the recorded search: the traces job's ``served`` entry for its role, ``oracle`` for
    the gold-label scorer."""
    if recorded.get("scorer") == "oracle":
        return "oracle"
    return recorded.get("served", {}).get(recorded.get("role", "scorer"), "not recorded")


def load_recorded(name: str, traces: str, wanted: dict, gold: dict[str, set[str]], tree: Tree) -> RecordedSearch:
    """The traces job's record of every question in ``gold``, after the checks of the module docstring."""
    record_file = settings_path(traces)
    if not record_file.exists():
        raise ConfigError(f"systems.{name}.traces: {record_file} not found: a recorded system reads the settings "
                          f"`overstory data lattice-traces` writes beside its traces")
    recorded = json.loads(record_file.read_text())
    check_settings(name, recorded, wanted, record_file)
    summaries = queries_file(traces)
    records = {r["id"]: r for r in read_jsonl(summaries)} if summaries.exists() else {}
    missing = [qid for qid in gold if qid not in records]
    if missing:
        raise ConfigError(f"systems.{name}.traces: {len(missing)} of the {len(gold)} questions searched have no "
                          f"record in {summaries} (e.g. {missing[0]}); trace them (the traces job resumes) or "
                          f"search them (kind: search)")
    check_content(name, records, gold, tree)
    slates = list(read_jsonl(traces))
    routing = gold_routing(tree, gold, (ScoredSlate(s["query_id"], s["expanded"], s["node_ids"], s["raw_scores"])
                                        for s in slates))
    return RecordedSearch(str(traces), served_by(recorded), {qid: records[qid] for qid in gold},
                          Counter(slate["query_id"] for slate in slates), len(records), routing)


def job_wall_seconds(name: str, job_record: str) -> float:
    """The traces job's wall time from its record (``wall_s``, over all its invocations), refused when absent or
    when the record says the job has not finished."""
    path = Path(job_record)
    record = json.loads(path.read_text()) if path.exists() else {}
    if not isinstance(record.get("wall_s"), (int, float)) or record.get("finished") is False:
        raise ConfigError(f"systems.{name}.job_record: {path} holds no finished job's wall_s (written when the traces "
                          f"job finishes; leave job_record empty to show each question's recorded seconds)")
    return float(record["wall_s"])


def recorded_row(recorded: RecordedSearch,
                 wall_s: float | None = None) -> tuple[dict, dict[str, list[tuple[str, float]]]]:
    """A search row's cost columns, per question as recorded (seconds: ``wall_s`` over the questions traced when
    given), ``served_by`` and a note; and the rankings."""
    records = list(recorded.records.values())
    n = len(records)
    problems: Counter[str] = Counter()
    for record in records:
        problems.update(record.get("problems", {}))
    slates = [recorded.slates[qid] for qid in recorded.records]
    latency = round(sum(r["seconds"] for r in records) / n, 3)
    if wall_s is None:
        seconds, timing = latency, "seconds: each question's search there, several searched at once (a latency)"
    else:
        seconds = round(wall_s / recorded.n_traced, 3)
        timing = (f"seconds: the job's wall time over its {recorded.n_traced} questions (each question's own "
                  f"search: {latency} s)")
    row = {"llm_calls": round(sum(r["llm_calls"] for r in records) / n, 2),
           "input_tokens": round(sum(r["input_tokens"] for r in records) / n, 1),
           "output_tokens": round(sum(r["output_tokens"] for r in records) / n, 1),
           "seconds": seconds, "latency_seconds": latency,
           "slates": round(sum(slates) / n, 2), "slates_total": sum(slates),
           "failed_slates": sum(r["failed_slates"] for r in records), "problems": dict(problems),
           "repairs": repair_counts([problems]), "routing": recorded.routing, "served_by": recorded.served_by,
           "traces": recorded.traces,
           "note": f"served by {recorded.served_by}; read from the traces job ({recorded.traces}), not re-run; "
                   f"{timing}"}
    rankings = {qid: [(doc, float(score)) for doc, score in record["ranking"]]
                for qid, record in recorded.records.items()}
    return row, rankings
