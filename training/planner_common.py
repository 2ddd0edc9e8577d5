"""What the planner's RL recipes (planner_grpo, STITCH) and the verl export share: the reward set with its
weights, R_QA's judge, the GRPO arguments, and SFT rows from teacher traces.

``build_rewards`` returns the reward functions of ``training/rewards.py`` with nonzero weight and their
weights, in GRPOConfig's order. ``make_qa_judge`` is R_QA's backend: SmartChunk retrieval over the predicted
range of the question's document plus the generator, judged by the same correctness rule as the pseudo-labels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from overstory.core.config import ConfigError
from overstory.core.records import Chunk, PlannerTrace
from overstory.retrieval.answer import clean_answer
from overstory.retrieval.judge import CorrectnessConfig, is_correct
from overstory.retrieval.smartchunk import DocumentRetrievers
from overstory.serving.client import Client
from overstory.training.distributed import process_group_backend
from overstory.training.rewards import QAReward, align_reward, format_reward, make_cost_reward, make_length_reward


@dataclass(frozen=True)
class RewardSettings:
    """Weights of R = gamma*R_format + beta*R_length + w_align*R_align + alpha*R_cost + w_qa*R_QA (0 drops a term)."""

    format: float = 1.0  # gamma: a JSON plan with valid levels
    length: float = 0.01  # beta: -ReLU(completion tokens - max_completion_tokens)
    align: float = 1.0  # overlap of the predicted range with the pseudo-label
    cost: float = 0.0  # alpha: minus the share of the document read
    qa: float = 0.0  # R_QA: needs the generator; each (question, range) is answered once and cached
    max_completion_tokens: int = 128  # L_max of R_length
    k: int = 5  # chunks read per question (R_cost and R_QA)


@dataclass(frozen=True)
class GrpoSettings:
    max_steps: int = 20  # optimizer steps
    lr: float = 1e-6  # the paper's rate for Qwen2.5-1.5B; small LoRA runs on CPU use ~1e-4
    num_generations: int = 8  # rollouts per prompt (G)
    batch_size: int = 8  # completions per device per step (a multiple of num_generations)
    grad_accum: int = 1  # micro-batches per optimizer step
    # micro-batches per generation batch: rollouts are generated for per-device batch x processes x this many
    # micro-batches at once, then trained on in steps_per_generation / grad_accum optimizer steps (the paper's
    # prompt batch 256 with mini-batch 64); 0: grad_accum, one optimizer step per generation
    steps_per_generation: int = 0
    max_completion_length: int = 128  # tokens per rollout
    temperature: float = 1.0  # rollout sampling temperature
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = "dapo"  # TRL's loss normalisation
    epsilon: float = 0.2  # lower clip range of the policy ratio
    epsilon_high: float = 0.28  # DAPO's clip-higher
    beta: float = 0.0  # KL coefficient; DAPO drops the KL term
    mask_truncated_completions: bool = True  # DAPO's overlong filtering
    logging_steps: int = 1  # log every this many steps
    save_steps: int = 10  # checkpoint every this many steps (a rerun resumes from the newest)
    seed: int = 0  # sampling and data order
    bf16: bool = False  # bf16 autocast (GPUs)
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


def grpo_args(settings: GrpoSettings, output_dir: str | Path, reward_weights: list[float], **overrides):
    """TRL's GRPOConfig for a planner GRPO run. STITCH passes its batch shape as ``overrides``: GRPOConfig derives
    the generation batch from them when it is built, so they cannot be set afterwards."""
    from trl import GRPOConfig

    return GRPOConfig(**{**dict(
        output_dir=str(output_dir), max_steps=settings.max_steps, learning_rate=settings.lr,
        per_device_train_batch_size=settings.batch_size, gradient_accumulation_steps=settings.grad_accum,
        steps_per_generation=settings.steps_per_generation or None,
        num_generations=settings.num_generations, max_completion_length=settings.max_completion_length,
        temperature=settings.temperature, loss_type=settings.loss_type, epsilon=settings.epsilon,
        epsilon_high=settings.epsilon_high, beta=settings.beta,
        mask_truncated_completions=settings.mask_truncated_completions, reward_weights=reward_weights,
        logging_steps=settings.logging_steps, logging_nan_inf_filter=False, save_strategy="steps",
        save_steps=settings.save_steps, save_total_limit=2, seed=settings.seed, data_seed=settings.seed,
        bf16=settings.bf16, deepspeed=settings.deepspeed or None, report_to="none", ddp_backend=process_group_backend(),
        use_vllm=bool(settings.vllm_server_url), vllm_mode="server",
        vllm_server_base_url=settings.vllm_server_url or None, remove_unused_columns=False), **overrides})


def trace_rows(traces: list[PlannerTrace]) -> list[dict]:
    """TRL's conversational prompt-completion rows (the loss covers the completion only)."""
    return [{"prompt": t.prompt, "completion": [{"role": "assistant", "content": t.completion}]} for t in traces]


def make_qa_judge(rows: list[dict], chunks: list[Chunk], client: Client, correctness: CorrectnessConfig,
                  k: int, max_answer_tokens: int = 24) -> Callable[[str, str, str], bool]:
    """answer_correct(example_id, level_min, level_max) for ``QAReward``."""
    by_id = {r["example_id"]: r for r in rows}
    retrievers = DocumentRetrievers(chunks, client)

    def answer_correct(example_id: str, level_min: str, level_max: str) -> bool:
        example = by_id[example_id]
        reply, _ = retrievers[example["doc_id"]].answer(example["question"], level_min, level_max, k=k,
                                                        max_tokens=max_answer_tokens)
        return is_correct(clean_answer(reply.text), example["answers"], example["question"], correctness, client)

    return answer_correct


def build_rewards(settings: RewardSettings, qa_judge: Callable[[str, str, str], bool] | None = None
                  ) -> tuple[list[Callable], list[float]]:
    """The reward functions with nonzero weight, and the weights (GRPOConfig.reward_weights order)."""
    candidates = [(settings.format, format_reward),
                  (settings.length, make_length_reward(settings.max_completion_tokens)),
                  (settings.align, align_reward), (settings.cost, make_cost_reward(settings.k))]
    if settings.qa:
        if qa_judge is None:
            raise ConfigError("rewards.qa > 0 needs the generator for R_QA (a served stack)")
        candidates.append((settings.qa, QAReward(qa_judge)))
    chosen = [(weight, fn) for weight, fn in candidates if weight]
    if not chosen:
        raise ConfigError("rewards: every weight is 0; give at least one reward a weight")
    return [fn for _, fn in chosen], [weight for weight, _ in chosen]
