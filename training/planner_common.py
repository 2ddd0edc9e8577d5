"""What the planner's RL recipes (planner_grpo, STITCH) and the verl export share: the reward set with its
weights (R_QA's among them), the GRPO settings and arguments, and SFT rows from teacher traces.

``GrpoUpdateSettings`` is what every GRPO update needs (rate, loss, sampling); ``GrpoSettings`` adds planner_grpo's
batch shape and schedule (STITCH sets those per update). ``build_rewards`` returns the reward functions of
``training/rewards.py`` with nonzero weight and their weights, in GRPOConfig's order; R_QA's backend, the judge it
takes, is ``training/qa_judge.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from overstory.core.config import ConfigError
from overstory.core.records import PlannerTrace
from overstory.training.distributed import process_group_backend, trainer_device_args
from overstory.training.rewards import QAReward, align_reward, format_reward, make_cost_reward, make_length_reward
from overstory.training.trl_args import HUB_OWNED, build_args


@dataclass(frozen=True)
class RewardSettings:
    """Weights of R = gamma*R_format + beta*R_length + w_align*R_align + alpha*R_cost + w_qa*R_QA (0 drops a term)."""

    format: float = 1.0  # gamma: a JSON plan with valid levels
    length: float = 0.01  # beta: -ReLU(completion tokens - max_completion_tokens)
    align: float = 1.0  # overlap of the predicted range with the pseudo-label
    cost: float = 0.0  # alpha: minus the share of the document read
    qa: float = 0.0  # R_QA: needs the generator; each (question, range) is answered once and cached
    # L_max of R_length; in STITCH also the length a solving rollout stays within (its one completion-length limit)
    max_completion_tokens: int = 128
    k: int = 5  # chunks read per question (R_cost and R_QA)
    # R_QA's answers in flight per reward call (a batching server such as vLLM answers several at once) and each
    # answer's time limit (an answer past it is no signal: None)
    qa_concurrency: int = 1
    qa_request_timeout_s: float = 120.0
    # the share of one reward call's completions that may lack R_QA (transient failures: None) before the run stops
    # (QARewardError): above it the stack is down or overloaded, and the steps after would train without R_QA
    qa_max_none_share: float = 0.5
    # a folder where R_QA's answers are kept (qa_answers.jsonl, training/qa_judge.py): a resumed run, and later runs
    # on the same labels and stack (GRPO, then STITCH from the same SFT planner), read them back instead of asking
    # again; empty: asked anew each run. One process only
    qa_answers: str = ""

    def __post_init__(self) -> None:
        if self.qa_concurrency < 1 or self.qa_request_timeout_s <= 0:
            raise ConfigError(f"rewards.qa_concurrency must be >= 1 and rewards.qa_request_timeout_s positive, got "
                              f"{self.qa_concurrency} and {self.qa_request_timeout_s}")
        if not 0 <= self.qa_max_none_share <= 1:
            raise ConfigError(f"rewards.qa_max_none_share must be within [0, 1], got {self.qa_max_none_share}")


@dataclass(frozen=True)
class GrpoUpdateSettings:
    """What one GRPO update needs beyond its batch shape: the learning rate, the loss and the rollout sampling. STITCH
    takes only these (it sets each update's shape and schedule itself); planner_grpo's ``GrpoSettings`` adds them."""

    lr: float = 1e-6  # the paper's rate for Qwen2.5-1.5B; small LoRA runs on CPU use ~1e-4
    temperature: float = 1.0  # rollout sampling temperature
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = "dapo"  # TRL's loss normalisation
    epsilon: float = 0.2  # lower clip range of the policy ratio
    epsilon_high: float = 0.28  # DAPO's clip-higher
    beta: float = 0.0  # KL coefficient; DAPO drops the KL term
    mask_truncated_completions: bool = True  # DAPO's overlong filtering
    bf16: bool = False  # bf16 autocast (GPUs)

    def trl_aliases(self, prefix: str) -> dict[str, str]:
        """The TRL GRPOConfig field each short name sets (field -> its config key under ``prefix``)."""
        return {"learning_rate": f"{prefix}lr", **{name: f"{prefix}{name}" for name in (
            "temperature", "loss_type", "epsilon", "epsilon_high", "beta", "mask_truncated_completions", "bf16")}}

    def update_kwargs(self) -> dict:
        """GRPOConfig's arguments for these settings."""
        return dict(learning_rate=self.lr, temperature=self.temperature, loss_type=self.loss_type,
                    epsilon=self.epsilon, epsilon_high=self.epsilon_high, beta=self.beta,
                    mask_truncated_completions=self.mask_truncated_completions, bf16=self.bf16)


@dataclass(frozen=True)
class GrpoSettings(GrpoUpdateSettings):
    """planner_grpo's run: the update settings plus the batch shape, the schedule and where rollouts come from."""

    max_steps: int = 20  # optimizer steps
    num_generations: int = 8  # rollouts per prompt (G)
    batch_size: int = 8  # completions per device per step (a multiple of num_generations)
    grad_accum: int = 1  # micro-batches per optimizer step
    # micro-batches per generation batch: rollouts are generated for per-device batch x processes x this many
    # micro-batches at once, then trained on in steps_per_generation / grad_accum optimizer steps (the paper's
    # prompt batch 256 with mini-batch 64); 0: grad_accum, one optimizer step per generation
    steps_per_generation: int = 0
    max_completion_length: int = 128  # tokens per rollout
    logging_steps: int = 1  # log every this many steps
    save_steps: int = 10  # checkpoint every this many steps (a rerun resumes from the newest)
    seed: int = 0  # sampling and data order
    deepspeed: str = ""  # a DeepSpeed JSON config; the Trainer hands it to DeepSpeed
    vllm_server_url: str = ""  # a `trl vllm-serve` endpoint for rollouts; empty: transformers generate

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ConfigError("train.num_generations must be >= 2 (advantages are relative within a group)")
        if self.steps_per_generation and self.steps_per_generation % self.grad_accum:
            raise ConfigError(f"train.steps_per_generation ({self.steps_per_generation}) must be a multiple of "
                              f"train.grad_accum ({self.grad_accum}): whole optimizer steps per generation batch")
        if self.batch_size % self.num_generations:
            raise ConfigError(f"train.batch_size ({self.batch_size}) must be a multiple of train.num_generations "
                              f"({self.num_generations})")

    def trl_aliases(self, prefix: str = "train.") -> dict[str, str]:
        """The update's aliases and those of the batch shape and schedule; ``vllm_server_url`` sets the vLLM fields
        only when given (without it, a trl section may turn on vLLM itself, e.g. ``vllm_mode: colocate``)."""
        sets = {"max_steps": ["max_steps"], "batch_size": ["per_device_train_batch_size"],
                "grad_accum": ["gradient_accumulation_steps"], "steps_per_generation": ["steps_per_generation"],
                "num_generations": ["num_generations"], "max_completion_length": ["max_completion_length"],
                "logging_steps": ["logging_steps"], "save_steps": ["save_strategy", "save_steps"],
                "seed": ["seed", "data_seed"], "deepspeed": ["deepspeed"],
                "vllm_server_url": ["use_vllm", "vllm_mode", "vllm_server_base_url"] if self.vllm_server_url else []}
        return {**super().trl_aliases(prefix),
                **{trl_field: f"{prefix}{name}" for name, fields in sets.items() for trl_field in fields}}

    def run_kwargs(self) -> dict:
        """GRPOConfig's arguments for the batch shape, the schedule, checkpoints and rollouts."""
        vllm = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=self.vllm_server_url)
        return dict(
            max_steps=self.max_steps, per_device_train_batch_size=self.batch_size,
            gradient_accumulation_steps=self.grad_accum, steps_per_generation=self.steps_per_generation or None,
            num_generations=self.num_generations, max_completion_length=self.max_completion_length,
            logging_steps=self.logging_steps, save_strategy="steps", save_steps=self.save_steps,
            seed=self.seed, data_seed=self.seed, deepspeed=self.deepspeed or None,
            **(vllm if self.vllm_server_url else {}))


