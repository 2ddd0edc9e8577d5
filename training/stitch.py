"""STITCH: GRPO on what the planner can solve, hints for what it almost can, SFT on what it cannot.

    overstory train stitch --config configs/train/stitch.yaml
    accelerate launch --config_file configs/accelerate/cpu-2proc-zero2.yaml -m overstory.cli train stitch \
        --config configs/train/stitch.yaml
    accelerate launch --config_file configs/accelerate/cpu-2proc-zero3.yaml -m overstory.cli train stitch \
        --config configs/train/stitch.yaml

The loop of the SmartChunk paper's Algorithm 2, per step:
1. Draw ``questions_per_step`` planner prompts and sample ``num_generations`` rollouts of each with
   the current policy. A question is *solvable* when one rollout is correct (its plan equals the
   pseudo-label) within ``rewards.max_completion_tokens`` (the run's one completion-length limit: R_length's
   L_max too); solvable prompts go to the RL buffer.
2. For the others, take a hint from the question's expert trace, written by ``traces_teacher`` (a trace file of
   several teachers without it is refused: which one hinted would be chance): its reasoning split into sentences,
   the first ``n`` of them, with ``n`` set from the running success rate (the paper's best strategy: the less the
   policy solves, the longer the hint), never the last sentence, where a trace states its conclusion, and ended
   before the first sentence that names a level of the label (an LLM teacher is told the label and may name it
   early; such cuts are counted, and every hinted prompt is checked for a level of its label: ``hint_leaks``).
   Roll out again with the hint appended to the prompt; solved -> RL buffer with the hinted prompt, still
   unsolved -> imitation buffer. A question without a trace goes to neither (counted: ``no_trace``).
3. A GRPO update (TRL's GRPOTrainer, DAPO loss, the rewards of ``training/rewards.py``) on the RL buffer,
   which is then cleared. With ``rewards.qa`` > 0, R_QA joins the rewards as in planner_grpo: SmartChunk
   retrieval over each rollout's range and the generator's answer, on a stack started for the run or
   ``server_url``.
4. When the imitation buffer holds ``imitation_threshold`` questions, an SFT update (TRL's SFTTrainer) on
   all their full expert traces (``sft_epochs`` passes), then the buffer is cleared; the step is logged as an
   SFT injection point with the number of traces trained on.

What TRL does not do and is written here: the routing of questions (rollouts, hints, buffers) and
the schedule. The updates themselves are TRL's trainers, built per update around the one shared
policy; each makes its own optimizer (DeepSpeed's, under ZeRO), and Adam's moments are carried from one update of a
kind to the next (``training/stitch_ranks.py``). Under ``accelerate launch`` (DDP, DeepSpeed ZeRO-2, or ZeRO-3, whose
partitioned policy passes from one update's engine to the next) the routing rollouts are split over the ranks and
gathered, every rank routes the same questions the same way (checked each step), and the updates are the trainers'
distributed ones (``training/stitch_ranks.py`` says how and why). Every step is logged (solve-none ratio,
hinted-solve ratio, buffer sizes, hint cuts and leaks, questions without a trace, the plain rollouts' format rates,
tolerant and strict, the GRPO update's optimizer steps, gradient norm and weight change, SFT injections, reward, every
rank's digest of its routing and of its adapter) to ``out/stitch_log.jsonl`` and the tracker. After each step the
adapter, both optimizers' states and the RNG state (one file per rank), the log and the loop state (with the settings
and the launch) are written to a staging folder and swapped whole into ``out/last``
(``training/checkpoint_state.py``): a rerun resumes after the last whole step, and refuses other settings (only
``stitch.steps`` may grow) or another
launch (the optimizer states are per rank).
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from overstory.core.config import ConfigError, to_dict
from overstory.core.records import PlannerTrace, read_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.planner_examples import PlannerDataConfig, planner_rows
from overstory.models.planner import normalise_level, parse_plan, strict_plan_valid
from overstory.models.registry import SMOLLM2, load_lm_checkpoint
from overstory.retrieval.judge import CorrectnessConfig
from overstory.serving.config import ServeConfig
from overstory.serving.job_client import client_for
from overstory.training import checkpoint_state, stitch_ranks
from overstory.training.common import LoraSettings, lora_config, write_manifest
from overstory.training.distributed import process_group_backend, trainer_device_args
from overstory.training.model_card import finish_checkpoint
from overstory.training.planner_common import (
    GRPO_OWNED,
    GrpoUpdateSettings,
    RewardSettings,
    build_rewards,
    grpo_args,
    qa_reward_counts,
    trace_rows,
)
from overstory.training.qa_judge import QAJudge
from overstory.training.stitch_ranks import CarryOptimizerState, RolloutFn, process_state
from overstory.training.trl_args import HUB_OWNED, build_args, check_section

STATE_FILE = "stitch_state.json"
# rollouts may run this many tokens past the length limit, so that an overlong plan is seen (and not solved)
LENGTH_MARGIN = 16


@dataclass(frozen=True)
class StitchSettings:
    steps: int = 10
    questions_per_step: int = 8
    num_generations: int = 8  # G, for routing and for the GRPO update
    imitation_threshold: int = 8  # T: SFT once the imitation buffer holds this many questions
    hint: Literal["adaptive", "fixed"] = "adaptive"
    fixed_hint_fraction: float = 0.5  # hint = this share of the trace's sentences when hint: fixed
    rollout_temperature: float = 1.0
    grpo_steps: int = 1  # optimizer steps per GRPO update
    sft_epochs: int = 1  # passes over the whole imitation buffer per SFT injection
    sft_batch_size: int = 8  # traces per SFT optimizer step
    sft_lr: float = 1e-4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_generations < 2 or self.questions_per_step < 1 or self.imitation_threshold < 1:
            raise ConfigError("stitch.num_generations (>= 2), questions_per_step and imitation_threshold "
                              "must be positive")
        if not 0 < self.fixed_hint_fraction < 1:
            raise ConfigError(f"stitch.fixed_hint_fraction must be in (0, 1), got {self.fixed_hint_fraction}")
        if self.grpo_steps < 1 or self.sft_epochs < 1 or self.sft_batch_size < 1:
            raise ConfigError("stitch.grpo_steps, sft_epochs and sft_batch_size must be positive")


@dataclass(frozen=True)
class StitchConfig:
    data: PlannerDataConfig
    traces: str  # expert traces (`overstory data traces`): hints and the imitation targets
    out: str
    # the teacher in `traces` whose traces supply the hints and imitation targets; empty: the file must hold
    # the traces of one teacher only (a file of several is refused, naming them)
    traces_teacher: str = ""
    model: str = SMOLLM2  # a base model or a planner_sft output
    lora: LoraSettings = field(default_factory=LoraSettings)
    # rewards.max_completion_tokens is also the length a solving rollout stays within
    rewards: RewardSettings = field(default_factory=RewardSettings)
    grpo: GrpoUpdateSettings = field(default_factory=GrpoUpdateSettings)  # each update's shape is STITCH's own
    stitch: StitchSettings = field(default_factory=StitchSettings)
    correctness: CorrectnessConfig = field(default_factory=CorrectnessConfig)  # for R_QA (rewards.qa > 0)
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))  # R_QA's generator
    server_url: str = ""  # R_QA on a running stack (a URL or stack.json) instead of one started for this run
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # TRL GRPOConfig / SFTConfig fields passed through to each update's arguments (docs/training.md)
    trl_grpo: dict[str, Any] = field(default_factory=dict)
    trl_sft: dict[str, Any] = field(default_factory=dict)
    push_to_hub: str = ""  # a hub repo id: out/final and its model card are uploaded there at the end

    def __post_init__(self) -> None:
        check_section(self.trl_grpo, "trl_grpo", "GRPOConfig", *grpo_trl_rules(self))
        check_section(self.trl_sft, "trl_sft", "SFTConfig", *sft_trl_rules())


# TRL fields STITCH derives for both updates: Adam's moments are carried from one update's optimizer to the next's
OPTIMIZER_OWNED = {name: "STITCH carries Adam's moments across updates, so every update's optimizer is the same AdamW"
                   for name in ("optim", "optim_args", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon")}
SAVE_OWNED = {"save_strategy": "STITCH saves each whole step itself, into out/last"}


def grpo_trl_rules(config: StitchConfig) -> tuple[dict[str, str], dict[str, str]]:
    """What ``trl_grpo`` may not set: the fields a config key sets (field -> key) and those STITCH owns (-> why)."""
    aliases = {**config.grpo.trl_aliases("grpo."), "max_steps": "stitch.grpo_steps",
               "num_generations": "stitch.num_generations", "seed": "stitch.seed", "data_seed": "stitch.seed",
               "max_completion_length": "rewards.max_completion_tokens"}
    shape = "STITCH sets each update's shape: G rollouts of every RL-buffer prompt, one optimizer step"
    owned = {**GRPO_OWNED, **OPTIMIZER_OWNED, **SAVE_OWNED,
             **{name: shape for name in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                         "steps_per_generation")}}
    return aliases, owned


def sft_trl_rules() -> tuple[dict[str, str], dict[str, str]]:
    """What ``trl_sft`` may not set: the fields a config key sets (field -> key) and those STITCH owns (-> why)."""
    aliases = {"num_train_epochs": "stitch.sft_epochs", "learning_rate": "stitch.sft_lr",
               "per_device_train_batch_size": "stitch.sft_batch_size", "bf16": "grpo.bf16", "seed": "stitch.seed"}
    owned = {"output_dir": "each injection trains in out/sft", **HUB_OWNED, **OPTIMIZER_OWNED, **SAVE_OWNED}
    return aliases, owned


def stitch_grpo_args(config: StitchConfig, weights: list[float], out: Path, n_prompts: int):
    """A GRPO update's GRPOConfig: G rollouts of each of ``n_prompts`` prompts, ``grpo_steps`` optimizer steps (the
    batch's shape over the ranks: ``stitch_ranks.grpo_shape``); the Trainer's AdamW without weight decay."""
    settings, G = config.stitch, config.stitch.num_generations
    return grpo_args(config.grpo, out / "grpo", weights, config.trl_grpo, "trl_grpo", max_steps=settings.grpo_steps,
                     save_strategy="no", num_generations=G, **stitch_ranks.grpo_shape(G, n_prompts),
                     steps_per_generation=None, logging_steps=1, optim="adamw_torch", weight_decay=0.0,
                     **trainer_device_args(),
                     seed=settings.seed, data_seed=settings.seed,
                     max_completion_length=config.rewards.max_completion_tokens + LENGTH_MARGIN)


def stitch_sft_args(config: StitchConfig, out: Path, n_traces: int):
    """An SFT injection's SFTConfig: ``sft_epochs`` passes over ``n_traces`` traces, ``sft_batch_size`` a step over
    all ranks; the Trainer's AdamW without weight decay."""
    settings = config.stitch
    recipe = {"output_dir": str(out / "sft"), "num_train_epochs": settings.sft_epochs,
              "learning_rate": settings.sft_lr,
              "per_device_train_batch_size": stitch_ranks.sft_batch(settings.sft_batch_size, n_traces),
              "save_strategy": "no", "bf16": config.grpo.bf16, "seed": settings.seed, "optim": "adamw_torch",
              "weight_decay": 0.0, **trainer_device_args(),
              # defaults trl_sft may replace
              "report_to": "none", "logging_steps": 1, "completion_only_loss": True,
              "ddp_backend": process_group_backend()}
    return build_args("SFTConfig", recipe, config.trl_sft, "trl_sft")


