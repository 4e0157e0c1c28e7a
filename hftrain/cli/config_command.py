"""`hftrain config`: the accelerate config (and DeepSpeed JSON) of a recipe's strategy, or of --strategy NAME /
--all, and with --slurm the SLURM job script; a folder holding a run is never rewritten."""

from __future__ import annotations

import os
from dataclasses import replace

from ..config import RecipeError, StrategySection
from ..constants import STRATEGIES
from ..fileio import atomic_write
from ..launch import check_recipe
from ..launch.slurm import LAUNCHERS, prepare_log_folder, slurm_script
from ..launch.strategies import render, run_files_rewritten


def _what_to_render(ns):
    """(recipe or None, strategy, the strategy names to render, the folder, training:, the reduce dtype): the
    recipe's strategy (checked without this machine's say), or --strategy NAME / --all without a recipe."""
    recipe, training, comm_dtype, overrides = None, None, None, list(ns.overrides)
    if not ns.slurm and (ns.launcher or ns.script):
        raise RecipeError(["command line: --launcher and --script shape the SLURM script: add --slurm"])
    if ns.recipe:
        if ns.strategy:
            overrides.append(f"strategy.name={ns.strategy}")
        recipe, strategy = check_recipe(ns.recipe, overrides, environment=False)
        if recipe.strategy.name is None:
            raise RecipeError([f"{ns.recipe}: strategy.name is unset; set it in the recipe or pass --strategy NAME"])
        training, comm_dtype = recipe.training, recipe.compression.reduce_dtype()
        out = ns.output or recipe.output_dir
        names = [strategy.name]
    else:
        if ns.overrides:
            raise RecipeError(["command line: overrides need a recipe: hftrain config RECIPE key=value ..."])
        if not ns.strategy and not ns.all:
            raise RecipeError(["command line: give a recipe, --strategy NAME or --all"])
        names = list(STRATEGIES) if ns.all else [ns.strategy]
        strategy, out = StrategySection(), ns.output or "accelerate_configs"
    return recipe, strategy, names, out, training, comm_dtype


def _write_slurm_script(ns, recipe, strategy: StrategySection, out: str, config_path: str) -> list[str]:
    """--slurm: OUTPUT/launch.sbatch for the rendered launcher config, and the log folder it writes to."""
    if not ns.recipe:
        raise RecipeError(["command line: --slurm needs a recipe: hftrain config RECIPE --slurm"])
    path = os.path.join(out, "launch.sbatch")
    atomic_write(path, slurm_script(recipe, strategy, ns.recipe, ns.overrides, config_path=config_path,
                                    launcher=ns.launcher or "accelerate", script=ns.script, path=path))
    os.chmod(path, 0o755)
    return [path, prepare_log_folder(recipe)]


def _config(ns) -> int:
    recipe, strategy, names, out, training, comm_dtype = _what_to_render(ns)
    for name in names:
        changed = run_files_rewritten(replace(strategy, name=name), out, training, comm_dtype)
        if changed:
            raise RecipeError([f"{out} holds a run, and rendering there would rewrite the launcher config it wrote for "
                               f"itself ({', '.join(changed)}): render into another folder with --output DIR"])
        written = render(replace(strategy, name=name), out, training, communication_data_type=comm_dtype)
        if ns.slurm:
            written += _write_slurm_script(ns, recipe, replace(strategy, name=name), out, written[0])
        for path in written:
            print(f"hftrain: wrote {path}")
    return 0


def add_config_command(sub) -> None:
    g = sub.add_parser("config", allow_abbrev=False,
                       help="Write the accelerate config (and DeepSpeed JSON) for a recipe's strategy, or for "
                       "--strategy NAME / --all.")
    g.add_argument("recipe", nargs="?", help="recipe YAML (optional)")
    g.add_argument("overrides", nargs="*", help="section.key=value overrides")
    g.add_argument("--strategy", choices=STRATEGIES)
    g.add_argument("--all", action="store_true", help="every strategy (how accelerate_configs/ is made)")
    g.add_argument("--output", help="folder to write to (default: the recipe's output_dir, or accelerate_configs)")
    g.add_argument("--slurm", action="store_true", help="also write launch.sbatch, the SLURM job: one launcher per "
                   "node, logs in OUTPUT_DIR/slurm, a checkpoint and a requeue before the time limit")
    g.add_argument("--launcher", choices=LAUNCHERS, default=None,
                   help="--slurm: the launcher each node runs (torchrun: ddp; deepspeed: zero*; default accelerate)")
    g.add_argument("--script", default=None, help="--slurm: a training script of your own instead of the recipe's "
                   "method")
    g.set_defaults(fn=_config)
