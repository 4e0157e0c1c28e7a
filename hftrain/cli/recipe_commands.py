"""`hftrain check` (a recipe validated as the run would), `prepare` (its data into the datasets cache) and `data`
(what the recipe trains on, rendered)."""

from __future__ import annotations

import time

from ..config.strategy import STRATEGY_DEFAULTS
from ..data.cache import cache_folder
from ..launch import check_data, check_recipe
from ..methods import method_of
from ..modeling import load_tokenizer
from .arguments import recipe_arguments
from .training_commands import script_for


def _check(ns) -> int:
    recipe, strategy = check_recipe(ns.recipe, ns.overrides, script=script_for)
    if not ns.no_data:
        world = strategy.num_processes or STRATEGY_DEFAULTS["num_processes"]
        check_data(recipe, world // strategy.resolved_sequence_parallel())  # data-parallel ranks
    print(recipe.to_yaml(), end="")
    return 0


def _prepare(ns) -> int:
    recipe, strategy = check_recipe(ns.recipe, ns.overrides)
    start = time.monotonic()
    check_data(recipe, strategy.num_processes or STRATEGY_DEFAULTS["num_processes"])
    what = "eval sources (training rows stream)" if recipe.data.streaming else "data"
    print(f"hftrain: {what} prepared in {time.monotonic() - start:.1f} s, cached under {cache_folder()} (the run "
          "memory-maps it; HF_DATASETS_CACHE moves it)")
    return 0


def _data(ns) -> int:
    recipe, _ = check_recipe(ns.recipe, ns.overrides)
    tokenizer = load_tokenizer(recipe.model, recipe.data.chat_template)
    print(method_of(recipe).show(recipe, tokenizer, ns.examples))  # as the method's trainer gets its rows
    return 0


def add_check_command(sub) -> None:
    c = sub.add_parser("check", allow_abbrev=False,
                       help="Validate a recipe as the run would (every problem at once: the recipe, its strategy, "
                       "paths, output_dir, resume, NVMe; then every data row), and print it resolved.")
    recipe_arguments(c)
    c.add_argument("--no-data", dest="no_data", action="store_true",
                   help="skip the data phase (tokenizer and every row of every source)")
    c.set_defaults(fn=_check)


def add_prepare_command(sub) -> None:
    pr = sub.add_parser("prepare", allow_abbrev=False,
                        help="Read and tokenise the recipe's data into the datasets cache ahead of the job, with "
                        "data.num_proc processes (default: the cores available); the run then only memory-maps it. "
                        "On a shared filesystem the whole job reuses it.")
    recipe_arguments(pr)
    pr.set_defaults(fn=_prepare)


def add_data_command(sub) -> None:
    d = sub.add_parser("data", allow_abbrev=False,
                       help="Show what the recipe trains on: per source its layout, token counts, truncation and "
                       "drops (from the prepared data, prepared first if need be; streaming: the first rows), and its "
                       "first examples rendered with the trained tokens between [[ and ]].")
    recipe_arguments(d)
    d.add_argument("--examples", type=int, default=2, help="rendered examples per source (default 2)")
    d.set_defaults(fn=_data)
