"""LATTICE's calibrated best-first tree search (the paper's Algorithm 4), queries in lockstep.

Per query and iteration: take the ``beam`` explored, unexpanded internal nodes of highest path relevance
(one global frontier); each becomes a slate of its children plus calibration nodes from other branches;
every query's slates of the iteration go to the scorer together; the latent scores are refitted on the
query's whole score history (``calibration.fit_latent_scores``) and every explored node's path relevance
is recomputed. After ``iterations`` rounds (or an empty frontier) the scored leaves are ranked by path
relevance.

Where this follows the paper and where the released code (github.com/nilesh2797/lattice) differs:

* path relevance ``p(v) = alpha * p(parent) + (1 - alpha) * s_hat(v)``, ``p(root) = 1``, with the
  calibrated ``s_hat``, recomputed after every refit and used both for the frontier and the final
  ranking (the paper). The code builds the frontier from raw scores, fixed when a node is first seen,
  weights the current node by its factor (the reverse convention), lets a raw score <= 0.09 replace the
  path relevance outright, and uses calibrated scores only in the final leaf ranking.
* a calibration node for a slate of internal children is the best-ranked explored node at the
  children's depth outside the slate (the code takes the expanded node's own depth, which can be the
  expanded node itself); for leaf children, ``calibration_leaves`` scored leaves are drawn without
  replacement with weight 16^s_hat (the code's weighting, without its Gaussian-mixture threshold).
* a damaged reply keeps its valid scores; candidates it leaves out stay unscored (relevance 0 in the
  ranking, no fake observation in the fit) and are counted. The code drops the whole reply. An unscored node
  has no ``s_hat`` (it is no calibration anchor either), its path relevance is 0 rather than its parent's
  share, and it ranks after every scored node, in the frontier and in the final ranking: a calibrated path
  relevance can be below 0, and no evidence must never outrank weak evidence. A later slate that scores it
  makes it an ordinary node.
* a slate whose request failed for a transient reason keeps the error in ``SlateRecord.failure`` (a rerun of
  the traces job asks again); a refused request (a 4xx other than 408 and 429) raises from the scorer.
* ``calibration=False`` uses each node's mean raw score as ``s_hat``: the setting for pointwise scorers
  (cross-encoder, oracle), which have no slate bias to remove.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from overstory.core.config import ConfigError
from overstory.retrieval.lattice.calibration import Observation, fit_latent_scores
from overstory.retrieval.lattice.scorers import Slate, SlateScore, SlateScorer
from overstory.retrieval.lattice.tree import Tree

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SearchConfig:
    """The paper's defaults: beam B = 2, N = 20 iterations, alpha = 0.5, l = 10 calibration leaves."""

    beam: int = 2
    iterations: int = 20
    alpha: float = 0.5
    calibration_leaves: int = 10
    calibration: bool = True
    top_k: int = 100
    bias_ridge: float = 1e-2
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("beam", "iterations", "top_k"):
            if getattr(self, key) < 1:
                raise ConfigError(f"search.{key} must be >= 1, got {getattr(self, key)}")
        if not 0.0 <= self.alpha < 1.0:
            raise ConfigError(f"search.alpha must be in [0, 1), got {self.alpha}")
        if self.calibration_leaves < 0:
            raise ConfigError(f"search.calibration_leaves must be >= 0, got {self.calibration_leaves}")


@dataclass
class SlateRecord:
    """One scored slate as the traversal traces log it (latent scores are the ones after the refit)."""

    slate_id: str
    iteration: int
    expanded: str
    node_ids: list[str]
    texts: list[str]
    leaf: bool
    calibration_ids: list[str]
    raw_scores: list[float | None]
    latent_scores: list[float | None] = field(default_factory=list)
    reasoning: str = ""
    raw_reply: str = ""
    parsed: bool = True
    problems: dict[str, int] = field(default_factory=dict)
    # "" when the slate's request got a reply; else the transient request error that lost it (worth asking again)
    failure: str = ""


@dataclass
class SearchResult:
    """The ranked leaves of one query (ids and path relevance) and what the search cost."""

    query_id: str
    ranking: list[tuple[str, float]]
    slates: list[SlateRecord]
    llm_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    scorer_seconds: float = 0.0
    seconds: float = 0.0
    failed_slates: int = 0
    problems: dict[str, int] = field(default_factory=dict)


