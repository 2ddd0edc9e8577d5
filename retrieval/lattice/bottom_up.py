"""Bottom-up and hybrid tree construction (the LATTICE paper's bottom-up variant, its Figure 13 prompt).

Bottom-up: the leaves are embedded and grouped into clusters of at most M (k-means with ceil(n / g) centres, where
g <= M is the group size that lets the layers above branch evenly, ``layer_group_size``; a cluster still larger
than g is split again the same way, and evenly when k-means cannot separate it); the
``generator`` summarises each cluster from its members' texts into ``{"detailed_fingerprints": [...],
"common_theme": ..., "summary": ...}``, which becomes the new internal node's name (the theme) and description
(the summary; the fingerprints are kept as its keywords). The new layer's "name: description" texts are embedded
and clustered the same way, until at most M nodes remain under the root. A cluster of one member is not wrapped
(no single-child internal nodes): the member moves up a layer unchanged.

Hybrid: a corpus with a natural hierarchy keeps it. Each document's chunk hierarchy (``data_pipeline.hierarchy``:
document > section > subsection > paragraph) becomes a subtree whose leaves are its ``leaf_level`` chunks; a chunk
with one child is collapsed into it (a HotpotQA paragraph is its own section and document), a chunk with more
than M children gets k-means groups under it, and every internal node is summarised bottom-up from its children
(a section's summary reads its subsections' summaries); a document node is named by its title. The
documents' roots are then organised bottom-up as above.

A summary reply that is unusable after ``max_attempts`` falls back to the members' first words (counted in the
stats with the raw reply's length, never silently): the tree is always built.

Resuming: a build takes a ``SummaryJournal``. Each summary the model writes is handed to it as it is made (the reply
and what was made of it, under the group's ``group_key``: its members and the prompt that shows them), and a
summary recorded by an earlier run for the same key is reused instead of asked for again. The clustering is
deterministic (seeded k-means over the same embeddings), so a killed build rerun over the same corpus forms the same
groups, reuses what it recorded and asks only for the rest; a changed group (other members, or a member whose own
summary changed) has another key and is asked. Fallbacks are handed to the journal as failures and never reused.

Where the summaries are asked for: each group is one pure call (``summarise_group``: the client in, the summary, its
journal record or failure and its counts out), and a build takes a map (``GroupMap``) that runs a layer's calls:
``in_order(client)`` one after another, or the tree job's fan-out on local threads or Ray workers. The outcomes come
back to the build's thread, which alone writes the journal and the stats.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import numpy as np
from sklearn.cluster import KMeans

from overstory.core.records import LEVELS, Chunk
from overstory.models.json_reply import json_objects, loads_tolerant
from overstory.retrieval.lattice.insert import leaf_node
from overstory.retrieval.lattice.top_down import BuildStats, unit_rows
from overstory.retrieval.lattice.tree import Node, Tree
from overstory.retrieval.strategy import raise_if_refused
from overstory.serving.client import Client, ClientError

EmbedFn = Callable[[list[str]], np.ndarray]
Group = tuple[list[str], list[str]]  # a group to summarise: its members' keys (see group_key) and texts, in order

SUMMARY_PROMPT = """The passages below were grouped together because they are about related things.

{members}

