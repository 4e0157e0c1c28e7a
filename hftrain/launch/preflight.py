"""The one validation path: every problem a recipe has in this environment, found before anything is loaded.

`check_recipe` (called by `hftrain check`, `config`, `launch` and the run) raises the recipe's own problems, its
strategy's and this machine's all at once. What this machine says is gathered by area: the model and settings
(model_checks), the strategy (strategy_checks), output_dir and the checkpoint to resume (output_checks), the models
held beside the policy against the device in the memory plan (memory_checks);
`check_data` (data_checks) is the data phase `hftrain check` and the run share.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Callable

from ..config import Recipe, StrategySection
from ..config.fields import is_of_type
from ..config.strategy_rules import strategy_problems
from ..config.strategy import STRATEGY_DEFAULTS
from ..constants import STRATEGIES
from ..errors import RecipeError
from ..harness import harness_problems
from ..methods import parse_recipe
from ..trackers import report_to_problems
from . import libraries, model_libraries
from .memory_checks import frozen_fit_problems
from .model_checks import model_problems, setting_problems
from .output_checks import output_problems
from .strategy_checks import machine_problems


def _message(recipe: Recipe, key: str, msg: str) -> str:
    """'origin: key: message' (a message that already begins with its key keeps its own wording)."""
    return f"{recipe.where(key)}: {msg if msg.startswith(key) else f'{key}: {msg}'}"


def check_recipe(path: str | None, overrides: list[str] | None = None, *, raw: dict | None = None,
                 launcher: str | None = None, world_size: int | None = None, environment: bool = True,
                 script: list[str] | Callable[[Recipe], list[str]] | None = None
                 ) -> tuple[Recipe, StrategySection]:
    """The recipe and the strategy that will run, or a RecipeError with every problem found.

    `launcher` is the strategy the launcher set up and `world_size` the processes it started (the run passes both;
    `hftrain check` / `launch` / `config` pass neither, and the strategy is then strategy.name, or ddp as `hftrain
    launch` runs it, on strategy.num_processes processes). ZeRO-Infinity's swap buffers are sized here to the
    largest parameter partition. `environment=False` (`hftrain config`, which may render for another machine)
    leaves out what this machine says. `script` (`hftrain check`, `hftrain launch`: what the launch hands accelerate
    launch to run, `-m hftrain.recipes.sft` or a script's path) adds what `accelerate launch` itself would refuse of
    the launch (launch.libraries)."""
    recipe, problems = parse_recipe(path, overrides, raw)
    s = recipe.strategy
    if launcher is not None and s.name in STRATEGIES and s.name != launcher:
        problems.append(
            f"{recipe.where('strategy.name')}: strategy.name is '{s.name}' but the launcher set up '{launcher}'. "
            f"Launch with `--config_file accelerate_configs/{s.name}.yaml` (or `hftrain launch`), or set "
            f"strategy.name to '{launcher}', or remove strategy.name to let the launcher decide")
        raise RecipeError(problems)  # the rules below would judge a strategy that is not the one asked for
    if world_size is not None and is_of_type(s.num_processes, int) and s.num_processes != world_size:
        problems.append(
            f"{recipe.where('strategy.num_processes')}: strategy.num_processes is {s.num_processes} but the launcher "
            f"started {world_size} processes; launch with `hftrain launch` (or --num_processes {s.num_processes}), "
            "or remove strategy.num_processes to let the launcher decide")
    name = launcher or s.name or "ddp"
    if name not in STRATEGIES:  # a wrong strategy.name, already reported
        raise RecipeError(problems)
    if name != s.name:  # recipe_problems ran the strategy's rules only for a strategy the recipe names
        problems += [_message(recipe, k, m) for k, m in strategy_problems(recipe, name)]
    world = world_size or (s.num_processes if is_of_type(s.num_processes, int) else STRATEGY_DEFAULTS["num_processes"])
    sp = s.sequence_parallel if is_of_type(s.sequence_parallel, int) else 1
    if sp > 1 and world % sp and not is_of_type(s.num_processes, int):  # a set num_processes is judged by the rules
        problems.append(f"{recipe.where('strategy.sequence_parallel')}: strategy.sequence_parallel: {sp} must divide "
                        f"the {world} processes (data-parallel groups of {sp} ranks share each sequence); launch a "
                        f"multiple of {sp} processes")
    strategy = replace(s, name=name)
    problems += [_message(recipe, k, m) for k, m in model_libraries.moe_problems(recipe, world)]
    for section in recipe.method_sections().values():  # the method's own, over these processes and this machine
        problems += [_message(recipe, k, m) for k, m in section.launch_problems(recipe, world, environment)]
    if "training.report_to" not in recipe.invalid:  # the trackers: names, never "all"; installed, server, login
        problems += [_message(recipe, k, m) for k, m in report_to_problems(recipe.training_value("report_to"),
                                                                            environment)]
    problems += [_message(recipe, k, m) for k, m in harness_problems(recipe, environment)]  # eval.harness
    if environment:
        # The run's own train() says what it accepts with a caveat (an unverified checkpoint); check and launch say it.
        warn = (lambda m: print(m, file=sys.stderr, flush=True)) if launcher is None else (lambda _m: None)
        env, strategy = environment_problems(recipe, strategy, world, skip=recipe.invalid, warn=warn)
        problems += env
    if environment and script and launcher is None and not problems:  # the launch itself, as accelerate will run it
        script = script(recipe) if callable(script) else script
        problems += [_message(recipe, k, m) for k, m in libraries.launch_problems(recipe, strategy, script)]
    if problems:
        raise RecipeError(problems)
    return recipe, strategy


def environment_problems(recipe: Recipe, strategy: StrategySection, world: int, skip: set[str] = frozenset(),
                         warn=lambda _m: None) -> tuple[list[str], StrategySection]:
    """What this machine says about the recipe: paths that cannot be loaded or written, a checkpoint that cannot be
    resumed, TrainingArguments' own rules, NVMe and DeepSpeed ops. Keys in `skip` already have a problem."""
    m = recipe.model
    model_ok = m is not None and is_of_type(m.name_or_path, str) and not any(k.startswith("model.") for k in skip)
    out = model_problems(recipe, skip, model_ok) + setting_problems(recipe, skip)
    strategy, machine = machine_problems(recipe, strategy, world, skip, model_ok)
    out += machine + output_problems(recipe, strategy, world, skip, model_ok, warn)
    out += frozen_fit_problems(recipe, strategy, world, skip) if model_ok else []
    return [_message(recipe, k, msg) for k, msg in out], strategy
