"""The recipe hftrain runs: config's sections and the methods' own (`preference:`, `grpo:`, one per section the
registry names: registry.sections). config knows no method: it builds the sections this Recipe adds and asks them for
their rules (config.MethodSection). Every recipe is read through here, so no method's rules can be skipped by a
reader that never imported the methods."""

from __future__ import annotations

import dataclasses
from typing import Optional

from .. import config
from .registry import sections


def _recipe_type() -> type[config.Recipe]:
    """config.Recipe with one optional field per method section, built from the registry: a new method's section
    needs no edit here."""
    fields = [(key, Optional[cls], dataclasses.field(default=None, metadata={"help": cls.HELP}))
              for key, cls in sections().items()]
    recipe = dataclasses.make_dataclass("Recipe", fields, bases=(config.Recipe,))
    recipe.__module__ = __name__  # where pickle (the ranks' hand-over) and get_type_hints look it up
    return recipe


Recipe = _recipe_type()


def parse_recipe(path: str | None, overrides: list[str] | None = None, raw: dict | None = None
                 ) -> tuple[Recipe, list[str]]:
    """config.parse_recipe with the methods' sections: the recipe and every problem it shows."""
    return config.parse_recipe(path, overrides, raw, recipe_type=Recipe)


def load_recipe(path: str | None, overrides: list[str] | None = None, raw: dict | None = None) -> Recipe:
    """config.load_recipe with the methods' sections: the recipe, or a RecipeError naming every problem."""
    return config.load_recipe(path, overrides, raw, recipe_type=Recipe)
