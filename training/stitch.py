"""STITCH: GRPO on what the planner can solve, hints for what it almost can, SFT on what it cannot.

    overstory train stitch --config configs/train/stitch.yaml

The loop of the SmartChunk paper's Algorithm 2, per step:
1. Draw ``questions_per_step`` planner prompts and sample ``num_generations`` rollouts of each with
   the current policy. A question is *solvable* when one rollout is correct (its plan equals the
   pseudo-label) within the length limit; solvable prompts go to the RL buffer.
2. For the others, take a hint from the question's expert trace: its reasoning split into sentences,
   the first ``n`` of them, with ``n`` set from the running success rate (the paper's best strategy:
   the less the policy solves, the longer the hint), never the last sentence, where a trace states its
   conclusion (the template teacher's traces name the chunk sizes only there). Roll out again with the
   hint appended to the prompt; solved -> RL buffer with the hinted prompt, still unsolved -> imitation buffer.
3. A GRPO update (TRL's GRPOTrainer, DAPO loss, the rewards of ``training/rewards.py``) on the RL buffer,
   which is then cleared. With ``rewards.qa`` > 0, R_QA joins the rewards as in planner_grpo: SmartChunk
   retrieval over each rollout's range and the generator's answer, on a stack started for the run or
   ``server_url``.
4. When the imitation buffer holds ``imitation_threshold`` questions, an SFT update (TRL's SFTTrainer) on
   their full expert traces, then the buffer is cleared; the step is logged as an SFT injection point.

What TRL does not do and is written here: the routing of questions (rollouts, hints, buffers) and
the schedule. The updates themselves are TRL's trainers, built per update around the one shared
policy, with optimizers created once and passed in so Adam's moments carry across updates. Every
step is logged (solve-none ratio, hinted-solve ratio, buffer sizes, the plain rollouts' format rates, tolerant
and strict, the GRPO update's optimizer steps, gradient norm and weight change, SFT injections, reward) to
``out/stitch_log.jsonl`` and the tracker; the adapter, both optimizers and the loop state are saved
after each step in ``out/last``, and a rerun resumes from there.
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
from typing import Literal

import torch

from overstory.core.config import ConfigError, to_dict
from overstory.core.records import PlannerTrace, read_jsonl
from overstory.core.tracking import TrackingConfig, start_run
from overstory.data_pipeline.planner_examples import PlannerDataConfig, planner_rows
from overstory.models.planner import parse_plan, strict_plan_valid
from overstory.models.registry import SMOLLM2, load_lm_checkpoint
from overstory.retrieval.judge import CorrectnessConfig
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig
from overstory.serving.launch import stack_in_background
from overstory.training.common import LoraSettings, lora_config, write_manifest
from overstory.training.distributed import process_group_backend, world_size
from overstory.training.planner_common import (
    GrpoSettings,
    RewardSettings,
    build_rewards,
    grpo_args,
    make_qa_judge,
    trace_rows,
)

# (prompts, number of rollouts each) -> completions, prompt by prompt: the policy, or a stand-in in tests
RolloutFn = Callable[[list[list[dict[str, str]]], int], list[list[str]]]


@dataclass(frozen=True)
class StitchSettings:
    steps: int = 10
    questions_per_step: int = 8
    num_generations: int = 8  # G, for routing and for the GRPO update
    imitation_threshold: int = 8  # T: SFT once the imitation buffer holds this many questions
    max_completion_tokens: int = 128  # solvable = a correct plan within this many tokens
    hint: Literal["adaptive", "fixed"] = "adaptive"
    fixed_hint_fraction: float = 0.5  # hint = this share of the trace's sentences when hint: fixed
    rollout_temperature: float = 1.0
    grpo_steps: int = 1  # optimizer steps per GRPO update
    sft_steps: int = 1  # optimizer steps per SFT injection
    sft_lr: float = 1e-4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_generations < 2 or self.questions_per_step < 1 or self.imitation_threshold < 1:
            raise ConfigError("stitch.num_generations (>= 2), questions_per_step and imitation_threshold "
                              "must be positive")
        if not 0 < self.fixed_hint_fraction < 1:
            raise ConfigError(f"stitch.fixed_hint_fraction must be in (0, 1), got {self.fixed_hint_fraction}")


@dataclass(frozen=True)
class StitchConfig:
    data: PlannerDataConfig
    traces: str  # expert traces (`overstory data traces`): hints and the imitation targets
    out: str
    model: str = SMOLLM2  # a base model or a planner_sft output
    lora: LoraSettings = field(default_factory=LoraSettings)
    rewards: RewardSettings = field(default_factory=RewardSettings)
    grpo: GrpoSettings = field(default_factory=GrpoSettings)
    stitch: StitchSettings = field(default_factory=StitchSettings)
    correctness: CorrectnessConfig = field(default_factory=CorrectnessConfig)  # for R_QA (rewards.qa > 0)
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))  # R_QA's generator
    server_url: str = ""  # R_QA on a running stack (a URL or stack.json) instead of one started for this run
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def trace_sentences(completion: str) -> list[str]:
    """The reasoning of an expert trace as sentences, without its final JSON plan.

    >>> trace_sentences('Short fact. It sits in one sentence!\\n{"largest_chunk_size": "sentence"}')
    ['Short fact.', 'It sits in one sentence!']
    """
    reasoning = completion[: completion.rfind("{")] if "{" in completion else completion
    return [s for s in re.split(r"(?<=[.!?])\s+", reasoning.strip()) if s]


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


def with_hint(prompt: list[dict[str, str]], hint: str) -> list[dict[str, str]]:
    """The prompt with the hint appended to the user's turn."""
    return [*prompt[:-1], {**prompt[-1], "content": f"{prompt[-1]['content']}\n\nHint: {hint}"}]