Describe the group so that someone searching for any one of these passages would recognise it. Reply with one \
JSON object: {{"detailed_fingerprints": [a few distinctive names, facts or phrases, one per passage], \
"common_theme": what the passages share, in at most 8 words, "summary": one or two sentences covering all of \
them}}."""


def summary_response_format(n_members: int, max_theme_chars: int = 80, max_summary_chars: int = 300) -> dict:
    """The reply schema for one group: a fingerprint per member at most, a short theme and a short summary (a
    small model otherwise writes until its token limit)."""
    schema = {
        "type": "object",
        "properties": {
            "detailed_fingerprints": {"type": "array", "items": {"type": "string", "maxLength": 80},
                                      "maxItems": max(n_members, 1)},
            "common_theme": {"type": "string", "minLength": 1, "maxLength": max_theme_chars},
            "summary": {"type": "string", "minLength": 1, "maxLength": max_summary_chars},
        },
        "required": ["detailed_fingerprints", "common_theme", "summary"],
    }
    return {"type": "json_schema", "json_schema": {"name": "group_summary", "schema": schema}}


def parse_summary(text: str) -> tuple[str, str, list[str]] | None:
    """(theme, summary, fingerprints) from the last reply object with a non-empty theme and summary, else None.

    >>> parse_summary('{"detailed_fingerprints": ["a"], "common_theme": " Rivers ", "summary": "Two rivers."}')
    ('Rivers', 'Two rivers.', ['a'])
    >>> parse_summary('{"common_theme": "", "summary": "x"}') is None
    True
    """
    for obj in map(loads_tolerant, reversed(json_objects(text))):
        if obj is None:
            continue
        theme, summary = str(obj.get("common_theme", "")).strip(), str(obj.get("summary", "")).strip()
        if theme and summary:
            prints = obj.get("detailed_fingerprints")
            return theme, summary, [str(p) for p in prints] if isinstance(prints, list) else []
    return None


def balanced_groups(vectors: np.ndarray, m_max: int, seed: int = 0) -> list[list[int]]:
    """Indices of ``vectors`` in groups of at most ``m_max``: k-means with ceil(n / m_max) centres, an oversized
    group split again, an even split where k-means finds a single group.

    >>> groups = balanced_groups(np.eye(7, dtype=np.float32), m_max=3)
    >>> sorted(len(g) for g in groups)[-1] <= 3, sorted(i for g in groups for i in g) == list(range(7))
    (True, True)
    """
    n = len(vectors)
    if n <= m_max:
        return [list(range(n))]
    k = math.ceil(n / m_max)
    labels = KMeans(n_clusters=k, n_init=3, random_state=seed).fit_predict(vectors)
    if len(set(labels.tolist())) < 2:
        labels = np.arange(n) * k // n
    groups: list[list[int]] = []
    for label in sorted(set(labels.tolist())):
        members = [i for i in range(n) if labels[i] == label]
        if len(members) > m_max:
            groups.extend([members[j] for j in sub] for sub in balanced_groups(vectors[members], m_max, seed))
        else:
            groups.append(members)
    return groups


def layer_group_size(n: int, m_max: int) -> int:
    """Members per group when ``n`` nodes are clustered into the next layer: the L-th root of ``n``, where L is the
    number of layers of at most ``m_max`` children that ``n`` nodes need, so every layer above branches about
    evenly. Grouping by ``m_max`` alone fills the lower layers and leaves the top with what is over: 11 nodes under
    M = 10 became one group of 10 and a stray, a root of two children, one of them nearly the whole corpus.

    >>> layer_group_size(400, 10), layer_group_size(50, 10), layer_group_size(11, 10), layer_group_size(5, 10)
    (8, 8, 4, 5)
    """
    layers, capacity = 0, 1
    while capacity < n:
        layers, capacity = layers + 1, capacity * m_max
    if layers <= 1:
        return max(n, 1)
    size = math.ceil(n ** (1 / layers) - 1e-9)  # the tolerance keeps an exact power (n = 100, L = 2) at its root
    return min(m_max, max(2, size))


class GroupSummary(NamedTuple):
    """One group's summary: its record key (``group_key``), theme, description and fingerprints."""

    key: str
    theme: str
    summary: str
    fingerprints: list[str]


def group_key(member_keys: Sequence[str], prompt: str) -> str:
    """The record key of a group's summary: a hash of its members (a leaf by its id, an internal node by its own
    key, in prompt order) and of the prompt that shows their texts, so a recorded summary is reused only for the
    same members read the same way.

    >>> group_key(["a", "b"], "p") == group_key(["a", "b"], "p") != group_key(["b", "a"], "p")
    True
    """
    return "g" + hashlib.sha256(json.dumps([list(member_keys), prompt]).encode()).hexdigest()[:32]


def _ignore(*_: object) -> None:
    """A journal hook that keeps nothing (a build without a record)."""


@dataclass
class SummaryJournal:
    """Where a build's node summaries are recorded as they are made, and those recorded by earlier runs.

    ``recorded``: key -> a record that ``write`` received before (``theme``, ``summary``, ``fingerprints``): reused
    for the same key instead of asking again. ``write(record)``: a summary the model wrote this run (``id`` the key,
    ``members``, the parsed fields, the raw ``reply``, ``attempts``). ``fail(key, error, raw, attempts)``: a group
    named by the fallback (never reused: a rerun asks again). The hooks are called on the build's thread alone."""

    recorded: Mapping[str, dict] = field(default_factory=dict)
    write: Callable[[dict], None] = _ignore
    fail: Callable[[str, str, str, int], None] = _ignore