def hint_traces(path: str | Path, teacher: str) -> dict[str, PlannerTrace]:
    """The traces of the teacher that supplies hints and imitation targets, by question id. Without ``teacher``
    the file must hold one teacher's traces: with several, which one a question's hint came from would be chance."""
    traces = list(read_jsonl(path, PlannerTrace))
    if not traces:
        raise ValueError(f"{path} holds no traces; STITCH needs expert traces for hints and imitation")
    found = sorted({t.teacher for t in traces})
    if not teacher and len(found) > 1:
        raise ConfigError(f"{path} holds the traces of several teachers ({', '.join(found)}): set traces_teacher "
                          f"to the one whose traces supply the hints and imitation targets")
    if teacher and teacher not in found:
        raise ConfigError(f"traces_teacher {teacher!r} wrote no trace in {path} (its teachers: {', '.join(found)})")
    picked = [t for t in traces if t.teacher == (teacher or found[0])]
    by_question = {t.question_id: t for t in picked}
    if len(by_question) < len(picked):
        raise ValueError(f"{path} holds several traces of one question from teacher {teacher or found[0]!r}")
    return by_question


def trace_sentences(completion: str) -> list[str]:
    """The reasoning of an expert trace as sentences, without its final JSON plan.

    >>> trace_sentences('Short fact. It sits in one sentence!\\n{"largest_chunk_size": "sentence"}')
    ['Short fact.', 'It sits in one sentence!']
    """
    reasoning = completion[: completion.rfind("{")] if "{" in completion else completion
    return [s for s in re.split(r"(?<=[.!?])\s+", reasoning.strip()) if s]


