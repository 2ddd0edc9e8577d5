"""TRL's own settings through a recipe's ``trl`` section (training/trl_args.py): a real field reaches the built
SFTConfig / GRPOConfig, a misspelt one is refused with the closest name, a field an alias or the recipe sets is
refused naming why. No training: the arguments are built as a launch builds them."""

from __future__ import annotations

from pathlib import Path

import pytest

from overstory.core.config import ConfigError, load_config
from overstory.training.distill_scorer import DistillScorerConfig
from overstory.training.planner_common import grpo_args
from overstory.training.planner_grpo import PlannerGrpoConfig
from overstory.training.planner_sft import PlannerSftConfig
from overstory.training.sft import checkpointing_field, sft_args
from overstory.training.stitch import StitchConfig, stitch_grpo_args, stitch_sft_args

ROOT = Path(__file__).resolve().parents[2]
SFT_YAML, GRPO_YAML = ROOT / "configs/train/planner_sft.yaml", ROOT / "configs/train/planner_grpo.yaml"
STITCH_YAML = ROOT / "configs/train/stitch.yaml"


def test_trl_fields_reach_the_sft_config(tmp_path: Path) -> None:
    config = load_config(PlannerSftConfig, SFT_YAML, [f"out={tmp_path}", "trl.lr_scheduler_type=cosine",
                                                      "trl.packing=true", "trl.report_to=[tensorboard]"])
    args = sft_args(config, evaluate=False)
    assert args.lr_scheduler_type == "cosine" and args.packing and args.report_to == ["tensorboard"]
    assert args.learning_rate == config.train.lr and args.output_dir == str(tmp_path / "checkpoints")  # recipe's own


def test_gradient_checkpointing_reaches_the_field_the_installed_transformers_reads(tmp_path: Path) -> None:
    """transformers 5.23 renamed TrainingArguments' ``gradient_checkpointing`` to ``activation_checkpointing`` (the
    old name a deprecated alias); older releases refuse the new name, so the recipe gives whichever exists."""
    for enabled in (True, False):
        config = load_config(PlannerSftConfig, SFT_YAML, [f"out={tmp_path}", f"train.gradient_checkpointing={enabled}"])
        args = sft_args(config, evaluate=False)
        assert getattr(args, checkpointing_field()) is enabled and args.gradient_checkpointing is enabled


def test_trl_fields_reach_the_grpo_config_and_vllm_colocation_is_reachable(tmp_path: Path) -> None:
    config = load_config(PlannerGrpoConfig, GRPO_YAML, [f"out={tmp_path}", "trl.optim=adafactor",
                                                        "trl.use_vllm=true", "trl.vllm_mode=colocate"])
    args = grpo_args(config.train, tmp_path, [1.0], config.trl, "trl")
    assert (args.optim, args.use_vllm, args.vllm_mode) == ("adafactor", True, "colocate")
    assert args.learning_rate == config.train.lr and args.num_generations == config.train.num_generations


GPU_GRPO_YAML = ROOT / "configs/train/planner_grpo-qwen2.5-1.5b.yaml"


def test_the_gpu_grpo_config_rolls_out_on_vllm_colocated_or_on_a_server(tmp_path: Path) -> None:
    """The paper-scale config builds GRPOConfig with TRL's vLLM rollouts in each process; two TRL fields move them to
    a server. (On CPU neither mode can update vLLM's weights: TRL 1.16 syncs them over NCCL, docs/training.md.)"""
    here = [f"out={tmp_path}", "train.bf16=false"]  # TrainingArguments refuses bf16 on a machine without a GPU
    config = load_config(PlannerGrpoConfig, GPU_GRPO_YAML, here)
    args = grpo_args(config.train, tmp_path, [1.0], config.trl, "trl")
    assert (args.use_vllm, args.vllm_mode, args.vllm_gpu_memory_utilization) == (True, "colocate", 0.3)
    assert args.num_generations == 8 and args.loss_type == "dapo" and args.steps_per_generation == 16
    server = load_config(PlannerGrpoConfig, GPU_GRPO_YAML, [*here, "trl.vllm_mode=server",
                                                            "trl.vllm_server_base_url=http://10.0.0.2:8000"])
    args = grpo_args(server.train, tmp_path, [1.0], server.trl, "trl")
    assert (args.use_vllm, args.vllm_mode, args.vllm_server_base_url) == (True, "server", "http://10.0.0.2:8000")