class GroupRequest(NamedTuple):
    """One group to ask a summary for: its record key (``group_key``), its members' keys, the prompt that shows
    them, and their texts (the reply schema's size and the fallback's words)."""

    key: str
    member_keys: list[str]
    prompt: str
    texts: list[str]


class GroupOutcome(NamedTuple):
    """What asking for one group made: the summary; the journal's record of it (the model wrote it) or the failure
    (``SummaryJournal.fail``'s arguments: it fell back); what it spent and how it ended, as ``BuildStats`` counts
    (``llm_calls``, tokens, one of ``summaries_llm``, ``summaries_fallback`` or ``summaries_failed``)."""

    summary: GroupSummary
    record: dict | None
    failure: tuple[str, str, str, int] | None
    counts: dict[str, int]


SummaryCall = Callable[[Client, GroupRequest], GroupOutcome]
# map(call, requests, handle): call(client, request) for every request, through clients of the map's choosing (the
# job's, a thread's, a Ray worker's), each outcome handed to handle(request, outcome) on the caller's thread as it
# comes; an exception other than a request's own failure (RequestRefused, a killed job) stops the map
GroupMap = Callable[[SummaryCall, Sequence[GroupRequest], Callable[[GroupRequest, GroupOutcome], None]], None]


def in_order(client: Client) -> GroupMap:
    """The map that asks for the groups one after another through ``client`` (a build without a fan-out)."""

    def map_groups(call: SummaryCall, requests: Sequence[GroupRequest],
                   handle: Callable[[GroupRequest, GroupOutcome], None]) -> None:
        for request in requests:
            handle(request, call(client, request))
    return map_groups


def summarise_group(client: Client, request: GroupRequest, role: str = "generator", max_tokens: int = 256,
                    max_attempts: int = 2) -> GroupOutcome:
    """Ask ``role`` for one group's summary, up to ``max_attempts`` times; touches nothing but ``client``, so it runs
    wherever the map puts it. A refused request (a 4xx: a wrong role, a bad request) raises ``RequestRefused``; a group
    whose every attempt failed in transit is named from its members' heads and counted as ``summaries_failed`` (the
    job fails past its ``max_failure_share``), one whose replies never parsed is named the same way and counted as
    ``summaries_fallback`` (a repair); both come back with a failure for the journal."""
    messages = [{"role": "user", "content": request.prompt}]
    counts: Counter[str] = Counter()
    raw, answered = "", False
    for attempt in range(1, max_attempts + 1):
        counts["llm_calls"] += 1
        try:
            reply = client.chat(role, messages, max_tokens=max_tokens, temperature=0.0,
                                response_format=summary_response_format(len(request.texts)))
        except ClientError as exc:
            raise_if_refused(exc, f"the {role} role's node summary")
            raw = f"<request failed: {exc}>"
            continue
        answered = True
        counts["prompt_tokens"] += reply.usage.get("prompt_tokens", 0)
        counts["completion_tokens"] += reply.usage.get("completion_tokens", 0)
        raw = reply.text
        parsed = parse_summary(reply.text)
        if parsed is not None:
            counts["summaries_llm"] += 1
            summary = GroupSummary(request.key, *parsed)
            record = {"id": request.key, "members": list(request.member_keys), "theme": summary.theme,
                      "summary": summary.summary, "fingerprints": summary.fingerprints, "reply": raw,
                      "attempts": attempt}
            return GroupOutcome(summary, record, None, dict(counts))
    counts.update({"summaries_fallback": 1, "fallback_raw_chars": len(raw)} if answered else {"summaries_failed": 1})
    heads = [" ".join(t.split()[:4]) for t in request.texts[:3]]
    failure = (request.key, "no reply held a usable summary" if answered else "every request failed", raw,
               max_attempts)
    return GroupOutcome(GroupSummary(request.key, heads[0], "; ".join(heads), []), None, failure, dict(counts))