def names_label(text: str, level_min: str, level_max: str) -> bool:
    """True when ``text`` names a level of the label, in any spelling the planner's parser accepts.

    >>> names_label("The answer sits in one paragraph.", "sentence", "paragraph")
    True
    >>> names_label("The evidence is one compact statement.", "sentence", "paragraph")
    False
    """
    return bool({normalise_level(word) for word in re.findall(r"[A-Za-z-]+", text)} & {level_min, level_max})


def hint_length(n_sentences: int, success_rate: float, settings: StitchSettings) -> int:
    """How many of the trace's sentences the hint reveals: more when the policy solves less, never the last one
    (a trace concludes there, with the answer; a hint holding it would measure copying, not solving). A trace of
    one sentence gives no hint (0): its question goes to imitation.

    >>> s = StitchSettings()
    >>> hint_length(4, 0.0, s), hint_length(4, 0.5, s), hint_length(4, 1.0, s), hint_length(1, 0.0, s)
    (3, 2, 1, 0)
    """
    fraction = settings.fixed_hint_fraction if settings.hint == "fixed" else 1.0 - success_rate
    return min(n_sentences - 1, max(1, math.ceil(fraction * n_sentences)))


def hint_for(trace: PlannerTrace, row: dict, success_rate: float, settings: StitchSettings) -> tuple[str, bool]:
    """The hint a trace gives (empty for none) and whether it was cut: the first ``hint_length`` sentences, ended
    before the first sentence that names a level of the label (an LLM teacher is told the label and may name it
    early; a hint must not pass it on).

    >>> row = {"level_min": "sentence", "level_max": "paragraph"}
    >>> trace = PlannerTrace("q/t", "q", "d", "t", [], "A date. One paragraph holds it. So it is clear. {}", {}, 9)
    >>> hint_for(trace, row, 0.0, StitchSettings())
    ('A date.', True)
    """
    sentences = trace_sentences(trace.completion)
    wanted = sentences[: hint_length(len(sentences), success_rate, settings)] if sentences else []
    for i, sentence in enumerate(wanted):
        if names_label(sentence, row["level_min"], row["level_max"]):
            return " ".join(wanted[:i]), True
    return " ".join(wanted), False


