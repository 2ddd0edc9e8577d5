"""Every accelerate config parses with accelerate's own loader, and the recipe its first line launches accepts it: the
file holds what its name says (machines, processes, ZeRO stage), the job config loads with the line's overrides,
DeepSpeed settings build accelerate's DeepSpeed plugin, and a bf16 launch goes to a recipe that trains in bf16 (the
way litgpt tests its config hub). The two-process CPU configs also run for real in
tests/training/test_distributed.py."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.utils import DeepSpeedPlugin

from overstory.cli import JOBS, job_config_class
from overstory.core.config import load_config
from overstory.training.planner_common import grpo_args
from overstory.training.sft import sft_args

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))
LAUNCH = re.compile(r"# (?:\w+=\S+ )*accelerate launch --config_file (\S+)(?: --\w+ \S+)* "
                    r"-m overstory\.cli (\w+) ([\w-]+) --config (\S+)((?: [\w.]+=\S+)*)")
# every recipe a config's header names: the first line's and those of its "(also: `... -m overstory.cli ...`)" lines
RECIPE = re.compile(r"-m overstory\.cli (\w+) ([\w-]+) --config ([^\s`;]+)((?: [\w.]+=[^\s`;]+)*)")


def header_recipes(path: Path) -> list[tuple[str, str, str, str]]:
    """(group, job, job config, overrides) of every launch a config's leading comment names, in order."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# "))
    return [match.groups() for match in RECIPE.finditer(" ".join(lines))]


def _bf16(job_config) -> bool:
    """Whether a job config trains in bf16 (``train.bf16``, or ``grpo.bf16`` for STITCH)."""
    for section in ("train", "grpo"):
        settings = getattr(job_config, section, None)
        if settings is not None and dataclasses.is_dataclass(settings) and hasattr(settings, "bf16"):
            return settings.bf16
    return False


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_and_its_recipe(path: Path) -> None:
    config = ClusterConfig.from_yaml_file(str(path))
    assert config.num_processes >= 1 and config.num_machines >= 1
    assert config.num_processes % config.num_machines == 0
    # the file name says what the file must hold: machines, processes, ZeRO stage, precision
    nodes, gpus, cpu_processes = re.match(r"(?:(\d+)node-(\d+)gpu|cpu-(\d+)proc)", path.name).groups()
    if nodes:
        assert (config.num_machines, config.num_processes) == (int(nodes), int(nodes) * int(gpus))
    else:
        assert (config.num_machines, config.num_processes) == (1, int(cpu_processes))
        assert config.mixed_precision == "no"  # no bf16 autocast on these CPU launches
    zero = re.search(r"zero(\d)", path.name)
    assert (config.distributed_type == "DEEPSPEED") == bool(zero)
    if zero:
        assert config.deepspeed_config["zero_stage"] == int(zero.group(1))
    first = path.read_text().splitlines()[0]
    match = LAUNCH.fullmatch(first)
    assert match, f"{path}: first line must give the launch command, got {first!r}"
    config_file, group, job, job_config_path, overrides = match.groups()
    assert config_file == str(path.relative_to(ROOT)) and (group, job) in JOBS
    job_config = load_config(job_config_class(group, job), ROOT / job_config_path, overrides.split())
    if config.distributed_type == "DEEPSPEED":
        settings = config.deepspeed_config
        # accelerate builds its plugin from the settings (it raises on values it rejects)
        DeepSpeedPlugin(zero_stage=settings["zero_stage"], gradient_clipping=settings["gradient_clipping"],
                        gradient_accumulation_steps=settings["gradient_accumulation_steps"],
                        zero3_init_flag=settings["zero3_init_flag"])
        for named_group, named_job, named_path, named_overrides in header_recipes(path):
            if (named_group, named_job) in TRAINER_ARGS:  # what the Trainer does with this plugin at start-up
                named = load_config(job_config_class(named_group, named_job), ROOT / named_path,
                                    named_overrides.split())
                mismatches = _trainer_deepspeed_mismatches(settings, TRAINER_ARGS[named_group, named_job](named))
                assert not mismatches, f"{path} + {named_path}: the Trainer would refuse {mismatches}"
    if config.mixed_precision == "bf16" and group == "train" and job != "compressor":
        # the Trainer-based recipes take bf16 from their own config; the set compressor's loop from accelerate
        assert _bf16(job_config), f"{path} launches {job} in bf16 but the recipe's config trains in fp32"


# The Trainer recipes' arguments as a launch builds them (use_cpu: bf16 arguments are refused without a GPU,
# and no DeepSpeed field depends on the device).
TRAINER_ARGS = {("train", "planner_sft"): lambda config: sft_args(config, evaluate=True, use_cpu=True),
                ("train", "planner_grpo"): lambda config: grpo_args(config.train, config.out, [1.0], use_cpu=True)}


def _trainer_deepspeed_mismatches(settings: dict, args) -> list[str]:
    """The DeepSpeed values that disagree with the Trainer's arguments, found the way transformers checks them
    when a Trainer starts under an accelerate DeepSpeed config (``accelerate launch`` passes the config's
    gradient_accumulation_steps through ACCELERATE_GRADIENT_ACCUMULATION_STEPS)."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", str(settings["gradient_accumulation_steps"]))
        plugin = DeepSpeedPlugin(zero_stage=settings["zero_stage"], gradient_clipping=settings["gradient_clipping"],
                                 zero3_init_flag=settings["zero3_init_flag"])
    trainer_view = HfTrainerDeepSpeedConfig(plugin.hf_ds_config.config)
    trainer_view.trainer_config_process(args)
    return trainer_view.mismatches


def test_trainer_recipes_at_paper_scale_are_checked_against_deepspeed() -> None:
    """The check above covers both Trainer recipes, and it catches a fixed gradient_accumulation_steps that
    differs from the recipe's (the paper-scale GRPO config accumulates 4 micro-batches per optimizer step)."""
    deepspeed = [path for path in CONFIGS if ClusterConfig.from_yaml_file(str(path)).distributed_type == "DEEPSPEED"]
    launched = {(group, job) for path in deepspeed for group, job, _, _ in header_recipes(path)}
    assert set(TRAINER_ARGS) <= launched
    assert {job for _, job, _, _ in header_recipes(ROOT / "configs/accelerate/1node-8gpu-zero3.yaml")} == {
        "stitch", "planner_sft"}  # the first line's and the "(also: ...)" line's
    paper_config = ROOT / "configs/train/planner_grpo-qwen2.5-1.5b.yaml"
    paper = load_config(job_config_class("train", "planner_grpo"), paper_config)
    assert paper.train.grad_accum == 4 and paper.train.lr == 1e-6 and paper.train.num_generations == 8
    fixed = {"zero_stage": 3, "gradient_clipping": 1.0, "zero3_init_flag": True, "gradient_accumulation_steps": 1}
    mismatches = _trainer_deepspeed_mismatches(fixed, grpo_args(paper.train, paper.out, [1.0], use_cpu=True))
    assert any("gradient_accumulation_steps" in m for m in mismatches)


def test_there_are_configs_for_every_scale() -> None:
    assert {p.name for p in CONFIGS} >= {"cpu-2proc.yaml", "cpu-2proc-zero2.yaml", "1node-8gpu-bf16.yaml",
                                         "1node-8gpu-zero2.yaml", "1node-8gpu-zero3.yaml", "2node-8gpu-zero2.yaml",
                                         "2node-8gpu-zero3.yaml"}