def test_a_misspelt_trl_field_is_refused_with_the_closest_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'trl.lr_sheduler_type': not a field of trl.SFTConfig; "
                                          r"did you mean 'trl.lr_scheduler_type'\?"):
        load_config(PlannerSftConfig, SFT_YAML, [f"out={tmp_path}", "trl.lr_sheduler_type=cosine"])
    with pytest.raises(ConfigError, match=r"'trl_grpo.num_generation'.*did you mean 'trl_grpo.num_generations'"):
        load_config(StitchConfig, STITCH_YAML, [f"out={tmp_path}", "trl_grpo.num_generation=4"])


@pytest.mark.parametrize(("cls", "path", "override", "message"), [
    (PlannerSftConfig, SFT_YAML, "trl.learning_rate=0.1", "trl.learning_rate is what train.lr sets"),
    (PlannerSftConfig, SFT_YAML, "trl.eval_strategy=steps", "trl.eval_strategy is what train.eval_at sets"),
    (PlannerSftConfig, SFT_YAML, "trl.save_strategy=steps", "trl.save_strategy is what train.save_steps sets"),
    # either name of activation checkpointing, whichever the installed transformers calls it
    (PlannerSftConfig, SFT_YAML, "trl.gradient_checkpointing=true", "is what train.gradient_checkpointing sets"),
    (PlannerGrpoConfig, GRPO_YAML, "trl.per_device_train_batch_size=4", "is what train.batch_size sets"),
    (StitchConfig, STITCH_YAML, "trl_sft.learning_rate=0.1", "trl_sft.learning_rate is what stitch.sft_lr sets"),
    (StitchConfig, STITCH_YAML, "trl_grpo.max_steps=3", "trl_grpo.max_steps is what stitch.grpo_steps sets"),
    # fields the recipe owns, refused saying why
    (PlannerSftConfig, SFT_YAML, "trl.output_dir=/tmp/x", r"trl.output_dir: the recipe sets it itself \(checkpoints"),
    (PlannerGrpoConfig, GRPO_YAML, "trl.reward_weights=[1.0]", "the rewards section's weights"),
    (PlannerSftConfig, SFT_YAML, "trl.push_to_hub=true", "set the recipe's push_to_hub"),
    (StitchConfig, STITCH_YAML, "trl_grpo.gradient_accumulation_steps=2", "STITCH sets each update's shape"),
    (StitchConfig, STITCH_YAML, "trl_sft.optim=adafactor", "carries Adam's moments across updates"),
])
def test_a_value_given_both_ways_or_owned_by_the_recipe_is_refused(cls: type, path: Path, override: str, message: str,
                                                                   tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(cls, path, [f"out={tmp_path}", override])


def test_vllm_fields_belong_to_vllm_server_url_only_when_it_is_set(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trl.vllm_mode is what train.vllm_server_url sets"):
        load_config(PlannerGrpoConfig, GRPO_YAML, [f"out={tmp_path}", "train.vllm_server_url=http://h:8000",
                                                   "trl.vllm_mode=colocate"])
    config = load_config(PlannerGrpoConfig, GRPO_YAML, [f"out={tmp_path}", "train.vllm_server_url=http://h:8000"])
    args = grpo_args(config.train, tmp_path, [1.0])
    assert (args.use_vllm, args.vllm_mode, args.vllm_server_base_url) == (True, "server", "http://h:8000")


@pytest.mark.parametrize(("save_steps", "eval_at", "saves", "evaluates"), [
    (0, "save", ("epoch", 500), ("epoch", None)), (0, "epoch", ("epoch", 500), ("epoch", None)),
    (20, "save", ("steps", 20), ("steps", 20)), (20, "epoch", ("steps", 20), ("epoch", None))])
def test_a_run_saves_often_and_evaluates_once_an_epoch_when_asked(
        save_steps: int, eval_at: str, saves: tuple, evaluates: tuple, tmp_path: Path) -> None:
    """``train.eval_at=epoch`` lets a long epoch checkpoint every ``save_steps`` (a killed run resumes) without an
    evaluation at each save; the LLM student and the cross-encoder get the same strategies from the same keys."""
    overrides = [f"out={tmp_path}", f"train.save_steps={save_steps}", f"train.eval_at={eval_at}"]
    args = sft_args(load_config(PlannerSftConfig, SFT_YAML, overrides), evaluate=True)
    assert (args.save_strategy, args.save_steps) == saves and (args.eval_strategy, args.eval_steps) == evaluates
    student = load_config(DistillScorerConfig, None, ["traces=t.jsonl", "student=cross_encoder", *overrides])
    kwargs = student.train.save_and_eval_kwargs(evaluate=True)
    assert (kwargs["eval_strategy"], kwargs["eval_steps"]) == evaluates
    assert student.train.save_and_eval_kwargs(evaluate=False)["eval_strategy"] == "no"


def test_an_unknown_eval_at_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.eval_at must be 'save' or 'epoch', got 'steps'"):
        load_config(PlannerSftConfig, SFT_YAML, [f"out={tmp_path}", "train.eval_at=steps"])


def test_the_cross_encoder_student_takes_no_trl_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trl applies to student=llm"):
        load_config(DistillScorerConfig, None, ["traces=t.jsonl", f"out={tmp_path}", "student=cross_encoder",
                                                "trl.lr_scheduler_type=cosine"])


def test_stitch_updates_get_their_sections_and_a_bad_value_is_a_config_error(tmp_path: Path) -> None:
    config = load_config(StitchConfig, STITCH_YAML, [f"out={tmp_path}", "trl_grpo.top_p=0.9",
                                                     "trl_sft.lr_scheduler_type=constant"])
    grpo, sft = stitch_grpo_args(config, [1.0], tmp_path, 3), stitch_sft_args(config, tmp_path, 3)
    assert grpo.top_p == 0.9 and grpo.gradient_accumulation_steps == 3 and sft.lr_scheduler_type == "constant"
    bad = load_config(StitchConfig, STITCH_YAML, [f"out={tmp_path}", "trl_sft.lr_scheduler_type=cosinus"])
    with pytest.raises(ConfigError, match="trl.SFTConfig refused .* trl_sft .lr_scheduler_type='cosinus'"):
        stitch_sft_args(bad, tmp_path, 3)


def test_the_gpu_stitch_config_rolls_out_its_grpo_updates_on_vllm(tmp_path: Path) -> None:
    config = load_config(StitchConfig, ROOT / "configs/train/stitch-qwen2.5-1.5b.yaml",
                         [f"out={tmp_path}", "grpo.bf16=false"])  # TrainingArguments refuses bf16 without a GPU
    grpo = stitch_grpo_args(config, [1.0], tmp_path, 1)
    assert (grpo.use_vllm, grpo.vllm_mode, grpo.vllm_gpu_memory_utilization) == (True, "colocate", 0.3)
    assert grpo.num_generations == 8 and grpo.learning_rate == 1e-6


def test_every_argument_a_recipe_builds_is_an_alias_an_owned_field_or_a_replaceable_default(tmp_path: Path) -> None:
    """The alias tables name every TRL field the short names set: a field missing from them would be given two
    ways without being refused."""
    config = load_config(PlannerSftConfig, SFT_YAML, [f"out={tmp_path}"])
    recipe = config.train.trl_kwargs(evaluate=True)
    # the aliases also refuse the checkpointing name this transformers does not read (sft.checkpointing_field)
    assert set(recipe) == set(config.train.trl_aliases()) - {"activation_checkpointing", "gradient_checkpointing"} | {
        checkpointing_field()}
    grpo = load_config(PlannerGrpoConfig, GRPO_YAML, [f"out={tmp_path}", "train.vllm_server_url=http://h:1"])
    assert set(grpo.train.update_kwargs()) | set(grpo.train.run_kwargs()) == set(grpo.train.trl_aliases())
