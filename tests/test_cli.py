"""The command line: every subcommand has --help listing its own flags and config keys, config errors exit 2
naming the key."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from typing import Literal

import pytest

from overstory.cli import main
from overstory.config_help import config_sections
from overstory.data_pipeline.fanout import failures_path, settings_path
from overstory.jobs import job_config_class
from overstory.serving.launch import serve_in_background
from tests.stand_ins import failing_server


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "overstory.cli", *args], capture_output=True, text=True,
                          timeout=120)


def _help(capsys: pytest.CaptureFixture, *args: str) -> str:
    """What ``overstory ARGS --help`` prints; argparse exits 0 after printing it."""
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_subcommands() -> None:
    result = _run("--help")
    assert result.returncode == 0
    for group in ("data", "train", "serve", "eval", "quickstart", "bench"):
        assert group in result.stdout


def test_top_level_help_imports_no_job() -> None:
    code = ("import sys; from overstory.cli import build_parser; build_parser().format_help(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('overstory.training')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("args", [["data", "hierarchy"], ["serve"], ["eval", "rag"], ["quickstart"],
                                  ["bench", "serve"]])
def test_job_help_shows_config_and_overrides(args: list[str], capsys: pytest.CaptureFixture) -> None:
    out = _help(capsys, *args)
    assert "--config" in out and "key.sub=value" in out and "config keys" in out


@pytest.mark.parametrize(("group", "job"), [("data", "hierarchy"), ("data", "summaries"), ("eval", "rag"),
                                          ("train", "compressor")])
def test_group_help_lists_its_jobs(group: str, job: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([group, "--help"])
    assert exit_info.value.code == 0
    assert job in capsys.readouterr().out


def test_train_help_lists_nested_keys_and_only_its_flags(capsys: pytest.CaptureFixture) -> None:
    out = _help(capsys, "train", "planner_sft")
    lr = typing.get_type_hints(job_config_class("train", "planner_sft"))["train"]().lr
    assert re.search(rf"^  train\.lr +float +{re.escape(str(lr))}\b", out, re.MULTILINE), out
    assert "--out OUT" in out
    for flag in ("--engine", "--compare", "--checkpoint", "--data"):
        assert flag not in out


def test_serve_help_gives_engine_choices_and_comments(capsys: pytest.CaptureFixture) -> None:
    out = _help(capsys, "serve")
    assert "--engine {embedded,vllm}" in out
    assert "--checkpoint" not in out and "--out" not in out
    # port's comment is at the end of its line; engine's on the lines above it
    assert re.search(r"^  port +int +8000 +0 picks a free port", out, re.MULTILINE), out
    assert re.search(r"^  engine +\{embedded,vllm\} +embedded +embedded: every role in one", out, re.MULTILINE), out
    assert re.search(r"^  roles\.<name>\.model +str +required", out, re.MULTILINE), out


def test_eval_planner_help_lists_compare(capsys: pytest.CaptureFixture) -> None:
    out = _help(capsys, "eval", "planner")
    assert re.search(r"--compare COMPARE +comma-separated names from `variants`", out), out
    assert "--checkpoint CHECKPOINT" in out and "--engine" not in out


def test_flag_becomes_override_between_overrides(capsys: pytest.CaptureFixture) -> None:
    code = main(["eval", "planner", "data=labels.jsonl", "--compare", "nosuch", "out=runs/x"])
    assert code == 2
    assert "compare: nosuch not in variants" in capsys.readouterr().err


def test_flag_a_job_lacks_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "planner_grpo", "--data", "labels.jsonl"])  # data is a section there, not a value
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --data" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--engine", "vlm"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'vlm'" in capsys.readouterr().err


def test_unknown_key_fails_before_work(capsys: pytest.CaptureFixture) -> None:
    code = main(["eval", "rag", "--config", "configs/eval/rag.yaml", "answer.max_tokenz=3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "'answer.max_tokenz'; did you mean 'answer.max_tokens'?" in err


def test_a_missing_corpus_file_is_a_short_error(tmp_path, capsys: pytest.CaptureFixture) -> None:
    code = main(["data", "hierarchy", "--config", "configs/data/hierarchy.yaml", "corpus.kind=squad",
                 f"corpus.path={tmp_path / 'nowhere.json'}", f"out={tmp_path / 'h.jsonl'}", "tracking.backend=none"])
    assert code == 2
    assert f"corpus error: corpus file not found: {tmp_path / 'nowhere.json'}" in capsys.readouterr().err


def test_a_data_job_whose_items_all_fail_exits_1_naming_the_count(tmp_path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "summaries.jsonl"
    with serve_in_background(failing_server(400, "refused")) as url:
        code = main(["data", "summaries", "--config", "configs/data/summaries.yaml", f"out={out}", "corpus.kind=text",
                     "corpus.path=data/markdown", "limit=3", "max_attempts=1", f"server_url={url}",
                     "tracking.backend=none"])
    assert code == 1
    assert "job failed: summaries: 3 of 3 items failed" in capsys.readouterr().err
    assert [r["error"] for r in map(json.loads, failures_path(out).read_text().splitlines())] == ["400: refused"] * 3
    assert json.loads(settings_path(out).read_text())["served"] == {"generator": "model-x", "embedder": "model-x"}


@dataclass(frozen=True)
class _Inner:
    """The inner section.

    Only its first docstring line heads the section.
    """

    rate: float = 0.5  # how fast


@dataclass(frozen=True)
class _Role:
    model: str


@dataclass(frozen=True)
class _Outer:
    name: str
    # chosen mode,
    # over two lines
    mode: Literal["a", "b"] = "a"
    tags: list[str] = field(default_factory=lambda: ["x"])  # trailing
    plain: int | None = 3
    inner: _Inner = field(default_factory=lambda: _Inner(rate=0.25))  # what the inner part does
    roles: dict[str, _Role] = field(default_factory=lambda: {"gen": _Role("m")})


def test_config_sections_read_types_defaults_and_comments() -> None:
    assert config_sections(_Outer) == [
        ("", [("name", "str", "required", ""), ("mode", "{a,b}", "a", "chosen mode, over two lines"),
              ("tags", "list[str]", "[x]", "trailing"), ("plain", "int | None", "3", "")]),
        ("inner (_Inner): The inner section.; what the inner part does", [("inner.rate", "float", "0.25", "how fast")]),
        ("roles.<name> (_Role; by default gen)", [("roles.<name>.model", "str", "required", "")]),
    ]
