"""The training methods, one module each (sft; dpo: DPO and IPO; simpo; orpo; kto; grpo), each owning its trainer,
its TRL config where it has one, its data phase and how `hftrain data` shows its rows (base.Method); policy.py holds
the policy the TRL-based methods share; preference_section.py and grpo_section.py the recipe sections that select
them, with their rules (recipe.py: the Recipe with them, and how every recipe is read). The registry below is what
the CLI, the run's set-up and preflight iterate: adding a method is a module here with its METHOD, listed in METHODS.
"""

from . import dpo, grpo, kto, orpo, sft, simpo
from .base import Method
from .grpo_section import GrpoSection, RewardSpec
from .preference_section import PreferenceSection
from .recipe import Recipe, load_recipe, parse_recipe

# In the order they are asked whether a recipe selects them: DPO, the preference: section's default, after the other
# preference losses; SFT, which takes any recipe, last.
METHODS: tuple[Method, ...] = (kto.METHOD, orpo.METHOD, simpo.METHOD, dpo.METHOD, grpo.METHOD, sft.METHOD)
SCRIPTS = tuple(dict.fromkeys(m.script for m in METHODS))  # hftrain sft / dpo / grpo
DEFAULT_SCRIPT = METHODS[-1].script  # the script of the method that takes any recipe


def method_of(recipe: Recipe) -> Method:
    """The method a recipe trains with (its preference: or grpo: section, else SFT)."""
    return next(m for m in METHODS if m.selects(recipe))


__all__ = ["METHODS", "SCRIPTS", "DEFAULT_SCRIPT", "Method", "method_of", "Recipe", "load_recipe", "parse_recipe",
           "GrpoSection", "PreferenceSection", "RewardSpec"]
