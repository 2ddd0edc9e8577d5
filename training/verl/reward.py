"""verl's reward entry for the planner: ``custom_reward_function.path=training/verl/reward.py``,
``custom_reward_function.name=compute_score``.

verl calls ``compute_score(data_source, solution_str, ground_truth, extra_info)`` once per rollout;
this applies the same reward functions as the TRL recipes (``training/rewards.py``) with the weights
the export stored in ``extra_info``. R_QA is not available here (it needs the served generator): the export
refuses ``rewards.qa`` > 0, and so does this entry for rows that carry such a weight. It
returns a dict: ``score`` (the weighted sum verl optimises) plus every term, which verl logs.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from overstory.training.rewards import align_reward, format_reward, make_cost_reward, make_length_reward


@lru_cache(maxsize=4)
def _tokenizer(name: str):
    from overstory.models.registry import load_tokenizer

    return load_tokenizer(name)


def compute_score(data_source: str, solution_str: str, ground_truth: dict, extra_info: dict | None = None,
                  **kwargs: Any) -> dict[str, float]:
    info = extra_info or {}
    weights = info.get("reward_weights", {})
    if weights.get("qa"):
        raise ValueError(f"reward_weights.qa is {weights['qa']}: verl's reward entry cannot compute R_QA (it needs the "
                         f"served generator); export with rewards.qa: 0")
    ids = _tokenizer(info.get("tokenizer", "builtin:smollm2-135m-instruct"))(solution_str, add_special_tokens=False)
    completions = [solution_str]
    terms = {
        "format": format_reward(completions)[0],
        "length": make_length_reward(int(weights.get("max_completion_tokens", 128)))(
            completions, completion_ids=[ids["input_ids"]])[0],
        "align": align_reward(completions, level_min=[ground_truth["level_min"]],
                              level_max=[ground_truth["level_max"]])[0],
        "cost": make_cost_reward(int(weights.get("k", 5)))(completions, level_tokens=[info["level_tokens"]])[0]
        if "level_tokens" in info else 0.0,
    }
    score = sum(float(weights.get(name, 0.0)) * value for name, value in terms.items())
    return {"score": score, **terms}