class GroupSummariser:
    """Names and describes groups: reuses the summaries ``journal`` recorded, asks for the others through
    ``map_groups`` (one ``summarise_group`` call each, wherever the map runs it), and, on the caller's thread alone,
    records what came back in the journal and counts it in ``stats``."""

    def __init__(self, stats: BuildStats, map_groups: GroupMap, role: str = "generator", max_tokens: int = 256,
                 max_attempts: int = 2, max_member_chars: int = 300, journal: SummaryJournal | None = None):
        self.stats, self.map_groups = stats, map_groups
        self.journal = journal or SummaryJournal()
        self.call: SummaryCall = partial(summarise_group, role=role, max_tokens=max_tokens,
                                         max_attempts=max_attempts)
        self.max_member_chars = max_member_chars

    def summarise(self, groups: Sequence[Group]) -> list[GroupSummary]:
        """A summary per group (its members' keys and texts), in order."""
        requests = [self.request(group) for group in groups]
        summaries: dict[str, GroupSummary] = {}
        for request in requests:
            recorded = self.journal.recorded.get(request.key)
            if recorded is not None:
                self._count({"summaries_reused": 1})
                summaries[request.key] = GroupSummary(request.key, recorded["theme"], recorded["summary"],
                                                      list(recorded["fingerprints"]))
        asked = [request for request in requests if request.key not in summaries]

        def handle(request: GroupRequest, outcome: GroupOutcome) -> None:
            self._count({"summaries_asked": 1, **outcome.counts})
            if outcome.record is not None:
                self.journal.write(outcome.record)
            if outcome.failure is not None:
                self.journal.fail(*outcome.failure)
            summaries[request.key] = outcome.summary

        if asked:
            self.map_groups(self.call, asked, handle)
        return [summaries[request.key] for request in requests]

    def request(self, group: Group) -> GroupRequest:
        """What is asked for a group: its members' texts cut to ``max_member_chars`` in the prompt, and its key."""
        member_keys, texts = group
        members = "\n".join(f"[{i}] {' '.join(t.split())[: self.max_member_chars]}" for i, t in enumerate(texts))
        prompt = SUMMARY_PROMPT.format(members=members)
        return GroupRequest(group_key(member_keys, prompt), list(member_keys), prompt, list(texts))

    def _count(self, amounts: Mapping[str, int]) -> None:
        for key, amount in amounts.items():
            if key in ("llm_calls", "prompt_tokens", "completion_tokens"):
                setattr(self.stats, key, getattr(self.stats, key) + amount)
            else:
                self.stats.placements[key] += amount