def with_hint(prompt: list[dict[str, str]], hint: str) -> list[dict[str, str]]:
    """The prompt with the hint appended to the user's turn."""
    return [*prompt[:-1], {**prompt[-1], "content": f"{prompt[-1]['content']}\n\nHint: {hint}"}]


def solved(completions: Sequence[str], row: dict, count_tokens: Callable[[str], int], limit: int) -> bool:
    """True when some completion's plan equals the label within the length limit."""
    return any(parse_plan(c).levels == (row["level_min"], row["level_max"]) and count_tokens(c) <= limit
               for c in completions)


@dataclass
class Routing:
    rl: list[dict] = field(default_factory=list)  # rows to reinforce (hinted prompt when a hint was needed)
    imitation: list[dict] = field(default_factory=list)  # rows whose expert trace the policy will imitate
    solved_plain: int = 0
    solved_hinted: int = 0
    unsolved: int = 0
    no_trace: int = 0  # unsolved questions without a trace of the hint teacher: in neither buffer
    hinted: int = 0  # questions rolled out again with a hint
    hint_cuts: int = 0  # hints ended early because a sentence named a level of the label
    hint_leaks: int = 0  # hinted prompts whose hint names a level of the label (the check; 0 unless a bug)
    format_valid: float = 0.0  # share of the plain rollouts that parse to a plan (the tolerant parser)
    format_valid_strict: float = 0.0  # share of them in the exact format the prompt asks for (strict_plan_valid)