class _QueryState:
    """One query's explored part of the tree: observations, latent and path relevance, expanded set."""

    def __init__(self, query_id: str, query: str, tree: Tree, config: SearchConfig):
        self.query_id, self.query, self.tree, self.config = query_id, query, tree, config
        self.observations: list[Observation] = []
        self.raw: dict[str, list[float]] = {}
        self.s_hat: dict[str, float] = {}
        self.path_rel: dict[str, float] = {tree.root: 1.0}
        self.expanded: set[str] = set()
        self.unscored: set[str] = set()
        self.result = SearchResult(query_id=query_id, ranking=[], slates=[])
        self.problems: Counter[str] = Counter()
        self.rng = np.random.default_rng([config.seed, zlib.crc32(query_id.encode())])

    def rank_key(self, node_id: str) -> tuple[bool, float, str]:
        """Best first: scored nodes by path relevance, then unscored ones (relevance 0); ties by id."""
        return node_id in self.unscored, -self.path_rel[node_id], node_id

    def frontier(self) -> list[str]:
        candidates = [n for n in self.path_rel if n not in self.expanded and not self.tree.nodes[n].leaf]
        candidates.sort(key=self.rank_key)
        return candidates[: self.config.beam]

    def slate_for(self, node_id: str) -> tuple[Slate, list[str]]:
        children = list(self.tree.node(node_id).children)
        leaf = all(self.tree.nodes[c].leaf for c in children)
        calibration = self._calibration_nodes(children, leaf) if self.config.calibration else []
        ids = children + calibration
        texts = [self.tree.nodes[i].display_text for i in ids]
        return Slate(self.query_id, self.query, ids, texts, leaf), calibration

    def _calibration_nodes(self, children: list[str], leaf: bool) -> list[str]:
        taken = set(children)
        if leaf:
            pool = [n for n in self.s_hat if self.tree.nodes[n].leaf and n not in taken]
            if len(pool) <= self.config.calibration_leaves:
                return sorted(pool)
            weights = np.array([16.0 ** self.s_hat[n] for n in pool])
            picks = self.rng.choice(len(pool), size=self.config.calibration_leaves, replace=False,
                                    p=weights / weights.sum())
            return [pool[i] for i in sorted(picks)]
        depth = self.tree.depth(children[0])
        same_depth = [n for n in self.s_hat if n not in taken and self.tree.depth(n) == depth]
        best = max(same_depth, key=lambda n: (self.path_rel.get(n, 0.0), n), default=None)
        return [best] if best is not None else []

    def record(self, iteration: int, index: int, expanded: str, slate: Slate, calibration: list[str],
               score: SlateScore) -> SlateRecord:
        slate_id = f"{self.query_id}/{iteration}/{index}"
        for position, node_id in enumerate(slate.node_ids):
            if position in score.scores:
                value = score.scores[position] / 100.0
                self.observations.append(Observation(slate_id, node_id, value))
                self.raw.setdefault(node_id, []).append(value)
                self.unscored.discard(node_id)
            elif node_id not in self.raw:
                self.unscored.add(node_id)
        self.expanded.add(expanded)
        result = self.result
        result.llm_calls += score.calls
        result.input_tokens += score.input_tokens
        result.output_tokens += score.output_tokens
        result.scorer_seconds += score.seconds
        result.failed_slates += int(not score.parsed)
        self.problems.update({k: v for k, v in score.problems.items() if v})
        record = SlateRecord(slate_id=slate_id, iteration=iteration, expanded=expanded, node_ids=slate.node_ids,
                             texts=slate.texts, leaf=slate.leaf, calibration_ids=calibration,
                             raw_scores=[score.scores.get(i) for i in range(len(slate.node_ids))],
                             reasoning=score.reasoning, raw_reply=score.raw, parsed=score.parsed,
                             problems=dict(score.problems), failure=score.failure)
        result.slates.append(record)
        return record

    def refit(self, new_records: list[SlateRecord]) -> None:
        if self.config.calibration:
            self.s_hat = fit_latent_scores(self.observations, self.config.bias_ridge).node_scores
        else:
            self.s_hat = {n: float(np.mean(v)) for n, v in self.raw.items()}
        alpha = self.config.alpha
        self.path_rel = {self.tree.root: 1.0, **dict.fromkeys(self.unscored, 0.0)}
        for node_id in sorted(self.s_hat, key=self.tree.depth):  # parents before children
            parent = self.tree.parent(node_id)
            parent_rel = self.path_rel.get(parent, 0.0) if parent is not None else 1.0
            self.path_rel[node_id] = alpha * parent_rel + (1.0 - alpha) * self.s_hat[node_id]
        for record in new_records:
            record.latent_scores = [self.s_hat.get(n) for n in record.node_ids]

    def finish(self) -> SearchResult:
        leaves = [n for n in self.path_rel if self.tree.nodes[n].leaf]
        leaves.sort(key=self.rank_key)
        self.result.ranking = [(n, self.path_rel[n]) for n in leaves[: self.config.top_k]]
        self.problems["unscored_candidates"] = len(self.unscored)
        self.result.problems = dict(self.problems)
        return self.result


