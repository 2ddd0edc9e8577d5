"""Multi-level chunk hierarchies: sentence < paragraph < subsection < section < document.

Structure comes from the source where it exists (HotpotQA sentence splits, SQuAD paragraphs,
markdown headings: the shallowest heading depth makes sections, the next one subsections) and is
otherwise built: paragraphs are blank-line separated blocks, sentences come from pysbd, and
documents without headings get subsections by greedily grouping consecutive paragraphs up to
``subsection_tokens`` and sections by grouping consecutive subsections up to ``section_tokens``
(a single unit over budget forms its own group). Every level exists for every document.

Chunk ids are deterministic: ``<doc_id>#<code><index>`` with codes s, p, ss, sec (the index counts
chunks of that level in text order, from 0) and ``<doc_id>#doc`` for the root, e.g.
``squad/normans#p3``. ``doc.text[c.start:c.end] == c.text`` for every chunk (spans exclude
surrounding whitespace), sentences tile their paragraph, and ``n_tokens`` comes from a real tokenizer
(no special tokens).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from overstory.core.config import ConfigError
from overstory.core.records import LEVELS, Chunk, Document, check_level, read_jsonl, write_jsonl
from overstory.core.text import split_sentences
from overstory.models.registry import SMOLLM2, load_tokenizer

LEVEL_CODES = {"sentence": "s", "paragraph": "p", "subsection": "ss", "section": "sec", "document": "doc"}


@dataclass(frozen=True)
class HierarchyConfig:
    # tokenizer used for token counts and budgets (the generator's, since its context is what chunks fill)
    tokenizer: str = SMOLLM2
    subsection_tokens: int = 256
    section_tokens: int = 1024

    def __post_init__(self) -> None:
        if not self.tokenizer:
            raise ConfigError("hierarchy.tokenizer must name a tokenizer, e.g. " + SMOLLM2)
        if self.subsection_tokens < 1:
            raise ConfigError(f"hierarchy.subsection_tokens must be positive, got {self.subsection_tokens}")
        if self.section_tokens < self.subsection_tokens:
            raise ConfigError(f"hierarchy.section_tokens ({self.section_tokens}) must be at least "
                              f"hierarchy.subsection_tokens ({self.subsection_tokens})")


@dataclass
class _Node:
    """A working node before ids are assigned."""

    level: str
    start: int
    end: int
    children: list[_Node] = field(default_factory=list)
    tokens: int = 0
    lead: int = 0  # tokens of the whitespace (or cut heading lines) between the previous node and this one


def _strip(text: str, start: int, end: int) -> tuple[int, int] | None:
    """Shrink [start, end) to exclude surrounding whitespace; None if nothing is left."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if start < end else None