def hinted_rows(rows: list[dict], traces: dict[str, PlannerTrace], success_rate: float, settings: StitchSettings,
                outcome: Routing) -> list[dict]:
    """The unsolved rows with a hint in their prompt; those without a trace, or whose trace gives no hint, are
    counted (and the latter sent to imitation) here. Every hinted prompt is checked for a level of its label."""
    hinted = []
    for row in rows:
        trace = traces.get(row["example_id"])
        hint, cut = hint_for(trace, row, success_rate, settings) if trace else ("", False)
        outcome.hint_cuts += cut
        if not hint:  # no trace: neither buffer; no reasoning to hint with but the conclusion: imitate the trace
            outcome.no_trace += trace is None
            outcome.imitation.extend([row] if trace else [])
            outcome.unsolved += 1
            continue
        prompt = with_hint(row["prompt"], hint)
        outcome.hint_leaks += names_label(prompt[-1]["content"].rsplit("\n\nHint: ", 1)[1], row["level_min"],
                                          row["level_max"])
        hinted.append({**row, "prompt": prompt})
    outcome.hinted = len(hinted)
    return hinted


def route(rows: list[dict], rollout: RolloutFn, traces: dict[str, PlannerTrace], success_rate: float,
          settings: StitchSettings, count_tokens: Callable[[str], int], limit: int) -> Routing:
    """Steps 1-2 of a STITCH step: sort questions into the RL and imitation buffers (``limit``: the most tokens a
    solving completion has)."""
    G, outcome = settings.num_generations, Routing()
    first = rollout([r["prompt"] for r in rows], G)
    plain = [c for completions in first for c in completions]
    outcome.format_valid = sum(parse_plan(c).valid for c in plain) / max(len(plain), 1)
    outcome.format_valid_strict = sum(strict_plan_valid(c) for c in plain) / max(len(plain), 1)
    needs_hint = []
    for row, completions in zip(rows, first, strict=True):
        if solved(completions, row, count_tokens, limit):
            outcome.rl.append(row)
            outcome.solved_plain += 1
        else:
            needs_hint.append(row)
    hinted = hinted_rows(needs_hint, traces, success_rate, settings, outcome)
    second = rollout([r["prompt"] for r in hinted], G) if hinted else []
    for row, completions in zip(hinted, second, strict=True):
        if solved(completions, row, count_tokens, limit):
            outcome.rl.append(row)
            outcome.solved_hinted += 1
        else:
            outcome.imitation.append(row)
            outcome.unsolved += 1
    return outcome

@dataclass
class Policy:
    """The one policy every update trains; the last update's Trainer (whose wrapper the rollouts unwrap, and whose
    ``save_model`` saves the adapter) and each update kind's optimizer state, carried to the next update of its kind."""

    model: object
    tokenizer: object
    base: str
    trainable: list[torch.nn.Parameter]
    optimizer_states: dict[str, dict | None]
    trainer: Any = None

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def policy_rollout(policy: Policy, settings: StitchSettings, max_new_tokens: int) -> RolloutFn:
    """Sample G completions per prompt with the current policy (transformers generate, left padding); under the
    launcher each rank samples its share of the prompts and every rank gets every completion."""

    @torch.no_grad()
    def rollout(prompts: list[list[dict[str, str]]], n: int) -> list[list[str]]:
        tokenizer = policy.tokenizer
        with stitch_ranks.generation_model(policy.model, policy.trainer) as model:
            if not prompts:
                return []
            model.eval()
            tokenizer.padding_side = "left"
            texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            # each rank generates its own share alone: under ZeRO-3 the weights are gathered whole for the rollout,
            # so no forward needs the other ranks, and transformers' default there (synced_gpus: step with every
            # rank until all finish) would wait forever on a rank with no prompts of its own
            output = model.generate(**batch, do_sample=True, temperature=settings.rollout_temperature,
                                    max_new_tokens=max_new_tokens, num_return_sequences=n,
                                    pad_token_id=tokenizer.pad_token_id, synced_gpus=False)
            model.train()
        decoded = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        return [decoded[i * n: (i + 1) * n] for i in range(len(prompts))]

    return stitch_ranks.split_rollout(rollout)


