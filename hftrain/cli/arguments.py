"""What the commands that read a recipe take: the recipe and its section.key=value overrides."""

from __future__ import annotations

import argparse


def recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