def solved(completions: Sequence[str], row: dict, count_tokens: Callable[[str], int], limit: int) -> bool:
    """True when some completion's plan equals the label within the length limit."""
    return any(parse_plan(c).levels == (row["level_min"], row["level_max"]) and count_tokens(c) <= limit
               for c in completions)


@dataclass
class Routing:
    rl: list[dict]  # rows to reinforce (hinted prompt when a hint was needed)
    imitation: list[dict]  # rows whose expert trace the policy will imitate
    solved_plain: int
    solved_hinted: int
    unsolved: int
    format_valid: float = 0.0  # share of the plain rollouts that parse to a plan (the tolerant parser)
    format_valid_strict: float = 0.0  # share of them in the exact format the prompt asks for (strict_plan_valid)


def route(rows: list[dict], rollout: RolloutFn, traces: dict[str, PlannerTrace], success_rate: float,
          settings: StitchSettings, count_tokens: Callable[[str], int]) -> Routing:
    """Steps 1-2 of a STITCH step: sort questions into the RL and imitation buffers."""
    G, limit = settings.num_generations, settings.max_completion_tokens
    outcome = Routing([], [], 0, 0, 0)
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
    hinted_rows = []
    for row in needs_hint:
        sentences = trace_sentences(traces[row["example_id"]].completion) if row["example_id"] in traces else []
        n_hint = hint_length(len(sentences), success_rate, settings) if sentences else 0
        if not n_hint:  # no reasoning to hint with but the conclusion: imitate the trace (when there is one)
            if row["example_id"] in traces:
                outcome.imitation.append(row)
            outcome.unsolved += 1
            continue
        hint = " ".join(sentences[:n_hint])
        hinted_rows.append({**row, "prompt": with_hint(row["prompt"], hint)})
    second = rollout([r["prompt"] for r in hinted_rows], G) if hinted_rows else []
    for row, completions in zip(hinted_rows, second, strict=True):
        if solved(completions, row, count_tokens, limit):
            outcome.rl.append(row)
            outcome.solved_hinted += 1
        else:
            outcome.imitation.append(row)
            outcome.unsolved += 1
    return outcome