def resume_settings(config: StitchConfig) -> dict:
    """What decides a STITCH run's training: the whole config but its length (``stitch.steps``, which a resume
    extends), where it is written and tracked, and where R_QA's stack listens."""
    settings = to_dict(config)
    for key in ("out", "tracking", "server_url", "push_to_hub"):
        settings.pop(key)
    settings["stitch"].pop("steps")
    settings["serve"].pop("port")
    return settings


def resume_state(config: StitchConfig, last: Path) -> dict | None:
    """The loop state of the last whole step saved in ``last`` (None: a fresh run); refused under other settings or
    another launch. The main process reads it first (reading finishes or undoes a swap that a kill interrupted)."""
    with process_state().main_process_first():
        state = checkpoint_state.read_state(last, STATE_FILE)
    if state is not None:
        checkpoint_state.check_settings(state, resume_settings(config), last)
        stitch_ranks.check_launch(state.get("launch"), last)
        if process_state().is_main_process:
            print(f"resuming STITCH after step {state['step']}")
    return state


def load_policy(config: StitchConfig, last: Path, resumed: dict | None) -> Policy:
    """The policy with a LoRA adapter (the saved one on a resume), and on a resume this rank's optimizer states and
    RNG state. The updates' optimizers are the Trainers' AdamW without weight decay (as in planner_sft /
    planner_grpo): the weights move only where a gradient moved them, which is what grpo_weight_change reports."""
    from peft import PeftModel, get_peft_model

    model, tokenizer, base = load_lm_checkpoint(str(last) if resumed else config.model)
    if not isinstance(model, PeftModel):
        if not config.lora.enabled:
            raise ConfigError("stitch trains a LoRA adapter; set lora.enabled: true")
        model = get_peft_model(model, lora_config(config.lora))
    trainable = [p for p in model.parameters() if p.requires_grad]
    states = stitch_ranks.load_rank_state(last, ("grpo", "sft")) if resumed else {"grpo": None, "sft": None}
    return Policy(model, tokenizer, base, trainable, states)


def grpo_update(policy: Policy, rl: list[dict], config: StitchConfig, reward_funcs: list, weights: list[float],
                out: Path) -> dict:
    """GRPO on the RL buffer (TRL regenerates on-policy rollouts of these prompts): one generation batch = G
    rollouts of every buffered prompt, ``grpo_steps`` optimizer steps, so the whole buffer shapes each update.
    Returns what the step log shows of it."""
    from datasets import Dataset
    from trl import GRPOTrainer

    args = stitch_grpo_args(config, weights, out, len(rl))
    stitch_ranks.retire(policy.trainer)
    trainer = GRPOTrainer(model=policy.model, reward_funcs=reward_funcs, args=args, processing_class=policy.tokenizer,
                          train_dataset=Dataset.from_list(rl),
                          callbacks=[CarryOptimizerState(policy.optimizer_states, "grpo")])
    policy.trainer = trainer
    with stitch_ranks.gathered(policy.trainable):  # whole under ZeRO-3, where the engine partitions them
        before = [p.detach().clone() for p in policy.trainable]
    trainer.train()
    with stitch_ranks.gathered(policy.trainable):
        change = float(sum((p.detach() - b).abs().sum() for p, b in zip(policy.trainable, before, strict=True)))
    logged = next((r for r in reversed(trainer.state.log_history) if "reward" in r), {})
    # proof of an update: optimizer steps taken, their gradient norm (0 when every group's rewards were flat: zero
    # advantages) and how far the trainable (LoRA) weights moved; each reward's mean (TRL's rewards/<name>/mean)
    return {"reward": logged.get("reward"), "grpo_updates": trainer.state.global_step,
            "rewards": {key.split("/")[1]: value for key, value in logged.items()
                        if key.startswith("rewards/") and key.endswith("/mean")},
            "grpo_grad_norm": logged.get("grad_norm"),
            "grpo_weight_change": change}


