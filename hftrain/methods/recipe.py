"""The recipe hftrain runs: config's sections and the methods' own (`preference:`, `grpo:`). config knows no method:
it builds the sections this Recipe adds and asks them for their rules (config.MethodSection). Every recipe is read
through here, so no method's rules can be skipped by a reader that never imported the methods."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import config
from .grpo.grpo_section import GrpoSection
from .preference.preference_section import PreferenceSection


@dataclass
class Recipe(config.Recipe):
    preference: PreferenceSection | None = field(default=None, metadata={"help": PreferenceSection.HELP})
    grpo: GrpoSection | None = field(default=None, metadata={"help": GrpoSection.HELP})


def parse_recipe(path: str | None, overrides: list[str] | None = None, raw: dict | None = None
                 ) -> tuple[Recipe, list[str]]:
    """config.parse_recipe with the methods' sections: the recipe and every problem it shows."""
    return config.parse_recipe(path, overrides, raw, recipe_type=Recipe)


def load_recipe(path: str | None, overrides: list[str] | None = None, raw: dict | None = None) -> Recipe:
    """config.load_recipe with the methods' sections: the recipe, or a RecipeError naming every problem."""
    return config.load_recipe(path, overrides, raw, recipe_type=Recipe)