# GRPOConfig fields the GRPO recipes derive themselves: a trl section may not set them
GRPO_OWNED: dict[str, str] = {
    "output_dir": "checkpoints go to <out>/checkpoints, where a rerun resumes from the newest",
    "reward_weights": "the rewards section's weights, in the order of its reward functions",
    "remove_unused_columns": "the reward functions read the rows' own columns (labels, document ids)",
    "logging_nan_inf_filter": "StopOnNonFiniteLoss stops a run on a non-finite loss, which the filter would hide",
    **HUB_OWNED}


def grpo_args(settings: GrpoUpdateSettings, output_dir: str | Path, reward_weights: list[float],
              section: dict[str, Any] | None = None, key: str = "trl", **shape):
    """TRL's GRPOConfig for a planner GRPO update: the recipe's arguments, then ``section`` (the config's ``key``,
    checked by ``check_section`` when the config was loaded). planner_grpo's ``GrpoSettings`` carries its batch
    shape and schedule; STITCH passes its own as ``shape`` (GRPOConfig derives the generation batch from them when
    it is built, so they cannot be set afterwards)."""
    run = settings.run_kwargs() if isinstance(settings, GrpoSettings) else {}
    recipe = {"output_dir": str(output_dir), "reward_weights": reward_weights, "logging_nan_inf_filter": False,
              "remove_unused_columns": False, **settings.update_kwargs(), **run, **shape,
              # defaults a trl section may replace
              "report_to": "none", "ddp_backend": process_group_backend(), **trainer_device_args(),
              **({"save_total_limit": 2} if "save_strategy" in run else {})}
    return build_args("GRPOConfig", recipe, section or {}, key)


def trace_rows(traces: list[PlannerTrace]) -> list[dict]:
    """TRL's conversational prompt-completion rows (the loss covers the completion only)."""
    return [{"prompt": t.prompt, "completion": [{"role": "assistant", "content": t.completion}]} for t in traces]


def build_rewards(settings: RewardSettings, qa_judge: Callable[[str, str, str], bool] | None = None
                  ) -> tuple[list[Callable], list[float]]:
    """The reward functions with nonzero weight, and the weights (GRPOConfig.reward_weights order)."""
    candidates = [(settings.format, format_reward),
                  (settings.length, make_length_reward(settings.max_completion_tokens)),
                  (settings.align, align_reward), (settings.cost, make_cost_reward(settings.k))]
    if settings.qa:
        if qa_judge is None:
            raise ConfigError("rewards.qa > 0 needs the generator for R_QA (a served stack)")
        candidates.append((settings.qa, QAReward(qa_judge, settings.qa_concurrency, settings.qa_max_none_share)))
    chosen = [(weight, fn) for weight, fn in candidates if weight]
    if not chosen:
        raise ConfigError("rewards: every weight is 0; give at least one reward a weight")
    return [fn for _, fn in chosen], [weight for weight, _ in chosen]


def qa_reward_counts(reward_funcs: list[Callable]) -> dict[str, dict[str, int]]:
    """R_QA's rewards given this invocation and how many of them were missing (None: a transient failure), for a
    run's metrics beside the reward they affect; empty when R_QA is off."""
    qa = next((fn for fn in reward_funcs if isinstance(fn, QAReward)), None)
    return {} if qa is None else {"qa_rewards": {"given": qa.calls, "missing": qa.nones}}