def sft_update(policy: Policy, imitation: list[PlannerTrace], config: StitchConfig, out: Path) -> dict:
    """SFT on every trace of the imitation buffer (``sft_epochs`` passes, ``sft_batch_size`` traces a step)."""
    from datasets import Dataset
    from trl import SFTTrainer

    args = stitch_sft_args(config, out, len(imitation))
    stitch_ranks.retire(policy.trainer)
    trainer = SFTTrainer(model=policy.model, args=args, processing_class=policy.tokenizer,
                         train_dataset=Dataset.from_list(trace_rows(imitation)),
                         callbacks=[CarryOptimizerState(policy.optimizer_states, "sft")])
    policy.trainer = trainer
    loss = trainer.train().training_loss
    return {"sft_injection": True, "sft_loss": loss, "sft_examples": len(imitation),
            "sft_optimizer_steps": trainer.state.global_step}


def step_record(step: int, batch: list[dict], routing: Routing, state: dict) -> dict:
    """The step log's routing figures (the updates add theirs), with every rank's digest of the routing (all equal:
    ``stitch_ranks.digests_by_rank`` stops the run otherwise)."""
    n, plain = len(batch), routing.solved_plain
    counts = {"questions": n, "solved_plain": plain, "solved_hinted": routing.solved_hinted,
              "unsolved": routing.unsolved, "no_trace": routing.no_trace, "hinted": routing.hinted,
              "hint_cuts": routing.hint_cuts, "hint_leaks": routing.hint_leaks}
    digest = stitch_ranks.routing_digest(routing.rl, routing.imitation, counts)
    return {"step": step, "questions": n, "solve_none_ratio": 1 - plain / n,
            "hinted_solve_ratio": routing.solved_hinted / max(1, n - plain), "rl_buffer": len(routing.rl),
            "imitation_buffer": len(state["imitation"]), "no_trace": routing.no_trace, "hinted": routing.hinted,
            "hint_cuts": routing.hint_cuts, "hint_leaks": routing.hint_leaks, "success_rate": state["success_rate"],
            "format_valid": routing.format_valid, "format_valid_strict": routing.format_valid_strict,
            "routing_by_rank": stitch_ranks.digests_by_rank(digest, step), "grpo_updates": 0, "sft_injection": False}


def train_step(step: int, rows: list[dict], traces: dict[str, PlannerTrace], policy: Policy, state: dict,
               config: StitchConfig, rewards: tuple[list, list[float]], rollout: RolloutFn) -> dict:
    """One STITCH step: route a draw of questions, GRPO on the RL buffer, SFT once the imitation buffer is full.
    Updates ``state`` and returns the step's record (with its wall-clock ``seconds``)."""
    settings, out, started = config.stitch, Path(config.out), time.perf_counter()
    batch = random.Random(settings.seed * 100_003 + step).sample(rows, min(settings.questions_per_step, len(rows)))
    routing = route(batch, rollout, traces, state["success_rate"], settings, policy.count_tokens,
                    config.rewards.max_completion_tokens)
    state["success_rate"] = 0.8 * state["success_rate"] + 0.2 * (routing.solved_plain / len(batch))
    state["imitation"].extend(r["example_id"] for r in routing.imitation)
    record = step_record(step, batch, routing, state)
    if routing.rl:
        record.update(grpo_update(policy, routing.rl, config, *rewards, out))
    if len(state["imitation"]) >= settings.imitation_threshold:
        record.update(sft_update(policy, [traces[i] for i in state["imitation"]], config, out))
        state["imitation"] = []
    record["adapter_by_rank"] = stitch_ranks.adapter_by_rank(policy.model, policy.trainable)
    record["seconds"] = round(time.perf_counter() - started, 2)
    state["step"] = step
    state["history"].append(record)
    return record


def save_step(policy: Policy, state: dict, out: Path) -> None:
    """The step's adapter (every rank takes part), each rank's optimizer and RNG states, and the log into a staging
    folder; the loop state last, swapped into ``out/last`` whole by the main process; then the log beside it
    (rewritten from the state's history, so it never repeats a step)."""
    ranks = process_state()
    staging = checkpoint_state.staging_path(out / "last")
    if ranks.is_main_process:
        checkpoint_state.start_step(out / "last")
    ranks.wait_for_everyone()
    stitch_ranks.save_weights(policy.model, policy.tokenizer, policy.trainer, staging)
    stitch_ranks.save_rank_state(staging, policy.optimizer_states)
    ranks.wait_for_everyone()
    if ranks.is_main_process:
        log = "".join(json.dumps(record) + "\n" for record in state["history"])
        (staging / "stitch_log.jsonl").write_text(log)
        checkpoint_state.commit(out / "last", state, STATE_FILE)
        checkpoint_state.atomic_write_text(out / "stitch_log.jsonl", log)
    ranks.wait_for_everyone()


