"""Find annotated evidence text in a document: verbatim, modulo whitespace, or by fuzzy match.

Annotators' evidence strings (QASPER's evidence paragraphs and highlighted sentences) are copies of
the paper's text, but not always byte for byte: surrounding or doubled whitespace differs, and
some highlights were cut or re-typed. Each lookup says how it matched, so a loader can count
the matches that were not verbatim instead of guessing silently:

- ``exact``: the string occurs verbatim;
- ``whitespace``: it occurs once runs of whitespace are treated as equal (a regular expression
  over its words, so the span is still read off the original text);
- ``fuzzy``: difflib's similarity ratio with the best candidate is at least ``threshold``;
- no match (``None``): nothing reached the threshold, or a verbatim hit was ambiguous (found
  more than once outside the preferred regions, e.g. a short fragment like "It is a "); fragments
  shorter than ``FUZZY_MIN_CHARS`` are never matched fuzzily.

difflib is in the standard library (rapidfuzz is not installed); the candidates are one paper's
paragraphs, so its speed is enough.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass

FUZZY_THRESHOLD = 0.8
FUZZY_MIN_CHARS = 40


@dataclass(frozen=True)
class Match:
    """Where a needle was found: ``text[start:end]``, how (``exact``/``whitespace``/``fuzzy``) and the
    similarity ratio (1.0 unless fuzzy)."""

    start: int
    end: int
    how: str
    score: float = 1.0


def _ratio(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def _words_pattern(needle: str) -> re.Pattern | None:
    words = needle.split()
    return re.compile(r"\s+".join(re.escape(w) for w in words)) if words else None


def match_paragraph(needle: str, text: str, paragraphs: Sequence[tuple[int, int]],
                    threshold: float = FUZZY_THRESHOLD) -> tuple[int, Match] | None:
    """The paragraph (an index into ``paragraphs``, spans of ``text``) that ``needle`` reproduces,
    with its match; None when no paragraph is equal, equal modulo whitespace, or (for needles of
    ``FUZZY_MIN_CHARS`` or more) similar enough.

    >>> text = "Intro text.\\n\\n $x = 1$ \\n\\nResults are good on every one of the five datasets."
    >>> paras = [(0, 11), (13, 22), (24, 76)]
    >>> match_paragraph("Intro text.", text, paras)
    (0, Match(start=0, end=11, how='exact', score=1.0))
    >>> match_paragraph("$x =  1$", text, paras)[1].how
    'whitespace'
    >>> match_paragraph("Results are goood on every one of the five datasets.", text, paras)
    (2, Match(start=24, end=76, how='fuzzy', score=0.99))
    >>> match_paragraph("Intro txt.", text, paras) is None  # too short to match fuzzily
    True
    """
    for i, (start, end) in enumerate(paragraphs):
        if text[start:end] == needle:
            return i, Match(start, end, "exact")
    collapsed = " ".join(needle.split())
    for i, (start, end) in enumerate(paragraphs):
        if " ".join(text[start:end].split()) == collapsed:
            return i, Match(start, end, "whitespace")
    if len(needle.strip()) < FUZZY_MIN_CHARS:
        return None
    best: tuple[float, int] | None = None
    for i, (start, end) in enumerate(paragraphs):
        matcher = difflib.SequenceMatcher(None, needle, text[start:end], autojunk=False)
        if matcher.real_quick_ratio() >= threshold and matcher.quick_ratio() >= threshold:
            score = matcher.ratio()
            if score >= threshold and (best is None or score > best[0]):
                best = (score, i)
    if best is None:
        return None
    start, end = paragraphs[best[1]]
    return best[1], Match(start, end, "fuzzy", round(best[0], 3))


def _aligned_window(region: str, needle: str) -> tuple[int, int] | None:
    """The stretch of ``region`` that difflib aligns with ``needle``: from the first to the last
    matching block of a useful size, widened by the needle characters left unmatched at either end."""
    blocks = difflib.SequenceMatcher(None, region, needle, autojunk=False).get_matching_blocks()
    useful = [b for b in blocks if b.size >= max(4, len(needle) // 20)]
    if not useful:
        return None
    first, last = useful[0], useful[-1]
    lo = max(0, first.a - first.b)
    hi = min(len(region), last.a + last.size + (len(needle) - last.b - last.size))
    return (lo, hi) if lo < hi else None


def _fuzzy(needle: str, text: str, spans: Sequence[tuple[int, int]], threshold: float) -> Match | None:
    """The best window of ``spans`` whose similarity ratio with ``needle`` reaches ``threshold``."""
    best: Match | None = None
    for start, end in spans:
        window = _aligned_window(text[start:end], needle)
        if window is None:
            continue
        lo, hi = start + window[0], start + window[1]
        while lo < hi and text[lo].isspace():
            lo += 1
        while hi > lo and text[hi - 1].isspace():
            hi -= 1
        score = _ratio(text[lo:hi], needle)
        if score >= threshold and (best is None or score > best.score):
            best = Match(lo, hi, "fuzzy", round(score, 3))
    return best


def locate(needle: str, text: str, regions: Sequence[tuple[int, int]], paragraphs: Sequence[tuple[int, int]] = (),
           threshold: float = FUZZY_THRESHOLD) -> Match | None:
    """Where ``needle`` (a sentence or fragment) lies in ``text``: first inside ``regions`` (the
    paragraphs it should come from), then anywhere in the text if it occurs there once. Fuzzy
    matching (needles of ``FUZZY_MIN_CHARS`` or more: a short fragment is similar to too much) aligns it
    with ``regions``, then with ``paragraphs``, and keeps the best window reaching ``threshold``.

    >>> text = "A cat sat.  It was  happy. The end of the story came, as it was told by the old man."
    >>> locate("It was happy.", text, [(0, 26)])
    Match(start=12, end=26, how='whitespace', score=1.0)
    >>> locate("The end", text, [(0, 26)])  # outside the region, but only once in the text
    Match(start=27, end=34, how='exact', score=1.0)
    >>> locate("The end of hte story came, as it was told by the old man.", text, [(0, 26)], [(0, 26), (27, 84)])
    Match(start=27, end=84, how='fuzzy', score=0.982)
    >>> locate("zebra crossing at the end of the story, it was", text, [(0, 26)], [(0, 26), (27, 84)]) is None
    True
    """
    needle = needle.strip()
    if not needle:
        return None
    for start, end in regions:
        at = text.find(needle, start, end)
        if at >= 0:
            return Match(at, at + len(needle), "exact")
    if text.count(needle) == 1:
        at = text.find(needle)
        return Match(at, at + len(needle), "exact")
    pattern = _words_pattern(needle)
    for start, end in regions:
        if found := pattern.search(text, start, end):
            return Match(found.start(), found.end(), "whitespace")
    hits = list(pattern.finditer(text))
    if len(hits) == 1:
        return Match(hits[0].start(), hits[0].end(), "whitespace")
    if len(needle) < FUZZY_MIN_CHARS:
        return None
    return _fuzzy(needle, text, regions, threshold) or _fuzzy(needle, text, paragraphs, threshold)