def policy_rollout(model, tokenizer, settings: StitchSettings) -> RolloutFn:
    """Sample G completions per prompt with the current policy (transformers generate, left padding)."""

    @torch.no_grad()
    def rollout(prompts: list[list[dict[str, str]]], n: int) -> list[list[str]]:
        model.eval()
        tokenizer.padding_side = "left"
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        output = model.generate(**batch, do_sample=True, temperature=settings.rollout_temperature,
                                max_new_tokens=settings.max_completion_tokens + 16, num_return_sequences=n,
                                pad_token_id=tokenizer.pad_token_id)
        decoded = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        model.train()
        return [decoded[i * n: (i + 1) * n] for i in range(len(prompts))]

    return rollout


def run(config: StitchConfig) -> dict:
    from datasets import Dataset
    from peft import PeftModel, get_peft_model
    from trl import GRPOTrainer, SFTConfig, SFTTrainer

    # --- setup -------------------------------------------------------------------------------------
    if world_size() > 1:
        # Each update builds a fresh Trainer around one policy and hands it the optimizers that carry Adam's
        # moments across updates; DeepSpeed owns the optimizer and refuses that. Scale-out goes through verl.
        raise ConfigError(f"STITCH runs in one process (WORLD_SIZE is {world_size()}): launch it without "
                          f"`accelerate launch`, or run its GRPO half at scale with planner_grpo or verl "
                          f"(training/verl/README.md)")
    settings, out = config.stitch, Path(config.out)
    random.seed(settings.seed)
    torch.manual_seed(settings.seed)
    last = out / "last"
    model, tokenizer, base = load_lm_checkpoint(str(last) if (last / "adapter_config.json").exists() else config.model)
    if not isinstance(model, PeftModel):
        if not config.lora.enabled:
            raise ConfigError("stitch trains a LoRA adapter; set lora.enabled: true")
        model = get_peft_model(model, lora_config(config.lora))
    rows, _, chunks = planner_rows(config.data, base)
    traces = {t.question_id: t for t in read_jsonl(config.traces, PlannerTrace)}
    if not traces:
        raise ValueError(f"{config.traces} holds no traces; STITCH needs expert traces for hints and imitation")
    with ExitStack() as stack:  # R_QA's stack, when rewards.qa is on: stopped when training ends or fails
        judge = None
        if config.rewards.qa:
            client = Client.from_url(config.server_url or stack.enter_context(stack_in_background(config.serve)))
            judge = make_qa_judge(rows, chunks, client, config.correctness, config.rewards.k)
        reward_funcs, weights = build_rewards(config.rewards, judge)
        trainable = [p for p in model.parameters() if p.requires_grad]
        # no weight decay, as the Trainer-built optimizers of planner_sft / planner_grpo (torch's AdamW default is
        # 0.01): the weights then move only where a gradient moved them, which is what grpo_weight_change reports
        grpo_optimizer = torch.optim.AdamW(trainable, lr=config.grpo.lr, weight_decay=0.0)
        sft_optimizer = torch.optim.AdamW(trainable, lr=settings.sft_lr, weight_decay=0.0)
        state = {"step": 0, "success_rate": 0.0, "imitation": [], "history": []}
        if (last / "stitch_state.json").exists():
            state = json.loads((last / "stitch_state.json").read_text())
            grpo_optimizer.load_state_dict(torch.load(last / "grpo_optimizer.pt"))
            sft_optimizer.load_state_dict(torch.load(last / "sft_optimizer.pt"))
            print(f"resuming STITCH after step {state['step']}")
        count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
        rollout = policy_rollout(model, tokenizer, settings)
        tracker = start_run(config.tracking, "train stitch", config)
        log_path = out / "stitch_log.jsonl"
        out.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()

        # --- train -------------------------------------------------------------------------------------
        for step in range(state["step"] + 1, settings.steps + 1):
            sampler = random.Random(settings.seed * 100_003 + step)
            batch = sampler.sample(rows, min(settings.questions_per_step, len(rows)))
            routing = route(batch, rollout, traces, state["success_rate"], settings, count)
            state["success_rate"] = 0.8 * state["success_rate"] + 0.2 * (routing.solved_plain / len(batch))
            state["imitation"].extend(r["example_id"] for r in routing.imitation)
            record = {"step": step, "solve_none_ratio": 1 - routing.solved_plain / len(batch),
                      "hinted_solve_ratio": routing.solved_hinted / max(1, len(batch) - routing.solved_plain),
                      "rl_buffer": len(routing.rl), "imitation_buffer": len(state["imitation"]),
                      "success_rate": state["success_rate"], "format_valid": routing.format_valid,
                      "format_valid_strict": routing.format_valid_strict, "grpo_updates": 0, "sft_injection": False}
            if routing.rl:  # GRPO on the RL buffer (TRL regenerates on-policy rollouts of these prompts)
                # one generation batch = G rollouts of every buffered prompt, one prompt per micro-batch, one
                # optimizer step per ``grpo_steps``: the whole buffer shapes each update
                args = grpo_args(config.grpo, out / "grpo", weights, max_steps=settings.grpo_steps, save_strategy="no",
                                 num_generations=settings.num_generations,
                                 per_device_train_batch_size=settings.num_generations,
                                 gradient_accumulation_steps=len(routing.rl), steps_per_generation=None)
                trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, processing_class=tokenizer,
                                      train_dataset=Dataset.from_list(routing.rl), optimizers=(grpo_optimizer, None))
                before = [p.detach().clone() for p in trainable]
                trainer.train()
                logged = [r for r in trainer.state.log_history if "reward" in r]
                record["reward"] = logged[-1]["reward"] if logged else None
                # each reward's mean (TRL's rewards/<name>/mean): R_QA's share of the total shows here
                record["rewards"] = {key.split("/")[1]: value for key, value in (logged[-1] if logged else {}).items()
                                     if key.startswith("rewards/") and key.endswith("/mean")}
                # proof of an update: optimizer steps taken, their gradient norm (0 when every group's rewards were
                # flat: zero advantages) and how far the trainable (LoRA) weights moved
                record["grpo_updates"] = trainer.state.global_step
                record["grpo_grad_norm"] = logged[-1].get("grad_norm") if logged else None
                record["grpo_weight_change"] = float(sum((p.detach() - b).abs().sum()
                                                         for p, b in zip(trainable, before)))
            if len(state["imitation"]) >= settings.imitation_threshold:  # SFT on the full expert traces
                imitation = [traces[i] for i in state["imitation"]]
                sft_args = SFTConfig(output_dir=str(out / "sft"), max_steps=settings.sft_steps,
                                     learning_rate=settings.sft_lr, per_device_train_batch_size=min(8, len(imitation)),
                                     save_strategy="no", report_to="none", logging_steps=1, completion_only_loss=True,
                                     bf16=config.grpo.bf16, seed=settings.seed, ddp_backend=process_group_backend())
                sft = SFTTrainer(model=model, args=sft_args, processing_class=tokenizer,
                                 train_dataset=Dataset.from_list(trace_rows(imitation)),
                                 optimizers=(sft_optimizer, None))
                record["sft_loss"] = sft.train().training_loss
                record["sft_injection"], state["imitation"] = True, []
            # --- save ----------------------------------------------------------------------------------
            state["step"] = step
            state["history"].append(record)
            model.save_pretrained(last)
            tokenizer.save_pretrained(last)
            torch.save(grpo_optimizer.state_dict(), last / "grpo_optimizer.pt")
            torch.save(sft_optimizer.state_dict(), last / "sft_optimizer.pt")
            (last / "stitch_state.json").write_text(json.dumps(state, indent=2))
            with log_path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            tracker.log(record, step=step)
            print(json.dumps(record))

    final = out / "final"
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    summary = {"steps": state["step"], "sft_injections": sum(r["sft_injection"] for r in state["history"]),
               "final_success_rate": state["success_rate"], "n_prompts": len(rows), "n_traces": len(traces),
               "seconds": round(time.perf_counter() - started, 1)}
    write_manifest(final, {"kind": "planner", "base_model": base, "adapter": True, "recipe": "stitch",
                           "init": config.model, "config": to_dict(config), "metrics": summary,
                           "tracking_run": tracker.id})
    (out / "metrics.json").write_text(json.dumps({**summary, "history": state["history"]}, indent=2))
    tracker.summary(summary)
    tracker.finish()
    return summary
