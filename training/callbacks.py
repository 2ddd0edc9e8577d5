"""Hugging Face Trainer callbacks shared by the recipes built on Trainer (sentence-transformers, TRL).

``TrackingCallback`` sends the Trainer's logs (loss, learning rate, grad norm, eval metrics,
throughput) to the run from ``overstory/core/tracking.py``, so ``tracking.backend=wandb|jsonl|none``
means the same thing in every recipe (the Trainer's own ``report_to`` is set to "none").
``StopOnNonFiniteLoss`` turns a NaN or infinite training loss into ``TrainingDiverged``: the
checkpoints already written stay as they were.
"""

from __future__ import annotations

import math

from transformers import TrainerCallback

from overstory.core.tracking import Run


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite; the message says where and what to change."""


class TrackingCallback(TrainerCallback):
    def __init__(self, run: Run):
        self.run = run

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.run.log({k: v for k, v in logs.items() if isinstance(v, (int, float))}, step=state.global_step)


class StopOnNonFiniteLoss(TrainerCallback):
    """Needs ``logging_nan_inf_filter=False`` so the Trainer logs the non-finite loss instead of hiding it."""

    def __init__(self, hint: str = "lower the learning rate or check the data"):
        self.hint = hint

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(loss):
            raise TrainingDiverged(f"non-finite training loss ({loss}) at step {state.global_step}; checkpoints in "
                                   f"{args.output_dir} are from before it. {self.hint}.")
