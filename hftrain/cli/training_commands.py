"""`hftrain launch` (the recipe's method) and one command per recipe script (`hftrain sft`, `dpo`, `grpo`): the
launcher's config rendered into a folder of the launch's own, the machines checked in, accelerate's launch run."""

from __future__ import annotations

import importlib.util
import shlex
import sys
import tempfile

from .. import lifetime
from ..config.strategy import resolved_strategy
from ..errors import LaunchError
from ..launch import check_recipe, machines
from ..distributed import accelerator_available
from ..launch.machines import check_in
from ..launch.ray_cluster import launch_on_ray
from ..launch.strategies import render
from ..methods import DEFAULT_SCRIPT, METHODS, SCRIPTS, entry_of
from ..methods.registry import BUILT_IN
from .arguments import recipe_arguments


def script_for(recipe, kind: str | None = None, script: str | None = None) -> list[str]:
    """What `hftrain launch` (sft, dpo) hands accelerate launch to run: a script of the user's own, else the recipe's
    method as a module of the package (hftrain/recipes/: dpo for a recipe with a preference: section, grpo for one
    with a grpo: section, else sft)."""
    if script:
        return [script]
    name = kind or entry_of(recipe).script
    if importlib.util.find_spec(f"hftrain.recipes.{name}") is None:  # a method registered from outside hftrain
        return ["-m", "hftrain.recipes", name]
    return ["-m", f"hftrain.recipes.{name}"]


def _check_machines(ns, strategy, s) -> None:
    """Several machines: machine 0's address and this machine's rank are set, and every machine checks in with
    machine 0 before anything is launched (a wrong rank fails here). `s` is `strategy` resolved."""
    if s.num_machines > 1 and not s.main_process_ip:
        raise LaunchError(f"{ns.recipe}: strategy.num_machines is {s.num_machines} but strategy.main_process_ip is "
                          "unset: set it to machine 0's address (the same on every machine), e.g. "
                          "strategy.main_process_ip=10.0.0.1")
    if s.num_machines > 1 and strategy.machine_rank is None:
        raise LaunchError(f"{ns.recipe}: strategy.num_machines is {s.num_machines} but this machine's rank is unset: "
                          "left out, every machine would take rank 0. Run `hftrain launch ... --machine-rank K` on "
                          f"machine K (0 on the machine at {s.main_process_ip}, "
                          f"1 .. {s.num_machines - 1} on the others)")
    if s.num_machines > 1 and not ns.dry_run:  # every machine checks in with machine 0: a wrong rank fails here
        check_in(s.main_process_ip, s.main_process_port, s.machine_rank, s.num_machines,
                 s.rank_timeout or machines.DEFAULT_TIMEOUT, say=lambda m: print(m, flush=True))


def _launch(ns) -> int:
    overrides = list(ns.overrides) + ([f"strategy.machine_rank={ns.machine_rank}"] if ns.machine_rank is not None
                                      else [])
    kind = getattr(ns, "kind", None)
    recipe, strategy = check_recipe(ns.recipe, overrides, script=lambda r: script_for(r, kind, ns.script))
    s = resolved_strategy(strategy)
    if ns.ray:
        return _launch_on_ray(ns, s)
    _check_machines(ns, strategy, s)
    # The launcher's config goes into a folder of this launch's own, not output_dir: nothing is written there before
    # the run's own checks pass (the run writes its resolved configs itself, on the main process), and machines
    # sharing output_dir cannot overwrite each other's machine_rank.
    with tempfile.TemporaryDirectory(prefix=f"hftrain-launch-node{s.machine_rank}-") as tmp:
        config = render(strategy, tmp, recipe.training, communication_data_type=recipe.compression.reduce_dtype())[0]
        # accelerate's launch command, ending on a signal or a failed worker with a status, not a traceback
        cmd = [sys.executable, "-m", "hftrain.launch.launcher", "--config_file", config]
        if ns.max_restarts:
            cmd += ["--max_restarts", str(ns.max_restarts)]
        # The recipe scripts ship in the package (hftrain/recipes/): run as modules, they work from any folder.
        cmd += [*script_for(recipe, kind, ns.script), ns.recipe, *overrides, f"strategy.name={strategy.name}"]
        print("hftrain: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
        if ns.dry_run:
            with open(config, encoding="utf-8") as fh:
                print(fh.read(), end="")
            return 0
        return lifetime.run_owned(cmd)


def _launch_on_ray(ns, s) -> int:
    """Each machine of the recipe as a Ray task running its own `hftrain launch --machine-rank K` (ray_cluster)."""
    if ns.machine_rank is not None or ns.dry_run or ns.max_restarts:
        raise LaunchError("--ray starts every machine itself: leave out --machine-rank, --max-restarts and --dry-run")
    command = [getattr(ns, "kind", None) or "launch", *(["--script", ns.script] if ns.script else [])]
    return launch_on_ray(ns.ray, command, ns.recipe, list(ns.overrides), s.num_machines,
                         s.num_processes // s.num_machines, accelerator_available(), s.main_process_ip)


BUILT_IN_SCRIPTS = {e.script for e in BUILT_IN}


def _training_commands() -> list[tuple[str, str]]:
    """`hftrain launch` (the recipe's method) and one command per recipe script, described from the registry."""
    by_section: dict[str | None, list[str]] = {}
    for m in METHODS:
        by_section.setdefault(m.section, []).append(m.name)
    chosen = "; ".join(f"a {section}: section: {', '.join(names)}" for section, names in by_section.items() if section)
    commands = [("launch", f"the recipe's method ({chosen}; else {DEFAULT_SCRIPT})")]
    for script in reversed(SCRIPTS):  # the default first
        names = ", ".join(m.name for m in METHODS if m.script == script)
        commands.append((script, f"{names} (hftrain/recipes/{script}.py)" if script in BUILT_IN_SCRIPTS
                         else names))
    return commands


def add_training_commands(sub) -> None:
    launch_help = ("Render the recipe's launcher config (into a private temporary folder) and run accelerate launch "
                   "with it; on several machines run it on each (--machine-rank K).")
    for name, what in _training_commands():
        la = sub.add_parser(name, allow_abbrev=False, help=f"Train: {what}. {launch_help}")
        recipe_arguments(la)
        if name == "launch":
            la.add_argument("--script", default=None, help="a training script of your own instead of the recipe's "
                            "method")
        la.add_argument("--max-restarts", dest="max_restarts", type=int, default=0,
                        help="restart the workers this many times when one dies")
        la.add_argument("--machine-rank", dest="machine_rank", type=int, default=None,
                        help="this machine's rank (same as strategy.machine_rank=K); run once on each machine")
        la.add_argument("--dry-run", action="store_true", help="print the command and the launcher config only")
        la.add_argument("--ray", metavar="ADDRESS", default=None,
                        help="run the machines (strategy.num_machines) as tasks on the Ray cluster at ADDRESS "
                        "(e.g. 10.0.0.1:6379, or auto), each its own `hftrain launch --machine-rank K`")
        la.set_defaults(fn=_launch, kind=None if name == "launch" else name, script=None)