def _blocks(text: str, start: int, end: int, cuts: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Blank-line separated blocks of text[start:end], with the ``cuts`` (heading lines) removed."""
    pieces, cursor = [], start
    for cut_start, cut_end in cuts:
        if start <= cut_start < end:
            pieces.append((cursor, cut_start))
            cursor = cut_end
    pieces.append((cursor, end))
    spans = []
    for piece_start, piece_end in pieces:
        for match in re.finditer(r"(?:.*\S.*(?:\n|$))+", text[piece_start:piece_end]):
            span = _strip(text, piece_start + match.start(), piece_start + match.end())
            if span:
                spans.append(span)
    return spans


def _sentences(doc: Document, paragraph: tuple[int, int]) -> list[tuple[int, int]]:
    start, end = paragraph
    given = doc.metadata.get("sentence_spans")
    if given:
        raw = [(max(s, start), min(e, end)) for s, e in given if s < end and e > start]
    else:
        raw = split_sentences(doc.text, start, end)
    spans = [span for s, e in raw if (span := _strip(doc.text, s, e))]
    return spans or [paragraph]


def _group(nodes: list[_Node], level: str, budget: int) -> list[_Node]:
    """Greedy grouping of consecutive nodes while the group's tokens (children plus the gaps between
    them) stay within ``budget``; a node over budget on its own forms its own group."""
    groups: list[_Node] = []
    for node in nodes:
        if groups and groups[-1].tokens + node.lead + node.tokens <= budget:
            groups[-1].children.append(node)
            groups[-1].end = node.end
            groups[-1].tokens += node.lead + node.tokens
        else:
            groups.append(_Node(level, node.start, node.end, [node], node.tokens, node.lead))
    return groups


def _wrap(level: str, children: list[_Node], start: int | None = None) -> _Node:
    return _Node(level, children[0].start if start is None else start, children[-1].end, children)


def _sections_from_headings(paragraphs: list[_Node], headings: list[list], cfg: HierarchyConfig) -> list[_Node]:
    """Sections at the shallowest heading depth, subsections at the next; paragraphs of a section
    without subheadings are grouped by the subsection budget."""
    top = min(h[0] for h in headings)
    section_heads = [h for h in headings if h[0] == top]
    sub_heads = [h for h in headings if h[0] == top + 1]

    def owner(heads: list[list], position: int, lower: int) -> int | None:
        best = None
        for h in heads:
            if lower <= h[2] <= position:
                best = h[2]
        return best

    by_section: dict[int | None, list[_Node]] = {}
    for para in paragraphs:
        by_section.setdefault(owner(section_heads, para.start, 0), []).append(para)
    sections = []
    for section_start, paras in by_section.items():
        lower = section_start or 0
        by_sub: dict[int | None, list[_Node]] = {}
        for para in paras:
            by_sub.setdefault(owner(sub_heads, para.start, lower), []).append(para)
        if list(by_sub) == [None]:
            subsections = _group(paras, "subsection", cfg.subsection_tokens)
        else:
            subsections = [_wrap("subsection", ps, start) for start, ps in by_sub.items()]
        sections.append(_wrap("section", subsections, section_start))
    return sections


def build_hierarchy(doc: Document, tokenizer, cfg: HierarchyConfig) -> list[Chunk]:
    """All chunks of one document, top-down (document, sections, ..., sentences), in text order."""
    if not doc.text.strip():
        raise ValueError(f"document {doc.id!r} has empty text")
    text = doc.text
    headings = doc.metadata.get("headings") or []
    if "paragraph_spans" in doc.metadata:
        para_spans = [span for s, e in doc.metadata["paragraph_spans"] if (span := _strip(text, s, e))]
    else:
        para_spans = _blocks(text, 0, len(text), [(h[2], h[3]) for h in headings])
    if not para_spans:  # nothing but headings: the whole text is one paragraph
        para_spans, headings = [_strip(text, 0, len(text))], []
    paragraphs = [_Node("paragraph", s, e, [_Node("sentence", a, b) for a, b in _sentences(doc, (s, e))])
                  for s, e in para_spans]
    count = _token_counter(tokenizer)
    _count_paragraph_tokens(text, paragraphs, count)

    if headings:
        sections = _sections_from_headings(paragraphs, headings, cfg)
    else:
        sections = _group(_group(paragraphs, "subsection", cfg.subsection_tokens), "section", cfg.section_tokens)
    root = _wrap("document", sections)

    by_level: dict[str, list[_Node]] = {level: [] for level in LEVELS}
    stack = [root]
    while stack:  # pre-order walk, children in text order
        node = stack.pop()
        by_level[node.level].append(node)
        stack.extend(reversed(node.children))
    ids = {}
    for level, nodes in by_level.items():
        for i, node in enumerate(nodes):
            ids[id(node)] = f"{doc.id}#doc" if level == "document" else f"{doc.id}#{LEVEL_CODES[level]}{i}"
    parents = {id(child): ids[id(node)] for nodes in by_level.values() for node in nodes for child in node.children}
    ordered = [node for level in reversed(LEVELS) for node in by_level[level]]
    uncounted = [n for n in ordered if n.level != "paragraph"]
    for node, n_tokens in zip(uncounted, count([text[n.start:n.end] for n in uncounted])):
        node.tokens = n_tokens
    return [
        Chunk(id=ids[id(n)], doc_id=doc.id, level=n.level, text=text[n.start:n.end], parent=parents.get(id(n)),
              children=[ids[id(c)] for c in n.children], start=n.start, end=n.end, n_tokens=n.tokens,
              title=doc.title)
        for n in ordered
    ]


def _count_paragraph_tokens(text: str, paragraphs: list[_Node], count: Callable[[list[str]], list[int]]) -> None:
    """Set ``tokens`` and ``lead`` of each paragraph, so grouping can predict a group's token count.
    A gap is counted together with the next paragraph's first character, minus that character:
    byte-level BPE makes "\\n\\n" one token alone but two in front of a word."""
    for para, n in zip(paragraphs, count([text[p.start:p.end] for p in paragraphs])):
        para.tokens = n
    pairs = list(zip(paragraphs, paragraphs[1:]))
    with_gap = count([text[a.end:b.start + 1] for a, b in pairs])
    first_char = count([text[b.start] for _, b in pairs])
    for (_, b), n_gap, n_char in zip(pairs, with_gap, first_char):
        b.lead = n_gap - n_char


def _token_counter(tokenizer) -> Callable[[list[str]], list[int]]:
    def count(texts: list[str]) -> list[int]:
        if not texts:
            return []
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]

    return count


@functools.lru_cache(maxsize=4)
def cached_tokenizer(name: str):
    """Tokenizers are reused across calls: loading one takes longer than chunking a corpus."""
    return load_tokenizer(name)


def build_hierarchies(documents: Iterable[Document], cfg: HierarchyConfig) -> list[Chunk]:
    """Chunks of every document, document after document."""
    tokenizer = cached_tokenizer(cfg.tokenizer)
    return [chunk for doc in documents for chunk in build_hierarchy(doc, tokenizer, cfg)]


def chunks_at_levels(chunks: Iterable[Chunk], levels: str | Iterable[str]) -> list[Chunk]:
    """The chunks whose level is one of ``levels`` (a name or several), in their original order;
    an unknown level name raises a ValueError listing the valid ones."""
    wanted = {check_level(level) for level in ([levels] if isinstance(levels, str) else levels)}
    return [c for c in chunks if c.level in wanted]


def save_hierarchies(path: str | Path, chunks: Iterable[Chunk]) -> int:
    """Write chunks as JSONL (atomically); returns how many were written."""
    return write_jsonl(path, chunks)


def load_hierarchies(path: str | Path) -> list[Chunk]:
    """Chunks from a JSONL written by ``save_hierarchies`` or the hierarchy job, equal to the originals."""
    return list(read_jsonl(path, Chunk))


def stored_hierarchy_path(out: str | Path) -> Path:
    """Where a data job keeps the hierarchy its records refer to: ``<out stem>.hierarchy.jsonl`` beside ``out``.

    The summaries and pseudo-labels jobs store it, so the recipes and evaluations that read their output see
    exactly the chunk ids and documents those records were made from, without the corpus or the chunking code.

    >>> stored_hierarchy_path("runs/data/pseudo_labels/squad.jsonl").as_posix()
    'runs/data/pseudo_labels/squad.hierarchy.jsonl'
    """
    out = Path(out)
    return out.with_name(out.stem + ".hierarchy.jsonl")
