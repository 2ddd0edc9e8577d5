"""Top-down tree construction (the LATTICE paper's Algorithm 3): recursive LLM clustering of keyword summaries.

A node with more than M leaves below it is split: SelectSummaryLevel picks the most abstract summary
level (``keywords``) whose number of distinct summaries exceeds M and whose prompt fits the cluster
model's token budget; the ``generator`` receives those distinct summaries with their counts and returns
between M_min and M clusters (``{"clusters": [{"name", "description", "keywords"}]}``); every leaf follows
its summary into a cluster, and each cluster is split again until no node has more than M children.

Every input is placed, by these rules (each counted in ``stats``):

* a summary listed in one cluster goes there; listed in several, it goes to the one holding the fewest
  leaves so far (ties: the first listed), which keeps clusters balanced;
* a summary the reply left out goes to the cluster whose "name: description" embedding is nearest;
  summaries the reply invented are ignored;
* when no level qualifies, no reply is usable after ``max_attempts``, or a reply would not split the node
  (one non-empty cluster), the node's leaves are split by k-means on their text embeddings into M groups
  (an even split when the embeddings cannot be told apart), so the recursion always makes progress.

M_min defaults to ceil(M / 2): fewer clusters than that makes the tree deeper than it needs to be
(each extra level costs the search another scorer call per query), and the paper's balanced clusters
fill most of M anyway.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from sklearn.cluster import KMeans

from overstory.models.json_reply import json_objects, loads_tolerant
from overstory.retrieval.lattice.tree import Node, Tree
from overstory.serving.client import Client, ClientError

EmbedFn = Callable[[list[str]], np.ndarray]

CLUSTER_PROMPT = """Group the following topic summaries into between {m_min} and {m_max} clusters of \
similar size. Each line is a summary with the number of passages it describes in brackets.

{summaries}