def check_reach(tree: Tree, iterations: int, key: str, what: str = "this tree") -> float:
    """Refuse a search that cannot score a leaf, naming the config ``key``: each iteration expands one level below the
    nodes it takes, so with fewer iterations than the shallowest leaf's depth every query ends with no leaf at all
    (and its answer, trace or ranking is made from nothing). Returns the share of leaves within reach, and warns when
    some lie deeper than ``iterations`` (a bottom-up tree's leaves sit at several depths: those never rank). ``what``
    names the tree in the messages (a document scope's cut of it)."""
    depths = [tree.depth(leaf.id) for leaf in tree.leaves()]
    shallowest, deepest = min(depths), max(depths)
    if iterations < shallowest:
        raise ConfigError(f"{key}={iterations} cannot reach a leaf of {what} (its shallowest leaf is at depth "
                          f"{shallowest}); set {key}={shallowest} or more")
    reach = sum(depth <= iterations for depth in depths) / len(depths)
    if reach < 1:
        logger.warning("%s=%d reaches %.0f%% of %s's leaves (depths %d to %d): the others can never be "
                       "retrieved; set %s=%d to reach them all", key, iterations, 100 * reach, what, shallowest,
                       deepest, key, deepest)
    return reach


def search(tree: Tree, queries: Sequence[tuple[str, str]], scorer: SlateScorer,
           config: SearchConfig = SearchConfig(),
           on_iteration: Callable[[str, list[SlateRecord]], None] | None = None,
           progress: Callable[[int], None] | None = None) -> list[SearchResult]:
    """Search ``tree`` for every ``(query_id, query)``; returns one ``SearchResult`` per query, in order.

    All queries advance together: iteration i's slates of every query go to ``scorer.score`` in one batch,
    so a batching server sees them concurrently. ``on_iteration(query_id, records)`` sees each query's
    slates of an iteration after the refit (the traversal traces use it); ``progress(i)`` is called after
    iteration ``i``.
    """
    if len({q for q, _ in queries}) != len(queries):
        raise ValueError("query ids must be unique")
    states = [_QueryState(query_id, query, tree, config) for query_id, query in queries]
    wall_start = time.perf_counter()
    for iteration in range(config.iterations):
        batch: list[tuple[_QueryState, int, str, Slate, list[str]]] = []
        for state in states:
            for index, node_id in enumerate(state.frontier()):
                slate, calibration = state.slate_for(node_id)
                batch.append((state, index, node_id, slate, calibration))
        if not batch:
            break
        scores = scorer.score([slate for _, _, _, slate, _ in batch])
        new_records: dict[str, list[SlateRecord]] = {}
        for (state, index, node_id, slate, calibration), score in zip(batch, scores, strict=True):
            record = state.record(iteration, index, node_id, slate, calibration, score)
            new_records.setdefault(state.query_id, []).append(record)
        for state in states:
            if state.query_id in new_records:
                state.refit(new_records[state.query_id])
                if on_iteration is not None:
                    on_iteration(state.query_id, new_records[state.query_id])
        if progress is not None:
            progress(iteration)
    seconds_per_query = (time.perf_counter() - wall_start) / max(len(states), 1)
    results = [state.finish() for state in states]
    for result in results:
        result.seconds = seconds_per_query
    return results
