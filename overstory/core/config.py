"""Typed job configs: YAML file + dotted command-line overrides -> a frozen dataclass.

Every job declares one frozen dataclass (nested dataclasses for sections). `load_config` reads
the YAML, applies overrides such as ``train.lr=1e-5`` or ``roles.generator.max_new_tokens=64``,
and builds the dataclass while checking every key and type, so a typo fails before any work
starts and names the key together with the closest valid one.

Supported field types: bool, int, float, str, Path, Literal[...], Optional[...], list[X],
tuple[X, ...], dict[str, X] and nested dataclasses. Dataclasses may validate further in
``__post_init__`` by raising ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the dotted key."""


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build ``cls`` from an optional YAML file and ``key.sub=value`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a mapping at the top level, got {type(loaded).__name__}")
        raw = loaded
    for item in overrides or []:
        apply_override(raw, item)
    return build(cls, raw, prefix="")


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` in the nested dict ``raw``; the value is parsed as YAML (1e-5, true, [a, b])."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.sub=value")
    key, _, text = item.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def build(cls: type[T], raw: Any, prefix: str, base: Any = None) -> T:
    """Recursively build dataclass ``cls`` from ``raw``, naming the dotted key on every error.

    Keys missing from ``raw`` keep their value in ``base`` (the default of the enclosing field), so
    ``serve.port=0`` changes the port of the default ``serve`` section instead of replacing the
    whole section. Mappings typed ``dict[str, X]`` are replaced, not merged.
    """
    where = prefix.rstrip(".") or "<top level>"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping for {cls.__name__}, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
        hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(fields))}"
        raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(hints[name], value, f"{prefix}{name}",
                            getattr(base, name) if base is not None else _field_default(fields[name]))
              for name, value in raw.items()}
    if base is not None:
        kwargs.update({name: getattr(base, name) for name in fields if name not in kwargs})
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{where}: {exc}") from exc


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _coerce(tp: Any, value: Any, key: str, base: Any = None) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, key, base)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {args}")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}{hint}")
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value if value is not None else {}, f"{key}.", base if isinstance(base, tp) else None)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item_tp = args[0] if args else Any
        items = [_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        val_tp = args[1] if args else Any
        return {str(k): _coerce(val_tp, v, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    if tp is Path:
        if not isinstance(value, (str, Path)):
            raise ConfigError(f"{key}: expected a path, got {value!r}")
        return Path(value)
    raise ConfigError(f"{key}: unsupported config type {tp!r}")


def to_dict(config: Any) -> dict[str, Any]:
    """A JSON/YAML-friendly dict of a config (Paths become strings), for manifests and tracking."""

    def convert(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: convert(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [convert(v) for v in value]
        if isinstance(value, Path):
            return str(value)
        return value

    return convert(config)


def path_list(value: str | list[str]) -> list[str]:
    """A config field that names one file or several: a YAML list, or one string with the paths comma-separated (as
    a command-line override gives them).

    >>> path_list("a.jsonl, b.jsonl"), path_list(["a.jsonl"]), path_list("")
    (['a.jsonl', 'b.jsonl'], ['a.jsonl'], [])
    """
    paths = value.split(",") if isinstance(value, str) else value
    return [p.strip() for p in paths if p.strip()]


_ABSENT = object()  # a key one side of differing_keys lacks


def differing_keys(old: object, new: object, prefix: str = "") -> list[str]:
    """Dotted paths where two nested settings dicts differ. A key that only one side has, with an empty value there
    (None, "", {} or []: a setting added to the code after the run started, left unset), is no difference: it
    cannot have changed what the run made, and refusing it would strand every run made before the setting existed.

    >>> differing_keys({"a": 1, "b": {"c": 2, "d": 3}}, {"a": 1, "b": {"c": 5}, "e": 0})
    ['b.c', 'b.d', 'e']
    >>> differing_keys({"a": 1}, {"a": 1, "push_to_hub": "", "trl": {}}), differing_keys({"a": 1}, {"trl": {"x": 1}})
    ([], ['a', 'trl'])
    """
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        return [path for key in keys
                for path in differing_keys(old.get(key, _ABSENT), new.get(key, _ABSENT), f"{prefix}{key}.")]
    if (old is _ABSENT and _unset(new)) or (new is _ABSENT and _unset(old)):
        return []
    return [] if old == new else [prefix.rstrip(".")]


def _unset(value: object) -> bool:
    return value is None or (isinstance(value, (str, dict, list)) and not value)


def record_settings(record: Path, settings: dict, *, results: Path | None, remedy: str) -> None:
    """Write ``settings`` (what decides a resumable job's output) to the JSON file ``record``, after checking them
    against those already recorded when ``results`` exists (None: the caller knows there are no results yet).

    Resumable jobs append to their output; adding results made another way to those already there would give a
    mixed output that nothing downstream can tell apart, so a rerun with other settings is refused naming the dotted
    keys that differ, and results without a record (from a version that kept none) are refused too. ``remedy`` ends
    the message: what the user can do instead (another out folder, a restart).
    """
    settings = json.loads(json.dumps(settings))  # the JSON view, so tuples compare equal to stored lists
    if results is not None and results.exists():
        if not record.exists():
            raise ConfigError(f"{results} holds results without a record of their settings ({record} is missing); "
                              f"{remedy}")
        changed = differing_keys(json.loads(record.read_text()), settings)
        if changed:
            raise ConfigError(f"{results} was made with other settings ({', '.join(changed)} differ from {record}); "
                              f"{remedy}")
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(settings, indent=2) + "\n")