class BottomUpBuilder:
    """Builds a tree bottom-up over leaves (``build``) or over documents' natural hierarchies (``build_hybrid``)."""

    def __init__(self, map_groups: GroupMap, embed: EmbedFn, m_max: int = 10, role: str = "generator",
                 max_tokens: int = 256, max_attempts: int = 2, max_member_chars: int = 300, seed: int = 0,
                 id_prefix: str = "b", journal: SummaryJournal | None = None):
        """``map_groups``: where each layer's node summaries are asked for (``in_order(client)``, or the tree job's
        fan-out); ``journal``: where they are recorded and found again (none: asked for, kept nowhere)."""
        if m_max < 2:
            raise ValueError(f"m_max must be >= 2, got {m_max}")
        self.embed, self.m_max, self.seed, self.id_prefix = embed, m_max, seed, id_prefix
        self.stats = BuildStats()
        self.summariser = GroupSummariser(self.stats, map_groups, role=role, max_tokens=max_tokens,
                                          max_attempts=max_attempts, max_member_chars=max_member_chars,
                                          journal=journal)
        self._next_id = 0
        self.keys: dict[str, str] = {}  # internal node id -> its summary's key (a leaf's key is its id)

    def build(self, leaves: Sequence[Node]) -> Tree:
        if not leaves:
            raise ValueError("cannot build a tree over an empty corpus")
        started = time.perf_counter()
        self.nodes: dict[str, Node] = {leaf.id: leaf for leaf in leaves}
        root = self._layers([leaf.id for leaf in leaves])
        self.stats.seconds += time.perf_counter() - started
        return Tree(root=root, nodes=self.nodes, meta={"method": "bottom-up", "m_max": self.m_max,
                                                       "cost": self.stats.as_dict()})

    def build_hybrid(self, chunks: Sequence[Chunk], leaf_level: str) -> Tree:
        """A tree whose lower part is each document's own hierarchy (``chunks``: every level of every document,
        as ``build_hierarchies`` returns them) down to ``leaf_level``, organised bottom-up above the documents."""
        started = time.perf_counter()
        self.nodes = {}
        for chunk in chunks:
            if chunk.level == leaf_level:
                self.nodes[chunk.id] = leaf_node(chunk)
        if not self.nodes:
            raise ValueError(f"no {leaf_level} chunks to build a tree over")
        standing_for = self._natural(chunks, leaf_level)
        documents = [standing_for.get(c.id) for c in chunks if c.parent is None]
        root = self._layers([d for d in documents if d is not None])
        self.stats.seconds += time.perf_counter() - started
        return Tree(root=root, nodes=self.nodes, meta={"method": "hybrid", "m_max": self.m_max,
                                                       "leaf_level": leaf_level, "cost": self.stats.as_dict()})

    # --- internals ----------------------------------------------------------------------------------
    def _new_id(self) -> str:
        self._next_id += 1
        return f"{self.id_prefix}{self._next_id}"

    def _group(self, members: Sequence[str]) -> Group:
        """What the summariser reads of a group of node ids: their keys and texts."""
        return [self.keys.get(n, n) for n in members], [self.nodes[n].display_text for n in members]

    def _add(self, summary: GroupSummary, children: list[str], name: str, doc_id: str = "") -> str:
        """A new internal node over ``children`` described by ``summary`` (named ``name``); returns its id."""
        node = Node(id=self._new_id(), name=name, description=summary.summary, children=children,
                    keywords=summary.fingerprints, doc_id=doc_id)
        self.nodes[node.id] = node
        self.keys[node.id] = summary.key
        return node.id

    def _layers(self, layer: list[str]) -> str:
        """Cluster and summarise ``layer`` until at most M nodes remain; returns the root's id."""
        while len(layer) > self.m_max:
            layer = self._wrap(self._clusters(layer))
        root = Node(id=self._new_id(), name="root", description="the whole corpus", children=list(layer))
        self.nodes[root.id] = root
        return root.id

    def _clusters(self, layer: list[str]) -> list[list[str]]:
        """``layer``'s node ids grouped for the next layer: k-means on their embedded texts, in groups of
        ``layer_group_size``."""
        self.stats.embed_calls += 1
        vectors = unit_rows(self.embed([self.nodes[n].display_text for n in layer]))
        size = layer_group_size(len(layer), self.m_max)
        return [[layer[i] for i in g] for g in balanced_groups(vectors, size, self.seed)]

    def _wrap(self, groups: list[list[str]]) -> list[str]:
        """One summarised internal node per group of two or more; a single member moves up unchanged."""
        multi = [g for g in groups if len(g) > 1]
        described = iter(self.summariser.summarise([self._group(g) for g in multi]))
        out = []
        for group in groups:
            if len(group) == 1:
                out.append(group[0])
                continue
            summary = next(described)
            out.append(self._add(summary, group, summary.theme))
        return out

    def _natural(self, chunks: Sequence[Chunk], leaf_level: str) -> dict[str, str | None]:
        """Chunk id -> the node standing for that part of its document (a leaf, a collapsed
        chain, or a summarised internal node; None when it holds no leaf). Deepest chunks first, and all the
        internal nodes of one depth are asked for together (one map)."""
        by_id = {c.id: c for c in chunks}
        rank = LEVELS.index(leaf_level)
        depth: dict[str, int] = {}
        for chunk in chunks:
            d, current = 0, chunk
            while current.parent is not None:
                d, current = d + 1, by_id[current.parent]
            depth[chunk.id] = d
        standing_for: dict[str, str | None] = {}
        kept = [c for c in chunks if LEVELS.index(c.level) >= rank]
        for d in sorted({depth[c.id] for c in kept}, reverse=True):
            pending: list[tuple[Chunk, list[str]]] = []
            for chunk in (c for c in kept if depth[c.id] == d):
                if chunk.level == leaf_level:
                    standing_for[chunk.id] = chunk.id
                    continue
                children = [n for n in (standing_for.get(i) for i in chunk.children) if n is not None]
                if len(children) <= 1:  # a chain of one child collapses into it
                    standing_for[chunk.id] = children[0] if children else None
                    continue
                while len(children) > self.m_max:  # too many sections or paragraphs for one node
                    children = self._wrap(self._clusters(children))
                pending.append((chunk, children))
            described = self.summariser.summarise([self._group(children) for _, children in pending])
            for (chunk, children), summary in zip(pending, described, strict=True):
                # chunks carry the document's title
                name = chunk.title if chunk.level == "document" and chunk.title else summary.theme
                standing_for[chunk.id] = self._add(summary, children, name, doc_id=chunk.doc_id)
        return standing_for
