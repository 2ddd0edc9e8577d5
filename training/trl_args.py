"""TRL's own settings in a recipe's config: a section (``trl:`` in planner_sft, planner_grpo and distill-scorer,
``trl_grpo:`` / ``trl_sft:`` in STITCH) passed through to TRL's ``SFTConfig`` / ``GRPOConfig`` after the recipe's
own arguments, so every TRL field (scheduler, optimizer, packing, ``report_to``, vLLM colocation, ...) is there
without a wrapper field for each.

A section is checked when the config is loaded, before any work: a name that is not a field of the TRL dataclass
is refused with the closest valid one; a field that one of the recipe's short names sets (``train.lr`` sets
``learning_rate``) is refused naming that key, so a value is never given two ways; a field the recipe derives and
must own (``output_dir``, the reward weights, ...) is refused saying why. The recipe's remaining arguments are
defaults that the section replaces (``report_to: none``, ``save_total_limit: 2``, ...).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Literal

from overstory.core.config import ConfigError

TrlClass = Literal["SFTConfig", "GRPOConfig"]

# every recipe's final folder goes to the hub through its own push_to_hub setting, with the model card; the
# Trainer's push would upload checkpoints instead
HUB_OWNED: dict[str, str] = {
    name: "set the recipe's push_to_hub: <repo id>, which uploads the final folder with its model card"
    for name in ("push_to_hub", "hub_model_id", "hub_strategy")}


def trl_class(name: TrlClass) -> type:
    """TRL's argument dataclass by name (imported when a section or a run needs it: TRL takes seconds to load)."""
    import trl

    return getattr(trl, name)


def trl_fields(name: TrlClass) -> list[str]:
    """The fields of a TRL argument dataclass that its constructor takes.

    >>> "lr_scheduler_type" in trl_fields("SFTConfig") and "use_vllm" in trl_fields("GRPOConfig")
    True
    """
    return sorted(f.name for f in dataclasses.fields(trl_class(name)) if f.init)


def check_section(section: dict[str, Any], key: str, name: TrlClass, aliases: dict[str, str],
                  owned: dict[str, str]) -> None:
    """Refuse a name of ``section`` (the config's ``key``) that is no field of TRL's ``name``, one that an alias
    sets (``aliases``: TRL field -> the config key that sets it) or one the recipe owns (``owned``: field -> why)."""
    if not section:
        return
    fields = trl_fields(name)
    for field in section:
        if field not in fields:
            close = difflib.get_close_matches(str(field), fields, n=1, cutoff=0.6)
            hint = f"; did you mean '{key}.{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{key}.{field}': not a field of trl.{name}{hint}")
        if field in owned:
            raise ConfigError(f"{key}.{field}: the recipe sets it itself ({owned[field]})")
        if field in aliases:
            raise ConfigError(f"{key}.{field} is what {aliases[field]} sets: give it there, not both ways")


def build_args(name: TrlClass, recipe: dict[str, Any], section: dict[str, Any], key: str) -> Any:
    """TRL's ``name`` from the recipe's arguments, then the section's (checked by ``check_section``); a value TRL
    refuses is a ConfigError naming the section."""
    try:
        return trl_class(name)(**{**recipe, **section})
    except (TypeError, ValueError) as exc:
        given = ", ".join(f"{field}={value!r}" for field, value in section.items()) or "empty"
        raise ConfigError(f"trl.{name} refused the arguments built from the recipe's settings and {key} "
                          f"({given}): {exc}") from exc
