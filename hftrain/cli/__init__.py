"""The `hftrain` command: `check` a recipe, `prepare` or show its `data`, render its strategy `config`, `plan` memory,
`launch`, `push`, `score` a reward model, `eval` a model against its base, `export` it, `tiny-model`, `moe upcycle`.
Each command registers itself from its module: recipe_commands (check, prepare, data), config_command,
plan_command, training_commands (launch, sft, dpo, grpo), push_command, score_command, eval_command, export_command,
moe_commands; tiny-model from hftrain.tiny."""

from __future__ import annotations

import argparse

from ..errors import exit_on_user_error
from ..methods import SCRIPTS
from ..tiny import add_tiny_model_command
from .config_command import add_config_command
from .eval_command import add_eval_command
from .export_command import add_export_command
from .moe_commands import add_moe_command
from .plan_command import add_plan_command
from .push_command import add_push_command
from .recipe_commands import add_check_command, add_data_command, add_prepare_command
from .score_command import add_score_command
from .training_commands import add_training_commands

# Each subcommand registers itself: its parser, its options and the function that runs it (`fn`).
COMMANDS = (add_check_command, add_prepare_command, add_data_command, add_config_command, add_plan_command,
            add_training_commands, add_push_command, add_score_command, add_eval_command, add_export_command,
            add_tiny_model_command, add_moe_command)
TAKES_OVERRIDES = ("check", "config", "data", "launch", "plan", "prepare", *SCRIPTS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hftrain", allow_abbrev=False, description="Fine-tune LLMs from one YAML recipe.")
    sub = p.add_subparsers(dest="command", required=True)
    for register in COMMANDS:
        register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come anywhere after the recipe, also after options: gather what argparse left over.
    ns, extra = parser.parse_known_args(argv)
    if extra and ns.command in TAKES_OVERRIDES:
        ns.overrides = list(ns.overrides or []) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    with exit_on_user_error():
        return ns.fn(ns)
