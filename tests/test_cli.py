"""The command line: every subcommand has --help, config errors exit 2 naming the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from overstory.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "overstory.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_top_level_help_lists_subcommands() -> None:
    result = _run("--help")
    assert result.returncode == 0
    for group in ("data", "train", "serve", "eval", "quickstart", "bench"):
        assert group in result.stdout


@pytest.mark.parametrize("args", [["data", "hierarchy"], ["serve"], ["eval", "rag"], ["quickstart"],
                                  ["bench", "serve"]])
def test_job_help_shows_config_and_overrides(args: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--config" in out and "key.sub=value" in out


@pytest.mark.parametrize(("group", "job"), [("data", "hierarchy"), ("data", "summaries"), ("eval", "rag"),
                                          ("train", "compressor")])
def test_group_help_lists_its_jobs(group: str, job: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([group, "--help"])
    assert exit_info.value.code == 0
    assert job in capsys.readouterr().out


def test_unknown_key_fails_before_work(capsys: pytest.CaptureFixture) -> None:
    code = main(["eval", "rag", "--config", "configs/eval/rag.yaml", "retrieval.kk=3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "retrieval.kk" in err and "retrieval.k" in err