Reply with one JSON object: {{"clusters": [{{"name": short cluster name, "description": one sentence \
describing the cluster, "keywords": [the summaries of this cluster, copied exactly]}}, ...]}}. Put every \
summary in exactly one cluster."""

def cluster_response_format(m_min: int, m_max: int, summaries: list[str]) -> dict:
    """The reply schema for one split: ``m_min`` to ``m_max`` clusters, each listing summaries from the input
    (an enum, so a constrained decoder copies them exactly rather than paraphrasing)."""
    cluster = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 60},
                       "description": {"type": "string", "maxLength": 120},
                       "keywords": {"type": "array", "items": {"enum": summaries}, "minItems": 1}},
        "required": ["name", "description", "keywords"],
    }
    schema = {"type": "object", "required": ["clusters"],
              "properties": {"clusters": {"type": "array", "items": cluster, "minItems": m_min, "maxItems": m_max}}}
    return {"type": "json_schema", "json_schema": {"name": "clusters", "schema": schema}}


def estimate_tokens(text: str) -> int:
    """A tokenizer-free estimate (4/3 tokens per word, typical of BPE on English) for the prompt budget."""
    return math.ceil(len(text.split()) * 4 / 3)


@dataclass
class BuildStats:
    """What a construction spent and how its inputs were placed."""

    llm_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    embed_calls: int = 0
    seconds: float = 0.0
    placements: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"llm_calls": self.llm_calls, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "embed_calls": self.embed_calls,
                "seconds": round(self.seconds, 2), "placements": dict(self.placements)}


@dataclass(frozen=True)
class Cluster:
    name: str
    description: str
    members: list[str]  # leaf ids


def select_summary_level(leaf_ids: Sequence[str], keywords: dict[str, list[str]], m_max: int,
                         token_budget: int) -> int | None:
    """The most abstract level with more than ``m_max`` distinct summaries whose prompt fits ``token_budget``.

    >>> kw = {str(i): [f"a{i % 2}", f"b{i % 12}", f"c{i}", "d", "e"] for i in range(30)}
    >>> select_summary_level(list(kw), kw, m_max=10, token_budget=10_000)
    1
    """
    for level in range(len(next(iter(keywords.values())))):
        distinct = Counter(keywords[i][level] for i in leaf_ids)
        if len(distinct) > m_max and estimate_tokens(summary_lines(distinct)) <= token_budget:
            return level
    return None


def summary_lines(distinct: Counter) -> str:
    return "\n".join(f"- {summary} [{count}]" for summary, count in distinct.most_common())


def _norm(text: str) -> str:
    return " ".join(str(text).lower().split())


class TopDownBuilder:
    """Builds a tree over leaves with keyword summaries; ``client`` serves the cluster model (``role``)."""

    def __init__(self, client: Client, embed: EmbedFn, m_max: int = 10, m_min: int | None = None,
                 role: str = "generator", token_budget: int = 3000, max_attempts: int = 2, max_tokens: int = 1536,
                 seed: int = 0, id_prefix: str = "t"):
        self.m_min = m_min if m_min is not None else math.ceil(m_max / 2)
        if not 2 <= self.m_min <= m_max:
            raise ValueError(f"need 2 <= m_min <= m_max, got m_min={self.m_min}, m_max={m_max}")
        self.client, self.embed, self.m_max, self.role = client, embed, m_max, role
        self.token_budget, self.max_attempts, self.max_tokens, self.seed = token_budget, max_attempts, max_tokens, seed
        self.stats = BuildStats()
        self.id_prefix, self._next_id = id_prefix, 0

    def build(self, leaves: Sequence[Node], keywords: dict[str, list[str]]) -> Tree:
        if not leaves:
            raise ValueError("cannot build a tree over an empty corpus")
        started = time.perf_counter()
        self.nodes: dict[str, Node] = {leaf.id: leaf for leaf in leaves}
        self.keywords = keywords
        self._texts = {leaf.id: leaf.text for leaf in leaves}
        root = self._make_node([leaf.id for leaf in leaves], "root", "the whole corpus")
        self.stats.seconds += time.perf_counter() - started
        return Tree(root=root, nodes=self.nodes, meta={"method": "top-down", "m_max": self.m_max,
                                                       "m_min": self.m_min, "cost": self.stats.as_dict()})

    def _new_id(self) -> str:
        self._next_id += 1
        return f"{self.id_prefix}{self._next_id}"

    def _make_node(self, leaf_ids: list[str], name: str, description: str) -> str:
        node = Node(id=self._new_id(), name=name, description=description)
        self.nodes[node.id] = node
        if len(leaf_ids) <= self.m_max:
            node.children = list(leaf_ids)
            return node.id
        for cluster in self._split(leaf_ids):
            if len(cluster.members) == 1:
                node.children.append(cluster.members[0])  # no single-child internal nodes
            else:
                node.children.append(self._make_node(cluster.members, cluster.name, cluster.description))
        return node.id

    # --- one split --------------------------------------------------------------------------------
    def _split(self, leaf_ids: list[str]) -> list[Cluster]:
        level = select_summary_level(leaf_ids, self.keywords, self.m_max, self.token_budget)
        if level is None:
            self.stats.placements["no_level_kmeans"] += len(leaf_ids)
            return self._kmeans(leaf_ids)
        distinct = Counter(self.keywords[i][level] for i in leaf_ids)
        clusters = self._ask_llm(distinct)
        if clusters is None:
            self.stats.placements["no_reply_kmeans"] += len(leaf_ids)
            return self._kmeans(leaf_ids)
        assignment = self._place(distinct, clusters)
        groups: list[Cluster] = []
        for index, (name, description, _) in enumerate(clusters):
            members = [i for i in leaf_ids if assignment[self.keywords[i][level]] == index]
            if members:
                groups.append(Cluster(name, description, members))
        if len(groups) < 2:
            self.stats.placements["no_split_kmeans"] += len(leaf_ids)
            return self._kmeans(leaf_ids)
        return groups

    def _ask_llm(self, distinct: Counter) -> list[tuple[str, str, set[str]]] | None:
        """(name, description, the normalised summaries it lists) per cluster, from the first usable reply
        (at most M clusters are kept)."""
        prompt = CLUSTER_PROMPT.format(m_min=self.m_min, m_max=self.m_max, summaries=summary_lines(distinct))
        fmt = cluster_response_format(self.m_min, self.m_max, list(distinct))
        for _ in range(self.max_attempts):
            self.stats.llm_calls += 1
            try:
                reply = self.client.chat(self.role, [{"role": "user", "content": prompt}], max_tokens=self.max_tokens,
                                         temperature=0.0, response_format=fmt)
            except ClientError:
                continue
            self.stats.prompt_tokens += reply.usage.get("prompt_tokens", 0)
            self.stats.completion_tokens += reply.usage.get("completion_tokens", 0)
            parsed = _parse_clusters(reply.text)
            if len(parsed) >= 2:
                return [(name, description, set(map(_norm, listed))) for name, description, listed
                        in parsed[: self.m_max]]
        return None

    def _place(self, distinct: Counter, clusters: list[tuple[str, str, set[str]]]) -> dict[str, int]:
        """Distinct summary -> cluster index, by the module's rules; every summary gets one."""
        inputs = {_norm(s) for s in distinct}
        listed_by_cluster = [listed for _, _, listed in clusters]
        self.stats.placements["invented_ignored"] += sum(len(listed - inputs) for listed in listed_by_cluster)
        sizes = [0] * len(clusters)
        assignment: dict[str, int] = {}
        unplaced: list[str] = []
        for summary, count in distinct.most_common():
            homes = [i for i, listed in enumerate(listed_by_cluster) if _norm(summary) in listed]
            if not homes:
                unplaced.append(summary)
                continue
            best = min(homes, key=lambda i: (sizes[i], homes.index(i)))
            self.stats.placements["llm" if len(homes) == 1 else "llm_duplicate_balanced"] += count
            assignment[summary] = best
            sizes[best] += count
        if unplaced:
            self.stats.embed_calls += 1
            vectors = unit_rows(self.embed(unplaced + [f"{n}: {d}" for n, d, _ in clusters]))
            similarity = vectors[: len(unplaced)] @ vectors[len(unplaced):].T
            for summary, row in zip(unplaced, similarity, strict=True):
                assignment[summary] = int(np.argmax(row))
                self.stats.placements["dropped_by_llm_embedded"] += distinct[summary]
        return assignment

    def _kmeans(self, leaf_ids: list[str]) -> list[Cluster]:
        """M groups by k-means on the leaves' text embeddings; an even split if k-means finds one group."""
        self.stats.embed_calls += 1
        vectors = unit_rows(self.embed([self._texts[i] for i in leaf_ids]))
        k = min(self.m_max, len(leaf_ids))
        labels = KMeans(n_clusters=k, n_init=3, random_state=self.seed).fit_predict(vectors)
        if len(set(labels.tolist())) < 2:
            labels = np.arange(len(leaf_ids)) * k // len(leaf_ids)
        groups = []
        for label in sorted(set(labels.tolist())):
            members = [i for i, lab in zip(leaf_ids, labels, strict=True) if lab == label]
            common = Counter(self.keywords[i][0] for i in members if i in self.keywords).most_common(3)
            name = common[0][0] if common else f"group {label}"
            groups.append(Cluster(name, "; ".join(s for s, _ in common) or name, members))
        return groups


def _parse_clusters(text: str) -> list[tuple[str, str, list[str]]]:
    """(name, description, listed summaries) per cluster of the last reply object with ``clusters``.

    >>> _parse_clusters('{"clusters": [{"name": "A", "description": "x", "keywords": ["k1"]}, {"name": ""}]}')
    [('A', 'x', ['k1'])]
    """
    reply = next((obj for obj in map(loads_tolerant, reversed(json_objects(text)))
                  if obj is not None and isinstance(obj.get("clusters"), list)), None)
    out = []
    for entry in reply["clusters"] if reply else []:
        if not isinstance(entry, dict) or not str(entry.get("name", "")).strip():
            continue
        listed = entry.get("keywords")
        out.append((str(entry["name"]).strip(), str(entry.get("description", "")).strip(),
                    [str(k) for k in listed] if isinstance(listed, list) else []))
    return out


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (zero rows stay zero): embeddings for cosine similarity and k-means."""
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
