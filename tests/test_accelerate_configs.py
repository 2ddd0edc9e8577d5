"""Every accelerate config parses with accelerate's own loader and names a command that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig

from overstory.cli import JOBS

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_accelerate_config(path: Path) -> None:
    config = ClusterConfig.from_yaml_file(str(path))
    assert config.num_processes >= 1 and config.num_machines >= 1
    first = path.read_text().splitlines()[0]
    command = r"# accelerate launch --config_file (\S+) -m overstory\.cli (\w+) ([\w-]+) --config (\S+)"
    match = re.fullmatch(command, first)
    assert match, f"{path}: first line must give the launch command, got {first!r}"
    config_file, group, job, job_config = match.groups()
    assert config_file == str(path.relative_to(ROOT)) and (group, job) in JOBS
    assert (ROOT / job_config).exists()


def test_there_are_accelerate_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"cpu-2proc.yaml", "1node-8gpu-bf16.yaml"}
