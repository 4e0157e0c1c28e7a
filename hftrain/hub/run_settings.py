"""A finished run read for `hftrain push`: its recipe.yaml, and its `hub:` settings with the command line's on top."""

from __future__ import annotations

import dataclasses
import os

from ..config import HubSection, Recipe
from ..config.rules import hub_problems
from ..constants import RECIPE_FILE
from ..errors import HubError


def run_recipe(output_dir: str) -> str:
    """A finished run's recipe.yaml (the CLI reads it with the methods' sections: methods.load_recipe)."""
    path = os.path.join(output_dir, RECIPE_FILE)
    if not os.path.isfile(path):
        raise HubError(f"{output_dir} has no recipe.yaml: not a finished hftrain run (every recipe script writes it)")
    return path


def settings_for_run(recipe: Recipe, **overrides) -> HubSection:
    """The run's own `hub:` settings (its recipe.yaml, read: run_recipe) with the command line's values on top."""
    hub = recipe.hub if isinstance(recipe.hub, HubSection) else HubSection()
    hub = dataclasses.replace(hub, **{k: v for k, v in overrides.items() if v is not None})
    problems = [f"{k}: {m}" for k, m in hub_problems(dataclasses.replace(hub, push=False), recipe.model.lora)]
    if problems:
        raise HubError(problems, header="cannot push")
    return hub
