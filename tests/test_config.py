"""Typed configs: YAML + dotted overrides, unknown keys and wrong types fail naming the key."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from overstory.cli import JOBS, job_config_class
from overstory.core.config import ConfigError, load_config, record_settings, to_dict

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Optim:
    lr: float = 1e-4
    schedule: Literal["cosine", "linear"] = "cosine"


@dataclass(frozen=True)
class Job:
    name: str = "job"
    steps: int = 10
    train: Optim = field(default_factory=Optim)
    levels: list[str] = field(default_factory=lambda: ["paragraph"])
    roles: dict[str, Optim] = field(default_factory=dict)
    seed: int | None = None


def test_yaml_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("steps: 3\ntrain:\n  lr: 0.5\nroles:\n  planner: {lr: 2.0}\n")
    cfg = load_config(Job, path, ["train.lr=1e-5", "levels=[sentence, document]", "roles.planner.schedule=linear"])
    assert cfg.steps == 3
    assert cfg.train.lr == pytest.approx(1e-5)
    assert cfg.levels == ["sentence", "document"]
    assert cfg.roles["planner"] == Optim(lr=2.0, schedule="linear")
    assert to_dict(cfg)["train"] == {"lr": 1e-5, "schedule": "cosine"}


@dataclass(frozen=True)
class Outer:
    job: Job = field(default_factory=lambda: Job(name="preset", steps=99, roles={"a": Optim(), "b": Optim()}))


def test_partial_section_override_keeps_the_section_default() -> None:
    cfg = load_config(Outer, None, ["job.train.lr=0.5"])
    assert (cfg.job.name, cfg.job.steps, cfg.job.train.lr) == ("preset", 99, 0.5)
    assert set(cfg.job.roles) == {"a", "b"}
    replaced = load_config(Outer, None, ["job.roles={c: {lr: 1.0}}"])
    assert set(replaced.job.roles) == {"c"}  # mappings are replaced, not merged


def test_config_is_frozen() -> None:
    cfg = load_config(Job)
    with pytest.raises(AttributeError):
        cfg.steps = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.lrr=1"], "unknown config key 'train.lrr'; did you mean 'train.lr'"),
        (["stepz=1"], "did you mean 'steps'"),
        (["steps=ten"], "steps: expected an integer"),
        (["steps=1.5"], "steps: expected an integer"),
        (["train.lr=fast"], "train.lr: expected a number"),
        (["train.schedule=cosin"], "did you mean 'cosine'"),
        (["levels=paragraph"], "levels: expected a list"),
        (["train=3"], "train: expected a mapping"),
        (["no_equals_sign"], "must look like key.sub=value"),
    ],
)
def test_bad_overrides_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(Job, None, overrides)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(Job, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Job, bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(Job, bad)


def _command_of(path: Path) -> tuple[str, str]:
    """The job a config belongs to, read from its first line: '# overstory GROUP [NAME] --config PATH [flags]'."""
    first = path.read_text().splitlines()[0]
    match = re.fullmatch(r"# overstory (\w+)(?: ([\w-]+))? --config (\S+)(?: .*)?", first.strip())
    assert match, f"{path}: first line must give the command that runs it, got {first!r}"
    group, name, config_path = match.groups()
    assert config_path == str(path.relative_to(ROOT)), f"{path}: command names another file ({config_path})"
    return group, name or ""


OVERSTORY_CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml")
                           if p.parent.name not in {"accelerate", "deepspeed"})


@pytest.mark.parametrize("path", OVERSTORY_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_configs_first_line_command_parses_and_loads(path: Path, monkeypatch) -> None:
    """The first line's command goes through the CLI as a user would type it (flags, overrides and all), up to
    the point where the job would start: the config it builds must load (a renamed module, key or flag fails)."""
    from overstory import cli

    group, name = _command_of(path)
    assert (group, name) in JOBS, f"{path} names an unknown job {group} {name}"
    loaded = []
    monkeypatch.setattr(cli, "run_job", lambda g, n, config_path, overrides: loaded.append(
        load_config(job_config_class(g, n), ROOT / config_path, overrides)))
    monkeypatch.chdir(ROOT)
    assert cli.main(shlex.split(path.read_text().splitlines()[0].lstrip("# "))[1:]) == 0
    assert len(loaded) == 1 and isinstance(loaded[0], job_config_class(group, name))


def test_every_job_has_a_config_file() -> None:
    covered = {_command_of(p) for p in OVERSTORY_CONFIGS}
    assert set(JOBS) <= covered, f"jobs without a config under configs/: {set(JOBS) - covered}"


def test_the_quickstart_config_spells_out_the_defaults() -> None:
    """configs/quickstart.yaml says it holds `overstory quickstart`'s defaults: a changed default must change it."""
    from overstory.quickstart import QuickstartConfig

    spelled_out = load_config(QuickstartConfig, ROOT / "configs/quickstart.yaml")
    assert to_dict(spelled_out) == to_dict(QuickstartConfig())


def test_settings_records_refuse_other_settings_and_unrecorded_results(tmp_path: Path) -> None:
    record, results = tmp_path / "settings.json", tmp_path / "results.jsonl"
    settings = {"chunking": {"size": 500, "levels": ("sentence", "paragraph")}, "seed": 0}
    record_settings(record, settings, results=results, remedy="start over")
    results.write_text("{}\n")
    record_settings(record, settings, results=results, remedy="start over")  # equal: a tuple is read back as a list
    with pytest.raises(ConfigError, match=r"other settings \(chunking\.size, seed differ from .*\); start over$"):
        record_settings(record, {"chunking": {"size": 2000, "levels": ["sentence", "paragraph"]}, "seed": 1},
                        results=results, remedy="start over")
    assert record.read_text().count("500") == 1  # a refused run leaves the record as it was
    record.unlink()
    with pytest.raises(ConfigError, match="without a record of their settings"):
        record_settings(record, settings, results=results, remedy="start over")