def finish(policy: Policy, state: dict, config: StitchConfig, extra: dict, tracker) -> dict:
    """``out/final`` (adapter, tokenizer, manifest; the adapter saved by every rank, the rest by the main process)
    and ``metrics.json``; returns the summary."""
    out, history = Path(config.out), state["history"]
    final = out / "final"
    stitch_ranks.save_weights(policy.model, policy.tokenizer, policy.trainer, final)
    totals = {key: sum(r.get(key, 0) for r in history) for key in ("hint_cuts", "hint_leaks", "no_trace",
                                                                   "sft_examples")}
    summary = {"steps": state["step"], "sft_injections": sum(r["sft_injection"] for r in history),
               "final_success_rate": state["success_rate"], **totals, **extra}
    if tracker is None:  # not the main process
        return summary
    manifest = {"kind": "planner", "base_model": policy.base, "adapter": True, "recipe": "stitch",
                "init": config.model, "config": to_dict(config), "tracking_run": tracker.id}
    write_manifest(final, {**manifest, "metrics": summary})
    (out / "metrics.json").write_text(json.dumps({**summary, "history": history}, indent=2))
    finish_checkpoint(final, manifest, {"data.labels": config.data.labels, "traces": config.traces}, summary, "peft",
                      config.push_to_hub)
    tracker.summary(summary)
    tracker.finish()
    return summary


def run(config: StitchConfig) -> dict:
    # --- setup -------------------------------------------------------------------------------------
    settings, out, ranks = config.stitch, Path(config.out), process_state()
    stitch_ranks.check_generations(settings.num_generations)
    random.seed(settings.seed)
    torch.manual_seed(settings.seed)
    resumed = resume_state(config, out / "last")
    state = resumed or {"step": 0, "success_rate": 0.0, "imitation": [], "history": [],
                        "settings": resume_settings(config), "launch": stitch_ranks.launch_record()}
    policy = load_policy(config, out / "last", resumed)
    rows, _, chunks = planner_rows(config.data, policy.base)
    traces = hint_traces(config.traces, config.traces_teacher)
    rollout = policy_rollout(policy, settings, config.rewards.max_completion_tokens + LENGTH_MARGIN)
    tracker = start_run(config.tracking, "train stitch", config) if ranks.is_main_process else None
    started = time.perf_counter()
    with ExitStack() as stack:  # R_QA's stack, when rewards.qa is on: stopped when training ends or fails
        judge = None
        if config.rewards.qa:
            client = stack.enter_context(client_for(config.serve, config.server_url,
                                                    timeout_s=config.rewards.qa_request_timeout_s))
            judge = QAJudge(rows, chunks, client, config.correctness, config.rewards.k, kept=config.rewards.qa_answers)
            stack.callback(judge.close)
        rewards = build_rewards(config.rewards, judge)
        stitch_grpo_args(config, rewards[1], out, 1)  # TRL refuses a bad trl_grpo / trl_sft value here, not
        stitch_sft_args(config, out, 1)  # at the first update

        # --- train and save each step ------------------------------------------------------------------
        for step in range(state["step"] + 1, settings.steps + 1):
            record = train_step(step, rows, traces, policy, state, config, rewards, rollout)
            save_step(policy, state, out)
            if tracker:
                tracker.log(record, step=step)
                print(json.dumps(record))

    # --- save --------------------------------------------------------------------------------------
    return finish(policy, state, config, {"n_prompts": len(rows), "n_traces": len(traces),
                                          "traces_teacher": next(iter(traces.values())).teacher,
                                          "seconds": round(time.perf_counter() - started, 1),
                                          **({"qa_answers": judge.counts} if judge and judge.counts else {}),
                                          **qa_reward_counts(rewards[0])},
                  tracker)
