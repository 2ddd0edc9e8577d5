"""A job's config keys for its ``--help``: dotted key, type, default and meaning, read from the config dataclass.

The meaning of a key is the comment its dataclass source gives the field (the comment at the end of its line,
else the comment lines right above it), so ``--help`` says what a reader of the code sees and cannot drift
from it. The AST holds no comments: ``tokenize`` finds them, and the AST's line numbers tie them to fields.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
import types
import typing
from typing import Any, Literal, Union

WIDTH = 120  # help lines are wrapped to this many characters
DEFAULT_WIDTH = 40  # longer defaults (lists, long paths) are cut to this many characters
COLUMN_CAPS = (36, 28, 20)  # widest key, type and default that set a column's width; wider cells overflow
NOT_CODE = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}

Row = tuple[str, str, str, str]  # key, type, default, meaning


@functools.cache
def source_notes(cls: type) -> tuple[str, dict[str, str]]:
    """The first line of dataclass ``cls``'s own docstring and each field's comment, from its source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source to read (a class made at run time): no meanings
        return "", {}
    trailing: dict[int, str] = {}  # line -> the comment after code on that line
    alone: dict[int, str] = {}  # line -> the comment on a line of its own
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            (trailing if line in code_lines else alone)[line] = tok.string.lstrip("#").strip()
        elif tok.type not in NOT_CODE:
            code_lines.add(tok.start[0])
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef)
    notes: dict[str, str] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            lines = range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
            note = [trailing[line] for line in lines if line in trailing]
            if not note:  # no comment at the end of the field: the block of comment lines right above it
                above = stmt.lineno - 1
                while above in alone:
                    note.insert(0, alone[above])
                    above -= 1
            notes[stmt.target.id] = " ".join(note)
    doc = ast.get_docstring(node) or ""
    return (doc.splitlines()[0] if doc else ""), notes


def type_name(tp: Any) -> str:
    """An annotation as a reader writes it: ``float``, ``list[str]``, ``str | None``, ``{dapo,grpo}`` for a Literal.

    >>> type_name(dict[str, list[int]]), type_name(Literal["a", "b"]), type_name(typing.Optional[int])
    ('dict[str, list[int]]', '{a,b}', 'int | None')
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "{" + ",".join(str(a) for a in args) + "}"
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else type_name(a) for a in args)}]"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def default_text(value: Any) -> str:
    """A default as an override would write it (``true``, ``[a, b]``, ``""``), cut to DEFAULT_WIDTH characters.

    >>> default_text(True), default_text(""), default_text(["q", "k"]), default_text({"a": 1}), default_text(1e-6)
    ('true', '""', '[q, k]', '{a: 1}', '1e-06')
    """
    if value is dataclasses.MISSING:
        return "required"
    if isinstance(value, bool):
        text = str(value).lower()
    elif value is None:
        text = "null"
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(default_text(v) for v in value) + "]"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {default_text(v)}" for k, v in value.items()) + "}"
    else:
        text = str(value) or '""'
    return text if len(text) <= DEFAULT_WIDTH else text[:DEFAULT_WIDTH - 1] + "…"


def _default(f: dataclasses.Field, section: Any) -> Any:
    """A field's default: its value in the section's default instance, else the field's default (or factory's)."""
    if section is not None:
        return getattr(section, f.name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def config_sections(cls: type, prefix: str = "", section: Any = None, header: str = "") -> list[tuple[str, list[Row]]]:
    """``(header, rows)`` for the leaf keys of dataclass ``cls``, then for each nested section, recursively.

    ``section`` is the enclosing field's default instance (``serve: ServeConfig = ServeConfig.local(port=0)``),
    whose values are the defaults under it. A ``dict[str, Dataclass]`` field gives keys ``field.<name>.key``.
    """
    notes = source_notes(cls)[1]
    hints = typing.get_type_hints(cls)
    rows: list[Row] = []
    nested: list[tuple[str, list[Row]]] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, key, default = hints[f.name], prefix + f.name, _default(f, section)
        value_tp = typing.get_args(tp)[1] if typing.get_origin(tp) is dict else None
        sub = tp if dataclasses.is_dataclass(tp) else value_tp if dataclasses.is_dataclass(value_tp) else None
        if sub is None:
            rows.append((key, type_name(tp), default_text(default), notes.get(f.name, "")))
            continue
        about = "; ".join(note for note in (source_notes(sub)[0], notes.get(f.name, "")) if note)
        if sub is tp:
            title, sub_prefix = f"{key} ({sub.__name__})", f"{key}."
            sub_section = None if default is dataclasses.MISSING else default
        else:  # dict[str, Dataclass]: the names are the user's; the defaults under them are the class's
            # a required dict (no default) names nothing
            names = f"; by default {', '.join(default)}" if default and default is not dataclasses.MISSING else ""
            title, sub_prefix, sub_section = f"{key}.<name> ({sub.__name__}{names})", f"{key}.<name>.", None
        nested += config_sections(sub, sub_prefix, sub_section, title + (f": {about}" if about else ""))
    return [(header, rows), *nested]


def describe_config(cls: type) -> str:
    """The ``--help`` epilog of a job: its config keys with type, default and meaning, section by section.

    A column is as wide as its widest cell in the section that fits under a cap; a row with a wider cell
    has its meaning on the lines below, the way argparse places the help of a long flag.
    """
    lines: list[str] = []
    title = "config keys (override as key.sub=value): key, type, default, meaning"
    for header, rows in config_sections(cls, header=title):
        lines += ["", *textwrap.wrap(header, WIDTH, subsequent_indent="    ")]
        widths = [max((len(row[i]) for row in rows if len(row[i]) <= cap), default=0)
                  for i, cap in enumerate(COLUMN_CAPS)]
        indent = 2 + sum(widths) + 6
        for key, tp, default, meaning in rows:
            cells = f"  {key:<{widths[0]}}  {tp:<{widths[1]}}  {default:<{widths[2]}}  "
            wrapped = [" " * indent + line for line in textwrap.wrap(meaning, WIDTH - indent)]
            if wrapped and len(cells) <= indent:
                wrapped[0] = cells + wrapped[0].lstrip()
            else:  # no meaning, or a cell wider than its column: the meaning goes below
                lines.append(cells.rstrip())
            lines += wrapped
    return "\n".join(lines).strip("\n")
